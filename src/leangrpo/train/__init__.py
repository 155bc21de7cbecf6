"""The training loop and what it runs each step.

Modules: trainer.py (`Trainer`, `train`: the loop), strategy.py (one process or torchrun,
chosen once at set-up), planning.py (a batch cut into optimizer steps and packed
micro-batches), passes.py (the no-grad old and reference passes), inputs.py (the loss's
inputs and the step's normalisers), inflight.py (the batch in progress, resumable),
step.py (one optimizer step), ranks.py (the ranks of one process, as the step sees them),
loss.py (the objective family and IS correction), packing.py (packed batches and
micro-batch plans), schedule.py (the LR schedule). See docs/training.md.

`Trainer` and `train` are imported from here (on first use); the rest from their modules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from leangrpo.train.trainer import Trainer, train

_HOMES = {"Trainer": "trainer", "train": "trainer"}
__all__ = ["Trainer", "train"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'leangrpo.train' has no attribute '{name}'")
    return getattr(importlib.import_module(f"leangrpo.train.{_HOMES[name]}"), name)
