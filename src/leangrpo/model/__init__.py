"""The policy: loading, LoRA, dropout, checkpointing and the frozen reference (policy.py),
the packed scoring forward and reference log-probs (scoring.py), the quantized base
(quantization.py), what a run leaves in final/ (final.py), model-file checks without torch
(files.py), and the SmolLM2-135M-Instruct fixture the real-model tests use (smollm2.py,
`python -m leangrpo.model.smollm2`).

`load_final` and `merge_adapter` are imported from here (on first use); the rest from
their modules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from leangrpo.model.final import load_final, merge_adapter

_HOMES = {"load_final": "final", "merge_adapter": "final"}
__all__ = ["load_final", "merge_adapter"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'leangrpo.model' has no attribute '{name}'")
    return getattr(importlib.import_module(f"leangrpo.model.{_HOMES[name]}"), name)
