"""The training loop and what it runs each step.

Modules: trainer.py (`Trainer`, `train`: the loop), step.py (one optimizer step and the
no-grad passes before it), loss.py (the objective family and IS correction), packing.py
(packed batches and micro-batch plans), schedule.py (the LR schedule).

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
