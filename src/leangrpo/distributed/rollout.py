"""Generation under torchrun: who generates what, and how every rank gets the whole batch.

Two arrangements (docs/distributed.md, "Generation"):

- **Every rank its share** (the hf engine). Every rank runs the same producer: the same
  deterministic sampler draws the same prompts, rank r generates and scores the slice
  `bounds(P)` of them with its own engine copy (group seeds depend on the prompt's index
  in the batch, never on the rank), and `RankShare.gather` all-gathers the scored samples
  (token ids, log-probs, rewards: small) so that every rank holds the same batch before
  re-rolls, replay and advantages, which then run identically everywhere. The shares'
  metrics merge by pipeline/merging.py's rules (reward figures recomputed over the whole
  batch, counts added, multi-turn means weighted), times are the slowest rank's.
  The exchange of an async producer runs in its thread, on a process group of its own
  (`DistContext.new_group`), so it never interleaves with the main thread's collectives.
- **Rank 0 decides** (vLLM servers). `MainRankProducer`: rank 0 alone runs the producer
  (sync or async thread) against the servers and broadcasts each finished batch; every
  sample keeps the version that generated it, and since every rank's trainer reports the
  same progress, rank 0's admission and staleness checks hold for all.

Shutdown of per-rank async producers: each batch's exchange needs every rank once, and a
thread may stop one batch earlier than its peer's, or fail inside its batch before the
exchange (the reward pool closes at shutdown: PoolClosedError). `stop_rank_producer`
agrees on the last batch any thread started and lets a rank that stopped short join that
exchange with an abort marker; a thread whose share of a batch fails once shutdown has
begun joins its exchange with the marker itself, and one that failed before is stood in
for by its main thread (`RankShare` tracks, under a lock, whether this rank still owes
the current batch's exchange). So no exchange is left waiting for its timeout, and no
rank's exit blocks on a pending collective.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from leangrpo.contracts import Producer, RolloutBatch, RolloutSample
from leangrpo.distributed.context import DistContext
from leangrpo.pipeline.advantages import mean_std
from leangrpo.pipeline.merging import merge_metrics
from leangrpo.pipeline.producers import AsyncProducer, ProductionAborted

_ABORT = "leangrpo:abort"


class RankShare:
    """This rank's slice of each batch, and the exchange that rebuilds it on every rank."""

    def __init__(self, ctx: DistContext, group: Any = None):
        self.ctx = ctx
        self.group = group  # None: the default group (main-thread callers only)
        self.wait_s = 0.0  # seconds spent in exchanges (waiting for the slowest rank)
        # the producer thread's batch in hand vs. its main thread at shutdown (see below)
        self._lock = threading.Lock()
        self._owed = False  # this rank has not joined the current batch's exchange yet
        self._orphaned = False  # ... and the thread making it failed: it never will
        self._stopping = False  # shutdown has begun (stop_rank_producer)

    def bounds(self, count: int) -> tuple[int, int]:
        """[start, stop) of this rank's prompts among `count` (contiguous, near-equal)."""
        r, w = self.ctx.rank, self.ctx.world_size
        return round(r * count / w), round((r + 1) * count / w)

    def exchange(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order; raises ProductionAborted if a rank aborted."""
        import torch.distributed as dist

        with self._lock:
            self._owed = False
        out: list[Any] = [None] * self.ctx.world_size
        start = time.perf_counter()
        dist.all_gather_object(out, obj, group=self.group)
        self.wait_s += time.perf_counter() - start
        if any(isinstance(o, str) and o == _ABORT for o in out):
            raise ProductionAborted("another rank stopped producing")
        return out

    def gather(
        self, samples: list[RolloutSample], metrics: dict[str, float]
    ) -> tuple[list[RolloutSample], dict[str, float]]:
        """The whole scored batch (rank slices in order) and its metrics, on every rank."""
        parts = self.exchange((samples, metrics))
        everything = [s for part, _ in parts for s in part]
        return everything, merge_share_metrics(parts)

    def abort(self) -> None:
        """Join the exchange a peer's producer is waiting in, abandoning its batch."""
        with contextlib.suppress(ProductionAborted):
            self.exchange(_ABORT)

    # -- a batch's exchange is owed once by every rank -----------------------------------

    def begin_batch(self) -> None:
        """The producing thread starts a batch: this rank owes its exchange."""
        with self._lock:
            self._owed, self._orphaned = True, False

    def failed_before_exchange(self) -> None:
        """The producing thread's share of its batch failed before the exchange. Peers'
        threads wait in (or head for) that exchange: once shutdown has begun, join it with
        the abort marker now; before, leave it to `stop` (the error reaches this rank's
        trainer, or the run ends and the main thread stands in)."""
        with self._lock:
            if not self._owed:
                return
            if not self._stopping:
                self._orphaned = True
                return
            self._owed = False
        with contextlib.suppress(Exception):  # a peer gone already: nothing left to release
            self.abort()

    def stop(self) -> bool:
        """Shutdown begins (main thread). True: the producing thread failed before its
        batch's exchange and will not join it, so the caller must (`abort`)."""
        with self._lock:
            self._stopping = True
            stand_in = self._owed and self._orphaned
            if stand_in:
                self._owed = False
            return stand_in


def merge_share_metrics(parts: list[tuple[list[RolloutSample], dict[str, float]]]) -> dict:
    """One batch's metrics from its ranks' shares (samples, metrics): each figure merged by
    its declared rule (pipeline/merging.py: counts added, means weighted by what they
    average over, the multi-turn figures included), reward means and stds recomputed over
    the whole batch (as one process computes them), the slowest rank's times, and how much
    longer the slowest rank took than the fastest (`dist/wait_generate`)."""
    per_rank = [metrics for _, metrics in parts]
    out = merge_metrics(
        [(share, {k: v for k, v in m.items() if not k.startswith("time/")}) for share, m in parts]
    )
    for metrics in per_rank:
        for key, value in metrics.items():
            if key.startswith("time/"):
                out[key] = max(out.get(key, 0.0), value)
    busy = [m.get("time/generate", 0.0) + m.get("time/rewards", 0.0) for m in per_rank]
    out["dist/wait_generate"] = max(busy) - min(busy)
    samples = [s for share, _ in parts for s in share]
    totals = [s.reward for s in samples if s.reward is not None]
    if totals:
        out["reward/mean"], out["reward/std"] = mean_std(totals)
    for name in sorted({name for s in samples for name in s.rewards}):
        values = [s.rewards[name] for s in samples if s.rewards.get(name) is not None]
        if values:
            out[f"reward/{name}/mean"] = mean_std(values)[0]
    return out


class MainRankProducer:
    """A `contracts.Producer`: rank 0 runs `inner` (a Sync/AsyncProducer; None on other
    ranks) and broadcasts each batch. Every rank calls every method in the same order."""

    def __init__(self, inner: Producer | None, ctx: DistContext):
        if (inner is None) == ctx.is_main:
            raise ValueError("rank 0, and only rank 0, holds the producer")
        self.inner = inner
        self.ctx = ctx
        self.engine_lock = inner.engine_lock if inner is not None else threading.Lock()

    def start(self) -> None:
        if self.inner is not None:
            self.inner.start()

    def next_batch(self, trainer_version: int) -> RolloutBatch:
        batch = self.inner.next_batch(trainer_version) if self.inner is not None else None
        return self.ctx.broadcast_object(batch)

    def report_progress(self, version: int, steps_left: int) -> None:
        if self.inner is not None:
            self.inner.report_progress(version, steps_left)

    def push_weights(self, version: int, tensors: Callable[[], Iterable]) -> float:
        """Every rank gathers (`tensors` is collective); rank 0 then pushes, never before."""
        t0 = time.perf_counter()
        named = list(tensors())
        if self.inner is not None:
            self.inner.push_weights(version, lambda: named)
        return time.perf_counter() - t0

    def state_dict(self) -> dict:
        return self.inner.state_dict() if self.inner is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.inner is not None:
            self.inner.load_state_dict(state)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


def stop_rank_producer(producer: Producer, share: RankShare, ctx: DistContext) -> None:
    """Stop a per-rank async producer so that no peer is left in a batch exchange.

    Call it on every rank when the run ends normally, before the reward pool closes: a
    thread still making its batch then either reaches that batch's exchange or, failing
    on the closed pool, joins it with the abort marker (`RankShare.failed_before_exchange`).
    One all-reduce.
    """
    if not isinstance(producer, AsyncProducer) or not ctx.distributed:  # no thread to stop
        return
    with ctx.phase("shutdown"):
        entered = producer.stop_entering()
        stand_in = share.stop()  # this rank's thread failed before the exchange it owes
        if entered < ctx.max_int(entered) or stand_in:  # a peer's thread waits in it
            share.abort()
