"""Rollout production, synchronous or overlapped with training.

A producer turns prompts into scored rollout batches: sample prompts -> generate G
completions each -> rewards (worker pool) -> re-roll prompts whose group had no signal
-> replay -> group-relative advantages. sync: the batch is made when the trainer asks.
async: a background thread keeps up to `prefetch_depth` batches ready.

Staleness. Every sample carries the version that generated it. `max_staleness` bounds its
age when its batch is consumed (the batch's first update; its later updates, U = mu x
steps_per_generation per batch, see it up to U - 1 versions older). Both modes check every
batch they hand out and raise rather than train beyond the bound.

Async admission: the trainer reports its version and the steps left on its batch after
every step. Batch k, with j batches to hand out before it, is consumed within
`steps_left + j x U` steps, so it starts once the engine holds a version >=
`version + steps_left + j x U - max_staleness`, re-evaluated on every report. Skipped
steps and short or skipped batches only make samples fresher, so they cannot deadlock it;
a trainer waiting `stall_timeout_s` for a batch that cannot start stops the run with the
reason. max_staleness = 0 degenerates to sync, sample for sample. Streaming
(`min_groups_per_step`): a step takes the first chunk not handed out and every other one
ready while it stays within a full batch (a chunk that would go past it is kept for the
next step, one chunk beyond the queue); chunk k is admitted by the same rule, with j the chunks before
it and U_chunk the updates of a batch of one chunk. Merging only makes a chunk fresher
than that plan, so no chunk is ever stale when taken (none is made to be thrown away), and
at max_staleness 0 every batch is exactly one chunk: sync's schedule, whatever the timing.

Weights reach the generator through `push_weights` (a snapshot applied between
generations). Re-rolls happen when a batch is made, so timing never decides which batch
serves a prompt again. `state_dict` describes the producer as of the last batch handed out
(next index, sampler, re-roll attempts, replay buffer): batches prefetched but not handed
out are made again after a resume, with the same seeds. A producer started after a resume
admits nothing older than the resumed trainer's version.
That is also why the trainer's wait for a batch (sync: its making; async: the queue) is
`stopping.abandonable()`: a stop signal may cut it short and the checkpoint is still exact.
Torchrun (hf engine): every rank runs the same producer on the same prompts and makes
its share of each batch (`RolloutWorker.share`, see distributed/rollout.py): it generates and
scores its slice of the prompts, then an all-gather hands every rank the whole scored
batch before re-rolls, so samplers, re-rolls, replay and advantages stay identical on
every rank. See docs/async.md and docs/distributed.md.

This module holds the producers (`SyncProducer`, and `AsyncProducer` with its admission,
streaming and stall rules), both `contracts.Producer`s like torchrun's
`distributed.rollout.MainRankProducer`; the making of one batch (`RolloutWorker`,
`BatchFinisher`) lives in batch.py, the replay buffer in replay.py, the rules that merge
streamed chunks' metrics in merging.py.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import torch

from leangrpo.contracts import RolloutBatch
from leangrpo.distributed.watch import PeerStopped
from leangrpo.errors import RunError, is_user_error
from leangrpo.pipeline.batch import (
    BatchFinisher,
    ProducedBatch,
    RolloutWorker,
)
from leangrpo.pipeline.merging import merge_metrics
from leangrpo.stopping import abandonable

_STOP_POLL_S = 0.1


class PipelineStallError(RunError):
    """The trainer waits for a batch that the producer can never start."""


class ProductionAborted(PeerStopped):
    """Another rank stopped producing (shutdown): the batch being exchanged is abandoned."""


class SyncProducer:
    """A `contracts.Producer` that generates each batch when asked, with the weights the
    engine holds right now."""

    def __init__(self, worker: RolloutWorker, finisher: BatchFinisher):
        self.worker = worker
        self.finisher = finisher
        self.index = 0
        self.engine_lock = threading.Lock()
        self._handed_state: dict | None = None  # the worker's, after the last batch handed out

    def start(self) -> None:
        """Nothing runs in the background: each batch is made when it is asked for."""

    def next_batch(self, trainer_version: int) -> RolloutBatch:
        if self._handed_state is None:  # what state_dict says if this batch is abandoned
            self._handed_state = self._worker_state()
        with self.engine_lock, abandonable():
            produced = self.worker.produce(self.index)
        self.index += 1
        self._handed_state = produced.state_after
        batch = self.finisher.finish(produced, trainer_version)
        batch.metrics.update({"time/producer_idle": 0.0, "pipeline/queue": 0.0})
        return batch

    def report_progress(self, version: int, steps_left: int) -> None:
        """Nothing to plan: a sync batch is made when it is asked for."""

    def push_weights(self, version: int, tensors: Callable[[], Iterable]) -> float:
        t0 = time.perf_counter()
        with self.engine_lock:  # lazily: an engine sharing the weights never reads them
            self.worker.engine.update_weights(_lazily(tensors), version)
        return time.perf_counter() - t0

    def state_dict(self) -> dict:
        """As of the last batch handed out (not of one abandoned while it was made)."""
        state = self._handed_state if self._handed_state is not None else self._worker_state()
        return {**state, **self.finisher.state_dict()}

    def _worker_state(self) -> dict:
        with self.worker.sampler_lock:
            return self.worker.state_dict(self.index)

    def load_state_dict(self, state: dict) -> None:
        self.index = state["index"]
        self._handed_state = None
        self.worker.load_state_dict(state)
        self.finisher.load_state_dict(state)

    def close(self) -> None:
        """Nothing runs in the background; the engines are closed by their owner."""


def _lazily(tensors: Callable[[], Iterable]) -> Iterator:
    yield from tensors()


class AsyncProducer:
    """A `contracts.Producer` whose background thread keeps batches ready within the
    staleness bound."""

    def __init__(
        self,
        worker: RolloutWorker,
        finisher: BatchFinisher,
        prefetch_depth: int,
        max_staleness: int,
        streaming: bool = False,
        snapshot_device: str | None = None,
        stall_timeout_s: float = 600.0,
        close_timeout_s: float = 30.0,
    ):
        self.worker = worker
        self.finisher = finisher
        self.max_staleness = max_staleness
        # streaming: the worker makes chunks of min_groups_per_step prompts; a step takes
        # whatever complete chunks are ready (at least one, at most prompts_per_batch groups)
        self.streaming = streaming
        self.snapshot_device = snapshot_device  # None: snapshots stay on the weights' device
        self.stall_timeout_s = stall_timeout_s
        # how long close() waits for the thread; torchrun: at least distributed.timeout_s,
        # so that no exchange it is in is still pending when the process exits
        self.close_timeout_s = close_timeout_s
        self.queue: queue.Queue[ProducedBatch] = queue.Queue(maxsize=prefetch_depth)
        self.engine_lock = threading.Lock()
        self._pending: tuple[int, list] | None = None
        self._pending_lock = threading.Lock()
        # what the trainer reported, guarded by _progress (the producer waits on it)
        self._progress = threading.Condition()
        self._trainer_version = 0
        self._steps_left = 0  # optimizer steps the trainer will still take on the batch in hand
        self._handed = 0  # batches handed to the trainer
        self._floor = 0  # oldest version admitted: the trainer's version at start
        self._blocked: tuple[float, int, int] | None = None  # (since, required, engine version)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._index = 0  # next batch the thread will produce
        self._enter_lock = threading.Lock()
        self.entered = -1  # the last batch the thread started (torchrun: see stop_entering)
        self._consumed_state: dict = {}
        self._thread: threading.Thread | None = None
        # streaming: a ready chunk that would have taken a step past prompts_per_batch
        # groups, kept (out of the queue) for the next step
        self._held: ProducedBatch | None = None

    def start(self) -> None:
        with self._progress:
            self._floor = self._trainer_version
        with self.worker.sampler_lock:
            self._consumed_state = self.worker.state_dict(self._index)
        self.entered = self._index - 1
        threads = torch.get_num_threads()
        self._thread = threading.Thread(
            target=self._run, args=(threads,), name="leangrpo-producer", daemon=True
        )
        self._thread.start()

    # -- the producer thread ---------------------------------------------------------
    def _run(self, num_threads: int) -> None:
        # OpenMP's thread count is per thread: without this the producer would use the
        # library default, compete with the trainer and round differently from sync mode
        torch.set_num_threads(num_threads)
        try:
            while not self._stop.is_set():
                idle = self._wait_for_admission(self._index)
                if not self._enter(self._index):
                    return
                with self.engine_lock:
                    produced = self.worker.produce(self._index)
                produced.idle_s = idle
                self._index += 1
                self._put(produced)
        except ProductionAborted as exc:  # torchrun shutdown: another rank stopped producing
            if not self._stop.is_set():  # not at shutdown: a peer's failure, surfaced
                self._error = exc
            return
        except BaseException as exc:  # surfaced to the trainer by next_batch
            self._error = exc

    def _enter(self, index: int) -> bool:
        with self._enter_lock:
            if self._stop.is_set():
                return False
            self.entered = index
            return True

    def stop_entering(self) -> int:
        """Start no further batch; returns the last batch the thread started (-1: none).

        Torchrun: ranks' producers exchange samples inside each batch, so at shutdown a
        rank whose thread stopped one batch short joins that exchange to abort it
        (distributed.rollout.stop_rank_producer).
        """
        with self._enter_lock:
            self._stop.set()
            return self.entered

    def _wait_for_admission(self, index: int) -> float:
        """Block until the engine's weights are fresh enough for batch `index`."""
        t0 = time.perf_counter()
        while not self._stop.is_set():
            self._apply_pending_weights()
            with self._progress:
                required = self._required_version(index)
                held = self.worker.engine.version
                if held >= required:
                    self._blocked = None
                    break
                if self._blocked is None or self._blocked[1:] != (required, held):
                    self._blocked = (time.monotonic(), required, held)  # the clock restarts
                if self._pending is None:
                    self._progress.wait(_STOP_POLL_S)
        return time.perf_counter() - t0

    def _required_version(self, index: int) -> int:
        """Oldest engine version whose samples are within the bound when `index` is consumed.

        Call under _progress. See the module docstring for the rule.
        """
        settings = self.worker.settings
        per_batch = settings.updates_per_batch
        if self.streaming and settings.updates_per_chunk is not None:
            per_batch = settings.updates_per_chunk  # each chunk as a batch of its own
        steps = self._steps_left + (index - self._handed) * per_batch
        return max(self._floor, self._trainer_version + steps - self.max_staleness)

    def _apply_pending_weights(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            version, tensors = pending
            with self.engine_lock:
                self.worker.engine.update_weights(tensors, version)

    def _put(self, produced: ProducedBatch) -> None:
        while not self._stop.is_set():
            try:
                self.queue.put(produced, timeout=_STOP_POLL_S)
                return
            except queue.Full:
                self._apply_pending_weights()

    # -- the trainer side --------------------------------------------------------------
    def report_progress(self, version: int, steps_left: int) -> None:
        """The trainer's version and the optimizer steps it will still take on its batch."""
        with self._progress:
            self._trainer_version, self._steps_left = version, steps_left
            self._progress.notify_all()

    def next_batch(self, trainer_version: int) -> RolloutBatch:
        t0 = time.perf_counter()
        self.report_progress(trainer_version, 0)
        produced = self._take_streamed() if self.streaming else self._get()
        with self._progress:  # until the trainer reports, assume it takes U steps on it
            self._handed = produced.index + 1
            self._steps_left = self.worker.settings.updates_per_batch
        waited = time.perf_counter() - t0
        self._consumed_state = produced.state_after
        batch = self.finisher.finish(produced, trainer_version)
        batch.metrics.update(
            {
                "time/trainer_wait": waited,
                "time/producer_idle": produced.idle_s,
                "pipeline/queue": float(self.queue.qsize()),
            }
        )
        return batch

    def _take_streamed(self) -> ProducedBatch:
        """The next chunk, plus every other ready one while the step stays within
        rollout.prompts_per_batch groups (a chunk that would go past it waits for the next
        step: with a chunk size that does not divide the batch, steps take fewer groups)."""
        target = self.worker.settings.prompts_per_batch
        first, self._held = self._held or self._get(), None
        chunks, groups = [first], len(first.batch.groups())
        while groups < target:
            try:
                chunk = self.queue.get_nowait()
            except queue.Empty:
                break
            if groups + len(chunk.batch.groups()) > target:
                self._held = chunk
                break
            chunks.append(chunk)
            groups += len(chunk.batch.groups())
        return _merge(chunks)

    def _get(self) -> ProducedBatch:
        with abandonable():  # abandoned: the batch is lost, state_dict is as it was
            return self._wait_for_batch()

    def _wait_for_batch(self) -> ProducedBatch:
        waiting_since = time.monotonic()
        while True:
            if self._error is not None:
                if is_user_error(self._error):  # one sentence, as in sync mode
                    raise self._error
                raise RuntimeError(f"rollout producer failed: {self._error!r}") from self._error
            try:
                return self.queue.get(timeout=_STOP_POLL_S)
            except queue.Empty:
                if self._thread is not None and not self._thread.is_alive() and self._error is None:
                    raise RuntimeError("rollout producer stopped unexpectedly") from None
            self._check_stall(waiting_since)

    def _check_stall(self, waiting_since: float) -> None:
        """The trainer waits for a batch the producer cannot start, and nothing moves."""
        with self._progress:
            blocked, version = self._blocked, self._trainer_version
        if blocked is None:
            return
        since, required, held = blocked
        stalled = time.monotonic() - max(since, waiting_since)
        if stalled >= self.stall_timeout_s:
            raise PipelineStallError(
                f"the rollout producer has waited {stalled:.0f} s for the engine to hold policy "
                f"version {required} or newer (max_staleness {self.max_staleness}), but it "
                f"holds {held} while the trainer, at version {version}, waits for that batch; "
                f"the engine is not taking weight updates, so the run stops "
                f"(pipeline.stall_timeout_s = {self.stall_timeout_s:g})"
            )

    def push_weights(self, version: int, tensors: Callable[[], Iterable]) -> float:
        """Hand a snapshot to the producer; it is applied between two generations."""
        t0 = time.perf_counter()
        snapshot = [
            (name, t.detach().to(self.snapshot_device or t.device, copy=True))
            for name, t in tensors()
        ]
        with self._pending_lock:
            self._pending = (version, snapshot)
        with self._progress:
            self._progress.notify_all()
        return time.perf_counter() - t0

    def state_dict(self) -> dict:
        """As of the last batch handed out (the batches made after it are made again)."""
        return {**self._consumed_state, **self.finisher.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._index = self._handed = state["index"]
        self.worker.load_state_dict(state)
        self.finisher.load_state_dict(state)

    def close(self) -> None:
        self._stop.set()
        with self._progress:
            self._progress.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=self.close_timeout_s)


def _merge(chunks: list[ProducedBatch]) -> ProducedBatch:
    """Chunks as one batch: their samples, each metric by its rule (merging.py), the last
    chunk's index and state, the idle time they waited together."""
    first, last = chunks[0], chunks[-1]
    samples = [s for c in chunks for s in c.batch.samples]
    metrics = merge_metrics([(c.batch.samples, c.batch.metrics) for c in chunks])
    batch = RolloutBatch(samples, first.batch.group_size, metrics)
    idle = sum(c.idle_s for c in chunks)
    return ProducedBatch(batch, last.index, last.state_after, idle)
