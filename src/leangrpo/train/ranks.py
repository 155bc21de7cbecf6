"""The ranks of one process, as the no-grad passes and an optimizer step see them.

`OneProcess` implements `contracts.StepRanks` for a single process: every collective is
an identity (what a world-size-1 `DistContext` also does), the gradient norm is torch's
`clip_grad_norm_` and the passes leave nothing gathered. Torchrun's counterpart is
`distributed.strategy.TorchrunRanks`; `distributed.strategy.choose_strategy` picks one at
set-up, so the step runs one code path either way (docs/distributed.md, "A step").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class OneProcess:
    """Rank 0 of 1: collectives return their input."""

    rank = 0
    world_size = 1
    processes = 1

    def all_reduce(self, values: Sequence[float], op: str = "sum") -> list[float]:
        return [float(v) for v in values]

    def all_true(self, flag: bool) -> bool:
        return flag

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def clip_gradients(self, parameters: list[torch.Tensor], max_norm: float | None) -> float:
        """The gradient norm over `parameters`, clipped to `max_norm` (None: not clipped)."""
        return clip_gradients(parameters, max_norm)

    def release_gathered(self, policy: Any) -> None:
        """Nothing is gathered in one process."""


def clip_gradients(parameters: list[torch.Tensor], max_norm: float | None) -> float:
    """torch's clip_grad_norm_ over the parameters that have a gradient (0.0: none has)."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    limit = max_norm if max_norm is not None else float("inf")
    return float(torch.nn.utils.clip_grad_norm_(params, limit))


ONE_PROCESS = OneProcess()
