"""Rollout production, synchronous or overlapped with training.

A producer turns prompts into scored rollout batches: sample prompts -> generate G
completions each -> rewards (worker pool) -> group-relative advantages. Two schedules:

- sync: the trainer asks, the batch is made on the spot with the trainer's current weights.
- async: a background thread keeps up to `prefetch_depth` batches ready. Every sample
  carries the policy version that generated it. Admission control enforces
  `max_staleness`: batch k is consumed when the trainer holds version k * U (U = optimizer
  updates per batch), so the producer starts it only once the engine holds a version
  >= k * U - max_staleness; it waits rather than produce data it would have to drop.
  With max_staleness = 0 the schedule degenerates to sync, sample for sample.

Weights reach the generator through `push_weights` (a snapshot the producer applies
between generations, so the trainer never waits for a generation to finish). A replay
buffer swaps zero-variance groups for recent high-signal ones within the staleness bound;
prompts whose whole group failed are re-queued to the sampler (re-roll).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import torch

from leangrpo.advantages import compute_advantages
from leangrpo.contracts import RolloutBatch, RolloutEngine, RolloutSample, SamplingParams
from leangrpo.seeding import derive_seed

_STOP_POLL_S = 0.1


@dataclass
class RolloutSettings:
    group_size: int  # G
    prompts_per_batch: int  # P
    sampling: SamplingParams
    scale_rewards: str
    seed: int
    updates_per_batch: int = 1  # U: optimizer updates made from one generation batch


@dataclass
class ProducedBatch:
    batch: RolloutBatch
    index: int  # generation batch counter, 0-based
    sampler_before: dict  # sampler state before this batch was drawn
    sampler_after: dict  # ... and right after: what a checkpoint taken once it is consumed stores
    idle_s: float = 0.0  # time the producer waited before starting it


class RolloutWorker:
    """One generation batch: prompts -> completions -> rewards -> advantages."""

    def __init__(
        self,
        engine: RolloutEngine,
        rewards,
        sampler,
        settings: RolloutSettings,
        reward_lock: threading.Lock | None = None,
    ):
        self.engine = engine
        self.rewards = rewards
        self.sampler = sampler
        self.settings = settings
        self.reward_lock = reward_lock or threading.Lock()
        self.sampler_lock = threading.Lock()  # the producer draws, the trainer re-queues

    def produce(self, index: int) -> ProducedBatch:
        with self.sampler_lock:
            before = self.sampler.state_dict()
            prompts = self.sampler.next_batch()
            after = self.sampler.state_dict()
        t0 = time.perf_counter()
        params = _seeded(self.settings.sampling, self.settings.seed, index)
        groups = self.engine.generate(
            prompts, params, self.settings.group_size, self.engine.version
        )
        t1 = time.perf_counter()
        samples = [
            RolloutSample(group_id=index * len(prompts) + i, prompt=p, completion=c)
            for i, (p, completions) in enumerate(zip(prompts, groups))
            for c in completions
        ]
        batch = RolloutBatch(samples, self.settings.group_size)
        with self.reward_lock:
            batch.metrics.update(self.rewards.score(samples))
        t2 = time.perf_counter()
        batch.metrics.update({"time/generate": t1 - t0, "time/rewards": t2 - t1})
        return ProducedBatch(batch, index, before, after)


def _seeded(params: SamplingParams, seed: int, index: int) -> SamplingParams:
    """Generation randomness is a hash of (run seed, batch index): resume is exact, and
    batches never share seeds (engines derive per-prompt/per-sample seeds from this one)."""
    return replace(params, seed=derive_seed(seed, index))


class ReplayBuffer:
    """Recent groups with reward variance, to stand in for zero-variance groups."""

    def __init__(self, capacity: int):
        self.groups: collections.deque[list[RolloutSample]] = collections.deque(maxlen=capacity)

    def add(self, group: list[RolloutSample]) -> None:
        if _has_signal(group):
            self.groups.append(group)

    def take(self, min_version: int) -> list[RolloutSample] | None:
        while self.groups:
            group = self.groups.popleft()
            if min(s.version for s in group) >= min_version:
                return [_as_replayed(s) for s in group]
        return None


def _has_signal(group: list[RolloutSample]) -> bool:
    rewards = [s.reward for s in group if s.reward is not None]
    return len(rewards) >= 2 and max(rewards) > min(rewards)


def _as_replayed(sample: RolloutSample) -> RolloutSample:
    return replace(sample, replayed=True)


@dataclass
class BatchFinisher:
    """Turns a generated batch into a training batch: replay, re-roll, advantages."""

    settings: RolloutSettings
    max_staleness: int
    replay: ReplayBuffer | None = None
    reroll_attempts: int = 0  # 0 = re-roll off
    sampler: object = None
    sampler_lock: threading.Lock = field(default_factory=threading.Lock)
    attempts: dict[int, int] = field(default_factory=dict)

    def finish(self, produced: ProducedBatch, trainer_version: int) -> RolloutBatch:
        batch = produced.batch
        metrics = {"replay/groups_used": 0.0, "reroll/requeued": 0.0}
        groups = batch.groups()
        if self.reroll_attempts:
            metrics["reroll/requeued"] = float(self._reroll_failed(groups))
        if self.replay is not None:
            groups, metrics["replay/groups_used"] = self._apply_replay(groups, trainer_version)
        batch.samples = [s for g in groups for s in g]
        batch.metrics.update(compute_advantages(batch, self.settings.scale_rewards))
        batch.metrics.update(metrics)
        return batch

    def _reroll_failed(self, groups: list[list[RolloutSample]]) -> int:
        failed = [g[0].prompt for g in groups if all(s.reward is None for s in g)]
        retry = [p for p in failed if self.attempts.get(p.uid, 0) < self.reroll_attempts]
        for prompt in retry:
            self.attempts[prompt.uid] = self.attempts.get(prompt.uid, 0) + 1
        if retry:
            with self.sampler_lock:
                self.sampler.requeue(retry)
        return len(retry)

    def _apply_replay(self, groups, trainer_version: int):
        used = 0
        out = []
        for group in groups:
            if _has_signal(group) or not any(s.reward is not None for s in group):
                self.replay.add(group)
                out.append(group)
                continue
            stand_in = self.replay.take(min_version=trainer_version - self.max_staleness)
            used += stand_in is not None
            out.append(stand_in or group)
        return out, float(used)


class SyncProducer:
    """Generates each batch when asked, with the weights the engine holds right now."""

    def __init__(self, worker: RolloutWorker, finisher: BatchFinisher):
        self.worker = worker
        self.finisher = finisher
        self.index = 0
        self.engine_lock = threading.Lock()

    def next_batch(self, trainer_version: int) -> RolloutBatch:
        with self.engine_lock:
            produced = self.worker.produce(self.index)
        self.index += 1
        batch = self.finisher.finish(produced, trainer_version)
        batch.metrics.update({"time/producer_idle": 0.0, "pipeline/queue": 0.0})
        return batch

    def push_weights(self, version: int, tensors: Callable[[], Iterable]) -> float:
        t0 = time.perf_counter()
        with self.engine_lock:
            self.worker.engine.update_weights(tensors(), version)
        return time.perf_counter() - t0

    def state_dict(self) -> dict:
        return {"index": self.index, "sampler": self.worker.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.index = state["index"]
        self.worker.sampler.load_state_dict(state["sampler"])

    def close(self) -> None:
        """Nothing runs in the background; the engines are closed by their owner."""


class AsyncProducer:
    """A background thread that keeps batches ready within the staleness bound."""

    def __init__(
        self,
        worker: RolloutWorker,
        finisher: BatchFinisher,
        prefetch_depth: int,
        max_staleness: int,
        streaming: bool = False,
        snapshot_device: str | None = None,
    ):
        self.worker = worker
        self.finisher = finisher
        self.max_staleness = max_staleness
        # streaming: the worker makes chunks of min_groups_per_step prompts; a step takes
        # whatever complete chunks are ready (at least one, at most prompts_per_batch groups)
        self.streaming = streaming
        self.snapshot_device = snapshot_device  # None: snapshots stay on the weights' device
        self._trainer_version = 0
        self.dropped_stale = 0
        self.queue: queue.Queue[ProducedBatch] = queue.Queue(maxsize=prefetch_depth)
        self.engine_lock = threading.Lock()
        self._pending: tuple[int, list] | None = None
        self._pending_lock = threading.Lock()
        self._weights_changed = threading.Condition()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._index = 0  # next batch the thread will produce
        self._consumed_state: dict | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._consumed_state = {"index": self._index, "sampler": self.worker.sampler.state_dict()}
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
                if self._stop.is_set():
                    return
                with self.engine_lock:
                    produced = self.worker.produce(self._index)
                produced.idle_s = idle
                self._index += 1
                self._put(produced)
        except BaseException as exc:  # surfaced to the trainer by next_batch
            self._error = exc

    def _wait_for_admission(self, index: int) -> float:
        """Block until the engine's weights are fresh enough for batch `index`."""
        required = self._required_version(index)
        t0 = time.perf_counter()
        with self._weights_changed:
            while not self._stop.is_set():
                self._apply_pending_weights()
                if self.worker.engine.version >= required:
                    break
                self._weights_changed.wait(_STOP_POLL_S)
        return time.perf_counter() - t0

    def _required_version(self, index: int) -> int:
        """Oldest engine version whose samples will still be within the bound when consumed.

        Whole batches are consumed in order, batch k at trainer version k * U, so the bound
        is known in advance. Streamed chunks are merged as they come, so their consumption
        version is not: they are admitted against the trainer's current version, and any
        chunk that has gone stale by the time it is taken is dropped and its prompts
        re-queued (counted as `pipeline/dropped_stale`).
        """
        if self.streaming:
            return self._trainer_version - self.max_staleness
        return index * self.worker.settings.updates_per_batch - self.max_staleness

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
    def next_batch(self, trainer_version: int) -> RolloutBatch:
        t0 = time.perf_counter()
        with self._weights_changed:
            self._trainer_version = trainer_version
            self._weights_changed.notify_all()
        produced = self._take_streamed(trainer_version) if self.streaming else self._get()
        waited = time.perf_counter() - t0
        stale = [trainer_version - s.version for s in produced.batch.samples]
        if max(stale) > self.max_staleness:  # admission control makes this unreachable
            raise RuntimeError(f"staleness bound broken: {max(stale)} > {self.max_staleness}")
        self._consumed_state = {"index": produced.index + 1, "sampler": produced.sampler_after}
        batch = self.finisher.finish(produced, trainer_version)
        batch.metrics.update(
            {
                "time/trainer_wait": waited,
                "time/producer_idle": produced.idle_s,
                "pipeline/queue": float(self.queue.qsize()),
                "pipeline/dropped_stale": float(self.dropped_stale),
            }
        )
        return batch

    def _take_streamed(self, trainer_version: int) -> ProducedBatch:
        """At least one ready chunk, plus every other ready one up to a full batch."""
        target = self.worker.settings.prompts_per_batch
        while True:
            chunks = [self._get()]
            while sum(len(c.batch.groups()) for c in chunks) < target:
                try:
                    chunks.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            fresh = [c for c in chunks if self._fresh(c, trainer_version)]
            if fresh:
                return _merge(fresh)

    def _fresh(self, chunk: ProducedBatch, trainer_version: int) -> bool:
        if all(trainer_version - s.version <= self.max_staleness for s in chunk.batch.samples):
            return True
        self.dropped_stale += 1
        with self.worker.sampler_lock:
            self.worker.sampler.requeue([g[0].prompt for g in chunk.batch.groups()])
        return False

    def _get(self) -> ProducedBatch:
        while True:
            if self._error is not None:
                raise RuntimeError(f"rollout producer failed: {self._error!r}") from self._error
            try:
                return self.queue.get(timeout=_STOP_POLL_S)
            except queue.Empty:
                if self._thread is not None and not self._thread.is_alive() and self._error is None:
                    raise RuntimeError("rollout producer stopped unexpectedly") from None

    def push_weights(self, version: int, tensors: Callable[[], Iterable]) -> float:
        """Hand a snapshot to the producer; it is applied between two generations."""
        t0 = time.perf_counter()
        snapshot = [
            (name, t.detach().to(self.snapshot_device or t.device, copy=True))
            for name, t in tensors()
        ]
        with self._pending_lock:
            self._pending = (version, snapshot)
        with self._weights_changed:
            self._weights_changed.notify_all()
        return time.perf_counter() - t0

    def state_dict(self) -> dict:
        return dict(self._consumed_state or {})

    def load_state_dict(self, state: dict) -> None:
        self._index = state["index"]
        self.worker.sampler.load_state_dict(state["sampler"])

    def close(self) -> None:
        self._stop.set()
        with self._weights_changed:
            self._weights_changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)


def _merge(chunks: list[ProducedBatch]) -> ProducedBatch:
    first, last = chunks[0], chunks[-1]
    batch = RolloutBatch([s for c in chunks for s in c.batch.samples], first.batch.group_size)
    total = len(batch.samples)
    for c in chunks:  # times and counts add up; means are weighted by samples
        share = len(c.batch.samples) / total
        for k, v in c.batch.metrics.items():
            additive = k.startswith("time/") or k.endswith("failures")
            batch.metrics[k] = batch.metrics.get(k, 0.0) + (v if additive else v * share)
    idle = sum(c.idle_s for c in chunks)
    return ProducedBatch(batch, last.index, first.sampler_before, last.sampler_after, idle)
