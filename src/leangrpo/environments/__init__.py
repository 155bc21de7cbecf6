"""Multi-turn rollouts: environments and tools on the same packed, async machinery.

Modules: protocol.py (`Environment`, `ToolEnvironment`, `ModelTurn`, `StepResult`: what a
user writes), tools.py (schemas, the Hermes parser, tool messages), rendering.py
(token-exact turn-by-turn rendering and the start-up template check), driver.py
(`MultiTurnRollout`: turns from the engine, replies from the environments), pool.py
(environment workers, trainer side), worker.py (the worker process), wire.py (its
replies), registry.py (names of environments, tools, parsers), setup.py (what a run
builds at start-up), metrics.py (`multiturn/*`), adapters/ (reasoning-gym, verifiers).

The names below are imported from here (on first use, so a worker starts fast); the rest
from their modules. See docs/multiturn.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from leangrpo.environments.protocol import (
        Environment,
        ModelTurn,
        StepResult,
        ToolEnvironment,
    )
    from leangrpo.environments.tools import ToolCall

_HOMES = {
    **dict.fromkeys(["Environment", "ModelTurn", "StepResult", "ToolEnvironment"], "protocol"),
    "ToolCall": "tools",
}
__all__ = ["Environment", "ModelTurn", "StepResult", "ToolCall", "ToolEnvironment"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'leangrpo.environments' has no attribute '{name}'")
    return getattr(importlib.import_module(f"leangrpo.environments.{_HOMES[name]}"), name)
