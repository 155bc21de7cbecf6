"""Reward functions: a registry (built-ins, `module:function`, `file.py:function`), the
start-up check, and a pool of worker processes that runs them with limits.

Modules by role: registry.py (names, specs, errors), check.py (`check_rewards`),
pool.py (`RewardPool`: scheduling, failures, metrics), worker.py (the worker's code),
protocol.py (its replies), builtin.py (the built-in rewards). Starting, confining,
limiting and killing worker processes is the sandbox package's (src/leangrpo/sandbox/).

The names below are imported on first use, so that a worker process, which imports only
worker.py and what it needs, starts fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from leangrpo.rewards.check import check_rewards
    from leangrpo.rewards.pool import RewardPool
    from leangrpo.rewards.registry import (
        BUILTIN_NAMES,
        PoolClosedError,
        ResolvedReward,
        RewardError,
        RewardFailedError,
        RewardSpecError,
        parse_specs,
        resolve,
    )

_HOMES = {
    "check_rewards": "check",
    "RewardPool": "pool",
    **dict.fromkeys(
        [
            "BUILTIN_NAMES",
            "PoolClosedError",
            "ResolvedReward",
            "RewardError",
            "RewardFailedError",
            "RewardSpecError",
            "parse_specs",
            "resolve",
        ],
        "registry",
    ),
}
__all__ = [
    "BUILTIN_NAMES",
    "PoolClosedError",
    "ResolvedReward",
    "RewardError",
    "RewardFailedError",
    "RewardPool",
    "RewardSpecError",
    "check_rewards",
    "parse_specs",
    "resolve",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'leangrpo.rewards' has no attribute '{name}'")
    return getattr(importlib.import_module(f"leangrpo.rewards.{_HOMES[name]}"), name)
