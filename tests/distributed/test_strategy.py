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


def test_a_step_counts_each_context_groups_packing_figures_once():
    """dp 2 x cp 2: the ranks of a context group (0-1, 2-3) hold their share's packing
    figures; the step adds the two shares' (ranks 0 and 2), not one group's twice (ranks
    0 and 1), while per-process figures add over all four."""
    from leangrpo.distributed.mesh import ParallelMesh
    from leangrpo.distributed.strategy import reduce_rank_metrics

    shares = [{"packing/tokens": 100.0, "packing/micro_batches": 2.0},
              {"packing/tokens": 60.0, "packing/micro_batches": 1.0}]  # fmt: skip
    per_process = [{**shares[r // 2], "offload/bytes": 1.0 + r, "_tokens": shares[r // 2]["packing/tokens"],
                    "dist/wait_max": 0.0, "dist/wait_mean": 0.0} for r in range(4)]  # fmt: skip
    ctx = SimpleNamespace(all_gather_object=lambda mine: per_process)
    mesh = ParallelMesh(data_size=2, context_size=2, data_rank=0, context_rank=0)
    metrics = {**shares[0], "offload/bytes": 1.0, "time/train": 2.0}
    out = reduce_rank_metrics(ctx, metrics, 100.0, 0.0, mesh=mesh)
    assert out["packing/tokens"] == 160.0 and out["packing/micro_batches"] == 3.0
    assert out["offload/bytes"] == 1.0 + 2.0 + 3.0 + 4.0
    assert out["throughput/train_tokens_per_s"] == pytest.approx(160.0 / 2.0)
