"""One process or torchrun, chosen once (distributed/strategy.py): which process makes
rollouts is the strategy's to say, not a branch in the trainer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from support.configs import minimal_run

from leangrpo.config import config_from_dict
from leangrpo.distributed.strategy import choose_strategy


@pytest.mark.parametrize(
    "world_size,rank,engine,generates",
    [
        (1, 0, "hf", True),
        (1, 0, "vllm", True),
        (2, 0, "hf", True),
        (2, 1, "hf", True),
        (2, 0, "vllm", True),
        (2, 1, "vllm", False),
    ],  # fmt: skip
)
def test_the_strategy_says_which_processes_generate(tmp_path, world_size, rank, engine, generates):
    """Torchrun with the hf engine: every rank its share; with vLLM: rank 0 alone, so no other
    rank starts environment workers (the trainer's `ctx.distributed` branch before)."""
    cfg = config_from_dict(minimal_run(rollout={"engine": engine}, run={"device": "cpu"}))
    ctx = SimpleNamespace(distributed=world_size > 1, rank=rank, world_size=world_size,
                          is_main=rank == 0, device=torch.device("cpu"))  # fmt: skip
    assert choose_strategy(cfg, ctx, tmp_path).generates is generates
