"""One process or torchrun, chosen once at set-up (`choose_strategy`), and the torchrun
strategy: what a multi-process run puts where one process has its own pieces
(`contracts.Strategy`; one process's is train/strategy.py's `one_process_strategy`).

- Set-up: the policy is FSDP-sharded (`fsdp.shard_for_training`: the reference's shards
  copied from the policy's, the per-rank hf engine's own copy built from the shards), so a
  rank holds at most one full copy of the weights at any moment of the set-up.
- The step (`TorchrunRanks`): the context's collectives, the global gradient norm of the
  sharded gradients after a barrier (the time fast ranks wait for the slowest shows in
  `dist/wait_*`), and every FSDP unit resharded after the no-grad passes.
- Weights for the generator (`gathered_weights`): every shard gathered on every rank in
  one fixed order (`fsdp.gather_for_sync`); per-rank hf engines copy each tensor in as it
  is gathered (sync mode: no second full copy; async mode: the snapshot waiting for the
  producer thread is one), rank 0 alone keeps them for vLLM servers, sent after the last
  gather.
- Checkpoints: DCP-sharded (`checkpoint.sharded.ShardedCheckpointer`); the final model
  written by rank 0.
- Metrics: rank 0 logs (the others hold a `NullLogger`). Figures measured per rank are
  combined once per step (`reduce_rank_metrics`): token and micro-batch counts added,
  times and the packing balance the worst rank's, and `dist/wait_max` / `dist/wait_mean`:
  seconds ranks spent in leangrpo's own collectives during the step (sample exchanges,
  count all-reduces, the step-end barrier), i.e. waiting for the slowest rank. FSDP's
  gathers inside forward and backward are not in it.
- Shutdown: per-rank async producers stop without leaving a peer in a batch exchange
  (`rollout.stop_rank_producer`).
- Context parallelism (`distributed.context_parallel_size` C > 1): the processes form a
  data x context mesh (mesh.py); groups are dealt to the D = W / C shares, the scoring
  roots split each row over their context group (Ulysses), and the step's reductions
  count each share once (`TorchrunRanks`). Generation is unchanged: with the hf engine
  every process generates 1/W of each batch and every process receives every sample
  (the trainer's dealing needs the whole batch anyway, and no device sits idle while a
  batch is made); with vLLM servers rank 0 generates and broadcasts.

See docs/distributed.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from leangrpo.checkpoint.sharded import ShardedCheckpointer
from leangrpo.contracts import Strategy
from leangrpo.distributed.context import DistContext
from leangrpo.distributed.fsdp import (
    clip_grad_norm,
    gather_for_sync,
    iter_gathered,
    reshard,
    shard_for_training,
)
from leangrpo.distributed.mesh import (
    ContextParallelError,
    ParallelMesh,
    build_mesh,
    check_splittable,
)
from leangrpo.distributed.rollout import stop_rank_producer
from leangrpo.metrics.logger import MetricsLogger, NullLogger
from leangrpo.train.strategy import one_process_strategy

log = logging.getLogger("leangrpo")

# counted per data-parallel share (the ranks of a context group hold the same figures)
SHARE_SUM = ("packing/tokens", "packing/micro_batches", "packing/split_groups", "_tokens")
RANK_SUM = ("offload/bytes", "offload/tensors", "offload/prefetched")  # per process
RANK_MAX = ("packing/balance", "packing/padding_ratio", "time/train", "time/score",
            "time/weight_sync", "time/trainer_wait", "time/producer_idle",
            "offload/pool_bytes", "dist/wait_max", "memory/peak_gib")  # fmt: skip
RANK_MEAN = ("packing/padding_ratio_avoided", "dist/wait_mean")


def choose_strategy(cfg, ctx: DistContext, output_dir: Path) -> Strategy:
    """The run's strategy (`cfg`: its Config): torchrun's when `ctx` spans processes."""
    if not ctx.distributed:
        return one_process_strategy(cfg, output_dir)
    return torchrun_strategy(cfg, ctx, output_dir)


def torchrun_strategy(cfg, ctx: DistContext, output_dir: Path) -> Strategy:
    """The torchrun pieces of a run (`cfg`: its Config; `ctx`: the process group's)."""
    per_rank = cfg.rollout.engine == "hf"  # every rank its own engine; else rank 0 generates
    mesh = build_mesh(ctx, cfg.distributed.context_parallel_size)
    return Strategy(
        device=ctx.device,
        reference_on_meta=True,  # one full copy per rank at most (sharded later)
        abandon_waits=False,  # ranks stop together, at a step boundary
        generates=per_rank or ctx.is_main,
        ranks=TorchrunRanks(ctx, mesh),
        checkpointer=ShardedCheckpointer(output_dir, cfg.checkpoint.keep_last, ctx),
        logger=MetricsLogger if ctx.is_main else NullLogger,
        shard=partial(
            shard_on_mesh, dist_cfg=cfg.distributed, ctx=ctx, mesh=mesh, engine_copy=per_rank
        ),
        weights=partial(gathered_weights, ctx=ctx, to_all=per_rank),
        reduce_metrics=partial(reduce_rank_metrics, ctx, mesh=mesh),
        stop_producer=partial(stop_rank_producer, ctx=ctx) if per_rank else _nothing_to_stop,
    )


def shard_on_mesh(policy, *, dist_cfg, ctx: DistContext, mesh: ParallelMesh, engine_copy: bool):
    """`fsdp.shard_for_training` with the scoring roots splitting rows over the mesh's
    context group; a model (the policy, or a distillation teacher) whose attention cannot
    be split is refused first."""
    if mesh.context_size > 1:
        try:
            log.info(check_splittable(policy.model, mesh))
            if policy.teacher is not None:  # its rows are split over the group too
                check_splittable(policy.teacher, mesh, "distill.teacher")
        except ContextParallelError as error:  # every rank refuses alike: rank 0 says it
            error.shown_by_rank_0 = ctx.rank > 0  # type: ignore[attr-defined]
            raise
    split = mesh.split()
    return shard_for_training(policy, dist_cfg, ctx, engine_copy, split=split)


class TorchrunRanks:
    """`contracts.StepRanks` over the process group of `ctx`, arranged as `mesh` (default:
    one share per process)."""

    def __init__(self, ctx: DistContext, mesh: ParallelMesh | None = None):
        self.ctx = ctx
        self.mesh = mesh or ParallelMesh(ctx.world_size, 1, ctx.rank, 0)
        self.rank, self.world_size = self.mesh.data_rank, self.mesh.data_size
        self.processes = ctx.world_size

    def all_reduce(self, values: Sequence[float], op: str = "sum") -> list[float]:
        return self.ctx.all_reduce(values, op, group=self.mesh.data_group)

    def all_true(self, flag: bool) -> bool:
        return self.ctx.all_true(flag)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.ctx.all_gather_object(obj, group=self.mesh.data_group)

    def clip_gradients(self, parameters: list[torch.Tensor], max_norm: float | None) -> float:
        """After a barrier, the norm of the sharded gradients reduced over ranks, clipped."""
        self.ctx.barrier()
        return clip_grad_norm(parameters, max_norm)

    def release_gathered(self, policy) -> None:
        """Reshard every FSDP unit of the policy, the reference and a distillation teacher
        (no collective)."""
        reshard(policy.root)
        for frozen in (policy.reference, policy.teacher):
            if frozen is not None:
                reshard(frozen)


def gathered_weights(policy, *, ctx: DistContext, to_all: bool) -> Iterable[tuple[str, Any]]:
    """The weights the engine(s) receive, gathered from the shards (every rank calls it).

    `to_all`: every rank receives them (its own hf engine copy), one tensor at a time as
    the engine copies them in (`fsdp.iter_gathered`: no second full copy; every rank's
    engine consumes them all); else rank 0 keeps them, as a list, in host memory (what vLLM
    uploads are written from, only after the last gather) and the others get [].
    """
    if to_all:
        return iter_gathered(policy.model, ctx, adapters_only=policy.is_lora, to_all=True)
    return gather_for_sync(policy.model, ctx, adapters_only=policy.is_lora, device="cpu")


def reduce_rank_metrics(
    ctx: DistContext, metrics: dict, tokens: float, wait_s: float, mesh: ParallelMesh | None = None
) -> dict:
    """Combine the per-rank figures of one step (one all-gather); the rest is already
    the same on every rank. `tokens`: this rank's trained tokens (padding left out);
    `wait_s`: this rank's seconds in collectives this step. Packing figures are a share's
    (added over the shares' first ranks: a context group's ranks hold the same ones)."""
    per_rank = SHARE_SUM + RANK_SUM + RANK_MAX + RANK_MEAN
    mine = {k: v for k, v in {**metrics, "_tokens": tokens}.items() if k in per_rank}
    mine["dist/wait_max"] = mine["dist/wait_mean"] = wait_s
    parts = ctx.all_gather_object(mine)
    leaders = parts if mesh is None else mesh.share_leaders(parts)
    out = dict(metrics)
    for key in {k for part in parts for k in part}:
        values = [part[key] for part in parts if key in part]
        if key in SHARE_SUM:
            out[key] = sum(part[key] for part in leaders if key in part)
        elif key in RANK_SUM:
            out[key] = sum(values)
        elif key in RANK_MAX:
            out[key] = max(values)
        else:
            out[key] = sum(values) / len(values)
    total = out.pop("_tokens", None)
    if total is not None:
        out["throughput/train_tokens_per_s"] = total / max(out.get("time/train", 0.0), 1e-9)
    return out


def _nothing_to_stop(producer, share) -> None:
    """Rank 0's producer behind a broadcast: its close() is enough."""
