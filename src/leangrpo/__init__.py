"""leangrpo: memory-lean, asynchronous GRPO.

From Python: `leangrpo.GRPO(config, reward_funcs=..., train_dataset=...).train()` returns a
`TrainResult`; `leangrpo.evaluate(run_or_checkpoint, data=...)` an `EvalResult` (what
`leangrpo eval` prints). They live in leangrpo/api/ and are imported on first use, so
`import leangrpo` (and the CLI) stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from leangrpo.api.evaluation import EvalResult, evaluate
    from leangrpo.api.grpo import GRPO, TrainResult

__version__ = "0.1.0"
_HOMES = {
    "GRPO": "api.grpo",
    "TrainResult": "api.grpo",
    "evaluate": "api.evaluation",
    "EvalResult": "api.evaluation",
}
__all__ = ["GRPO", "EvalResult", "TrainResult", "evaluate"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'leangrpo' has no attribute '{name}'")
    return getattr(importlib.import_module(f"leangrpo.{_HOMES[name]}"), name)
