"""Rollout production, synchronous or overlapped with training.

A producer turns prompts into scored rollout batches: sample prompts -> generate G
completions each -> rewards (worker pool) -> re-roll prompts whose group failed -> replay
-> group-relative advantages. sync: the batch is made when the trainer asks. async: a
background thread keeps up to `prefetch_depth` batches ready.

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
reason. max_staleness = 0 degenerates to sync, sample for sample. Streaming chunks
(`min_groups_per_step`) are admitted against the trainer's current version; a chunk stale
when taken is dropped and its prompts re-queued.

Weights reach the generator through `push_weights` (a snapshot applied between
generations). Re-rolls happen when a batch is made, so timing never decides which batch
serves a prompt again. `state_dict` describes the producer as of the last batch handed out
(next index, sampler, re-roll attempts, prompts re-queued since, replay buffer): batches
prefetched but not handed out are made again after a resume, with the same seeds. A
producer started after a resume admits nothing older than the resumed trainer's version.
Torchrun (hf engine): every rank runs the same producer on the same prompts and makes
its share of each batch (`RolloutWorker.share`, see dist_rollout.py): it generates and
scores its slice of the prompts, then an all-gather hands every rank the whole scored
batch before re-rolls, so samplers, re-rolls, replay and advantages stay identical on
every rank. See docs/ARCHITECTURE.md "Choices" and "Distributed".
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

import torch

from leangrpo.advantages import compute_advantages
from leangrpo.checkpoint import sample_from_state, sample_state
from leangrpo.contracts import RolloutBatch, RolloutEngine, RolloutSample, SamplingParams
from leangrpo.errors import RunError, user_error_types
from leangrpo.seeding import derive_seed

_STOP_POLL_S = 0.1


class PipelineStallError(RunError):
    """The trainer waits for a batch that the producer can never start."""


class ProductionAborted(Exception):
    """Another rank stopped producing (shutdown): the batch being exchanged is abandoned."""


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
    state_after: dict  # the worker's state once this batch was made: what a checkpoint stores
    idle_s: float = 0.0  # time the producer waited before starting it


class RolloutWorker:
    """One generation batch: prompts -> completions -> rewards -> re-rolls of failed prompts."""

    def __init__(
        self,
        engine: RolloutEngine,
        rewards,
        sampler,
        settings: RolloutSettings,
        reward_lock: threading.Lock | None = None,
        reroll_attempts: int = 0,  # 0 = re-roll off
        share=None,  # torchrun: a dist_rollout.RankShare (this rank's slice + the exchange)
    ):
        self.share = share
        self.engine = engine
        self.rewards = rewards
        self.sampler = sampler
        self.settings = settings
        self.reward_lock = reward_lock or threading.Lock()
        self.sampler_lock = threading.Lock()  # the producer draws, the trainer may re-queue
        self.reroll_attempts = reroll_attempts
        self.attempts: dict[int, int] = {}  # prompt uid -> re-rolls so far
        self.made = 0  # batches whose state_after was taken (under sampler_lock)

    def produce(self, index: int) -> ProducedBatch:
        with self.sampler_lock:
            prompts = self.sampler.next_batch()
        t0 = time.perf_counter()
        params = _seeded(self.settings.sampling, self.settings.seed, index)
        start, stop = self.share.bounds(len(prompts)) if self.share else (0, len(prompts))
        groups = self.engine.generate(
            prompts[start:stop],
            params,
            self.settings.group_size,
            self.engine.version,
            prompt_offset=start,
        )
        t1 = time.perf_counter()
        samples = [
            RolloutSample(group_id=index * len(prompts) + start + i, prompt=p, completion=c)
            for i, (p, completions) in enumerate(zip(prompts[start:stop], groups))
            for c in completions
        ]
        with self.reward_lock:
            metrics = self.rewards.score(samples)
        metrics.update({"time/generate": t1 - t0, "time/rewards": time.perf_counter() - t1})
        if self.share:  # every rank's scored share: the whole batch on every rank
            samples, metrics = self.share.gather(samples, metrics)
        batch = RolloutBatch(samples, self.settings.group_size, metrics)
        with self.sampler_lock:
            requeued = self._reroll_failed(batch.groups())
            after = self.state_dict(index + 1)
            self.made = index + 1
        batch.metrics["reroll/requeued"] = requeued
        return ProducedBatch(batch, index, after)

    def _reroll_failed(self, groups: list[list[RolloutSample]]) -> float:
        if not self.reroll_attempts:
            return 0.0
        failed = [g[0].prompt for g in groups if all(s.reward is None for s in g)]
        retry = [p for p in failed if self.attempts.get(p.uid, 0) < self.reroll_attempts]
        for prompt in retry:
            self.attempts[prompt.uid] = self.attempts.get(prompt.uid, 0) + 1
        self.sampler.requeue(retry)
        return float(len(retry))

    def state_dict(self, index: int) -> dict:
        """Call under sampler_lock: `index` is the next batch to make."""
        return {
            "index": index,
            "sampler": self.sampler.state_dict(),
            "reroll_attempts": sorted([uid, n] for uid, n in self.attempts.items()),
        }

    def load_state_dict(self, state: dict) -> None:
        with self.sampler_lock:
            self.sampler.load_state_dict(state["sampler"])
            self.sampler.requeue_uids(state.get("requeued_late", []))
            self.attempts = {int(uid): int(n) for uid, n in state.get("reroll_attempts", [])}
            self.made = state["index"]


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

    def state_dict(self) -> list:
        return [[sample_state(s) for s in group] for group in self.groups]

    def load_state_dict(self, state: list) -> None:
        self.groups.clear()
        self.groups.extend([sample_from_state(s) for s in group] for group in state)


def _has_signal(group: list[RolloutSample]) -> bool:
    rewards = [s.reward for s in group if s.reward is not None]
    return len(rewards) >= 2 and max(rewards) > min(rewards)


def _as_replayed(sample: RolloutSample) -> RolloutSample:
    return replace(sample, replayed=True)


@dataclass
class BatchFinisher:
    """Turns a generated batch into a training batch: replay, advantages."""

    settings: RolloutSettings
    max_staleness: int
    replay: ReplayBuffer | None = None

    def finish(self, produced: ProducedBatch, trainer_version: int) -> RolloutBatch:
        batch = produced.batch
        used = 0.0
        groups = batch.groups()
        if self.replay is not None:
            groups, used = self._apply_replay(groups, trainer_version)
        batch.samples = [s for g in groups for s in g]
        check_staleness(batch.samples, trainer_version, self.max_staleness)
        batch.metrics.update(compute_advantages(batch, self.settings.scale_rewards))
        batch.metrics["replay/groups_used"] = used
        return batch

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

    def state_dict(self) -> dict:
        return {"replay": self.replay.state_dict()} if self.replay is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.replay is not None:
            self.replay.load_state_dict(state.get("replay", []))


def check_staleness(samples: list[RolloutSample], trainer_version: int, bound: int) -> None:
    """Every sample handed to the trainer is 0..bound versions old, or the run stops."""
    ages = [trainer_version - s.version for s in samples]
    if ages and (max(ages) > bound or min(ages) < 0):
        raise RuntimeError(
            f"staleness bound broken: samples {min(ages)} to {max(ages)} versions old at "
            f"trainer version {trainer_version}, but pipeline.max_staleness allows 0 to {bound}"
        )


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

    def report_progress(self, version: int, steps_left: int) -> None:
        """Nothing to plan: a sync batch is made when it is asked for."""

    def push_weights(self, version: int, tensors: Callable[[], Iterable]) -> float:
        t0 = time.perf_counter()
        with self.engine_lock:  # lazily: an engine sharing the weights never reads them
            self.worker.engine.update_weights(_lazily(tensors), version)
        return time.perf_counter() - t0

    def state_dict(self) -> dict:
        with self.worker.sampler_lock:
            state = self.worker.state_dict(self.index)
        return {**state, **self.finisher.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.index = state["index"]
        self.worker.load_state_dict(state)
        self.finisher.load_state_dict(state)

    def close(self) -> None:
        """Nothing runs in the background; the engines are closed by their owner."""


def _lazily(tensors: Callable[[], Iterable]) -> Iterator:
    yield from tensors()


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
        stall_timeout_s: float = 600.0,
    ):
        self.worker = worker
        self.finisher = finisher
        self.max_staleness = max_staleness
        # streaming: the worker makes chunks of min_groups_per_step prompts; a step takes
        # whatever complete chunks are ready (at least one, at most prompts_per_batch groups)
        self.streaming = streaming
        self.snapshot_device = snapshot_device  # None: snapshots stay on the weights' device
        self.stall_timeout_s = stall_timeout_s
        self.dropped_stale = 0
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
        self._late_requeues: list[tuple[int, list[int]]] = []  # (worker.made then, uids)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._progress:
            self._floor = self._trainer_version
        with self.worker.sampler_lock:
            self._consumed_state = self.worker.state_dict(self._index)
            self.worker.made = self._index
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
        except ProductionAborted:  # torchrun shutdown: another rank stopped producing
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
        (dist_rollout.stop_rank_producer).
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
        if self.streaming:
            planned = self._trainer_version
        else:
            batches_before = index - self._handed
            steps = self._steps_left + batches_before * self.worker.settings.updates_per_batch
            planned = self._trainer_version + steps
        return max(self._floor, planned - self.max_staleness)

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
        produced = self._take_streamed(trainer_version) if self.streaming else self._get()
        with self._progress:  # until the trainer reports, assume it takes U steps on it
            self._handed = produced.index + 1
            self._steps_left = self.worker.settings.updates_per_batch
        waited = time.perf_counter() - t0
        self._consumed_state = produced.state_after
        self._late_requeues = [(n, u) for n, u in self._late_requeues if n > produced.index]
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
        prompts = [g[0].prompt for g in chunk.batch.groups()]
        with self.worker.sampler_lock:  # after the state of batches made so far: see state_dict
            self.worker.sampler.requeue(prompts)
            self._late_requeues.append((self.worker.made, [p.uid for p in prompts]))
        return False

    def _get(self) -> ProducedBatch:
        waiting_since = time.monotonic()
        while True:
            if self._error is not None:
                if isinstance(self._error, user_error_types()):  # one sentence, as in sync mode
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
        """As of the last batch handed out, plus prompts re-queued after it was made."""
        late = [uid for _, uids in self._late_requeues for uid in uids]
        return {**self._consumed_state, "requeued_late": late, **self.finisher.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._index = self._handed = state["index"]
        self.worker.load_state_dict(state)
        self.finisher.load_state_dict(state)

    def close(self) -> None:
        self._stop.set()
        with self._progress:
            self._progress.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)


def _merge(chunks: list[ProducedBatch]) -> ProducedBatch:
    first, last = chunks[0], chunks[-1]
    batch = RolloutBatch([s for c in chunks for s in c.batch.samples], first.batch.group_size)
    total = len(batch.samples)
    for c in chunks:  # times and counts add up; means are weighted by samples
        share = len(c.batch.samples) / total
        for k, v in c.batch.metrics.items():
            additive = k.startswith("time/") or k.endswith(("failures", "requeued"))
            batch.metrics[k] = batch.metrics.get(k, 0.0) + (v if additive else v * share)
    idle = sum(c.idle_s for c in chunks)
    return ProducedBatch(batch, last.index, last.state_after, idle)
