"""The learning-rate schedule: linear warmup over `train.warmup_steps`, then constant,
linear to 0 or half a cosine to 0 at the horizon (the `run.max_steps` the run started
with: a resume keeps it, see checkpoint/rundir.py `schedule_horizon`), and 0 past it.

transformers' get_scheduler formulas, written out (importing them pulls
transformers.trainer_utils and peft). Unlike transformers' "constant", which ignores the
warmup, "constant" warms up as train.warmup_steps says; unlike its cosine, which rises
again past the horizon, linear and cosine stay at 0 there.
"""

from __future__ import annotations

import math

import torch

from leangrpo.config.training import TrainConfig


def make_scheduler(
    optimizer: torch.optim.Optimizer, train: TrainConfig, horizon: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule of `train.lr_scheduler` over `horizon` optimizer steps."""
    warmup, kind, total = train.warmup_steps, train.lr_scheduler, horizon

    def factor(step: int) -> float:
        if step < warmup:
            return float(step) / float(max(1, warmup))
        if kind == "constant":
            return 1.0
        if kind == "linear":
            return max(0.0, float(total - step) / float(max(1, total - warmup)))
        progress = min(1.0, float(step - warmup) / float(max(1, total - warmup)))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
