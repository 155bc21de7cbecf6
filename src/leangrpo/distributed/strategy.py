"""What the trainer does differently under torchrun (world size > 1; never imported otherwise
by a single process's code paths, which call none of this).

- Set-up (`shard_for_training`): every rank loads the full model once (the reference of
  full fine-tuning is a `model.meta_copy`, without storage); the policy and the reference
  are sharded (the reference's shards copied from the policy's), and only then is the
  per-rank hf engine's own copy built from the shards, one gathered tensor at a time. So
  a rank holds at most one full copy of the weights at any moment of the set-up (tested by
  counting the storages alive after each stage).
- Weights for the generator: `sync_tensors` gathers every shard on every rank in one fixed
  order (fsdp.gather_for_sync); per-rank hf engines copy each tensor in as it is gathered
  (sync mode: no second full copy; async mode: the snapshot waiting for the producer
  thread is one), rank 0 alone keeps them for vLLM servers, sent after the last gather.
- The batch in progress at a checkpoint: its samples are the same on every rank, its
  old/reference log-probs are per rank (each rank's micro-batches), so they are gathered
  to rank 0 (`attached_by_rank`) and each rank takes its own back on resume.
- Metrics: rank 0 logs. Figures measured per rank are combined once per step
  (`reduce_rank_metrics`): token and micro-batch counts added, times and the packing
  balance the worst rank's, and `dist/wait_max` / `dist/wait_mean`: seconds ranks spent in
  leangrpo's own collectives during the step (sample exchanges, count all-reduces, the
  step-end barrier), i.e. waiting for the slowest rank. FSDP's gathers inside forward and
  backward are not in it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from leangrpo.distributed.context import DistContext

RANK_SUM = ("packing/tokens", "packing/micro_batches", "packing/split_groups", "offload/bytes",
            "offload/tensors", "offload/prefetched", "_tokens")  # fmt: skip
RANK_MAX = ("packing/balance", "packing/padding_ratio", "time/train", "time/score",
            "time/weight_sync", "time/trainer_wait", "time/producer_idle",
            "offload/pool_bytes", "dist/wait_max")  # fmt: skip
RANK_MEAN = ("packing/padding_ratio_avoided", "dist/wait_mean")


def shard_for_training(policy, cfg, ctx: DistContext):
    """Shard `policy` (and its reference) in place; returns the per-rank hf engine's own
    unsharded copy (`fsdp.unsharded_copy`), or None when rank 0 drives vLLM servers.

    The engine copy's structure is taken before sharding (`model.meta_copy`: the policy as
    built, with its plain lm_head), its tensors after, from the shards."""
    from leangrpo.distributed.fsdp import shard_policy, unsharded_copy
    from leangrpo.model.policy import meta_copy

    structure = meta_copy(policy.model) if cfg.rollout.engine == "hf" else None
    shard_policy(policy, cfg.distributed, ctx)
    if structure is None:
        return None
    return unsharded_copy(structure, policy.model, policy.device)


def sync_tensors(policy, ctx: DistContext, *, to_all: bool) -> Iterable[tuple[str, Any]]:
    """The weights the engine(s) receive, gathered from the shards (every rank calls it).

    `to_all`: every rank receives them (its own hf engine copy), one tensor at a time as
    the engine copies them in (`fsdp.iter_gathered`: no second full copy; every rank's
    engine consumes them all); else rank 0 keeps them, as a list, in host memory (what vLLM
    uploads are written from, only after the last gather) and the others get [].
    """
    from leangrpo.distributed.fsdp import gather_for_sync, iter_gathered

    if to_all:
        return iter_gathered(policy.model, ctx, adapters_only=policy.is_lora, to_all=True)
    return gather_for_sync(policy.model, ctx, adapters_only=policy.is_lora, device="cpu")


def inflight_to_save(ctx: DistContext, state: dict) -> dict:
    """A BatchInProgress state with every rank's attached log-probs (on rank 0)."""
    state = dict(state)
    state["attached_by_rank"] = ctx.gather_to_main(state.pop("attached"))
    return state


def inflight_to_load(ctx: DistContext, state: dict) -> dict:
    """This rank's view of a saved batch in progress."""
    by_rank = state.get("attached_by_rank")
    if by_rank is None or len(by_rank) != ctx.world_size:
        from leangrpo.errors import RunError

        raise RunError(
            "the checkpoint's batch in progress was saved by another number of ranks; "
            "resume with the world size it was written with"
        )
    return {**{k: v for k, v in state.items() if k != "attached_by_rank"},
            "attached": by_rank[ctx.rank]}  # fmt: skip


def reduce_rank_metrics(ctx: DistContext, metrics: dict, wait_s: float) -> dict:
    """Combine the per-rank figures of one step (one all-gather); the rest is already
    the same on every rank. `wait_s`: this rank's seconds in collectives this step."""
    mine = {k: v for k, v in metrics.items() if k in RANK_SUM + RANK_MAX + RANK_MEAN}
    mine["dist/wait_max"] = mine["dist/wait_mean"] = wait_s
    parts = ctx.all_gather_object(mine)
    out = dict(metrics)
    for key in {k for part in parts for k in part}:
        values = [part[key] for part in parts if key in part]
        if key in RANK_SUM:
            out[key] = sum(values)
        elif key in RANK_MAX:
            out[key] = max(values)
        else:
            out[key] = sum(values) / len(values)
    tokens = out.pop("_tokens", None)
    if tokens is not None:
        out["throughput/train_tokens_per_s"] = tokens / max(out.get("time/train", 0.0), 1e-9)
    return out


class NullLogger:
    """Torchrun ranks > 0: rank 0 writes metrics.jsonl and shows the progress bar."""

    def stage(self, metrics) -> None:
        pass

    def log(self, step: int, metrics) -> None:
        pass

    def rows_logged_at(self, step: int) -> int:
        return 0  # rank 0's count is the one its checkpoint saves

    def log_samples(self, step: int, rows) -> None:
        pass

    def close(self) -> None:
        pass
