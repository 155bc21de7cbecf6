"""One generation batch and the state that outlives it: what each producer in pipeline.py runs.

- `RolloutWorker.produce(index)`: sample prompts -> generate G completions each (seeded by
  a hash of (run seed, batch index), so a resume remakes a batch exactly) -> rewards ->
  re-queue prompts whose whole group failed (at most `reroll_attempts` times each). Under
  torchrun each rank generates and scores its share, then an all-gather gives every rank
  the whole batch before re-rolls. Its `state_dict` (next index, sampler, re-roll counts)
  is taken with each batch, so a checkpoint describes the last batch handed out.
- `BatchFinisher.finish`: replay (a zero-variance group is swapped for a recent group with
  signal from `ReplayBuffer`, never older than max_staleness), the staleness check
  (`check_staleness` raises rather than train beyond the bound), group advantages.
- `RolloutSettings` and `ProducedBatch` are what flows between them and the producers.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, replace

from leangrpo.advantages import compute_advantages
from leangrpo.checkpoint import sample_from_state, sample_state
from leangrpo.contracts import RolloutBatch, RolloutEngine, RolloutSample, SamplingParams
from leangrpo.seeding import derive_seed


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
        if self.share:  # torchrun: this rank owes the batch's exchange, even if it fails
            self.share.begin_batch()
        try:
            samples, metrics = self._make_share(index)
        except Exception:
            if self.share:  # peers wait in this batch's exchange (see RankShare)
                self.share.failed_before_exchange()
            raise
        if self.share:  # every rank's scored share: the whole batch on every rank
            samples, metrics = self.share.gather(samples, metrics)
        batch = RolloutBatch(samples, self.settings.group_size, metrics)
        with self.sampler_lock:
            requeued = self._reroll_failed(batch.groups())
            after = self.state_dict(index + 1)
            self.made = index + 1
        batch.metrics["reroll/requeued"] = requeued
        return ProducedBatch(batch, index, after)

    def _make_share(self, index: int) -> tuple[list[RolloutSample], dict[str, float]]:
        """This rank's share of the batch's prompts (all of them in one process), generated
        and scored, and its metrics."""
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
        return samples, metrics

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
