"""One generation batch and the state that outlives it: what each producer (producers.py) runs.

- `RolloutWorker.produce(index)`: sample prompts -> generate G completions each (seeded by
  a hash of (run seed, batch index), so a resume remakes a batch exactly; with an
  environment, G multi-turn trajectories through `environments.driver.MultiTurnRollout`,
  each sample's prompt then being its trajectory's start) -> rewards ->
  re-roll: re-queue the prompt of every group without signal (flat, or no score at all) at
  most `reroll_attempts` times, then count such a group as dropped. Under
  torchrun each rank generates and scores its share, then an all-gather gives every rank
  the whole batch before re-rolls. Its `state_dict` (next index, sampler, re-roll counts)
  is taken with each batch, so a checkpoint describes the last batch handed out.
- `BatchFinisher.finish`: replay (a flat group, scored without reward variance, is swapped
  for a group with signal of an earlier batch from `ReplayBuffer`, each buffered group used
  once, under a group id of its own, never older than max_staleness at consumption; the
  batch's own groups join the buffer after), the staleness check (`check_staleness` raises
  rather than train beyond the bound), group advantages; with re-rolls on, the flat groups
  left (re-queued or dropped, all advantages 0) are taken out of the batch. Last, an agent
  episode's earlier segments (`Trajectory.earlier`: the agent edited its history) become
  samples of their own in its group, before its last one, with its rewards and advantage
  (`expand_episodes`): every token the model produced in the episode is trained on. The
  batch then holds more samples than groups x G; each group stays contiguous under its
  group_id, which is what planning and packing read.
- `RolloutSettings` and `ProducedBatch` are what flows between them and the producers.
See docs/async.md ("Re-rolls", "Replay", "What `max_staleness` bounds").
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

from leangrpo.contracts import (
    Prompt,
    RolloutBatch,
    RolloutEngine,
    RolloutSample,
    SamplingParams,
    sample_prompt,
)
from leangrpo.environments.metrics import trajectory_metrics
from leangrpo.pipeline.advantages import compute_advantages
from leangrpo.pipeline.replay import ReplayBuffer, has_signal, is_flat
from leangrpo.seeding import derive_seed


@dataclass
class RolloutSettings:
    group_size: int  # G
    prompts_per_batch: int  # P
    sampling: SamplingParams
    scale_rewards: str
    seed: int
    updates_per_batch: int = 1  # U: optimizer updates made from one generation batch
    # streaming: the updates of a batch of one chunk (mu x min(steps_per_generation, chunk
    # groups)); None: updates_per_batch
    updates_per_chunk: int | None = None


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
        share=None,  # torchrun: a distributed.rollout.RankShare (this rank's slice + the exchange)
        turns=None,  # multi-turn: an environments.driver.MultiTurnRollout over `engine`
    ):
        self.share = share
        self.engine = engine
        self.turns = turns
        self.rewards = rewards
        self.sampler = sampler
        self.settings = settings
        self.reward_lock = reward_lock or threading.Lock()
        self.sampler_lock = threading.Lock()  # the producer draws; a checkpoint reads its state
        self.reroll_attempts = reroll_attempts
        self.attempts: dict[int, int] = {}  # prompt uid -> re-rolls so far

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
            requeued, dropped = self._reroll(batch.groups())
            after = self.state_dict(index + 1)
        batch.metrics.update({"reroll/requeued": requeued, "reroll/dropped": dropped})
        return ProducedBatch(batch, index, after)

    def _make_share(self, index: int) -> tuple[list[RolloutSample], dict[str, float]]:
        """This rank's share of the batch's prompts (all of them in one process), generated
        and scored, and its metrics."""
        with self.sampler_lock:
            prompts = self.sampler.next_batch()
        t0 = time.perf_counter()
        params = _seeded(self.settings.sampling, self.settings.seed, index)
        start, stop = self.share.bounds(len(prompts)) if self.share else (0, len(prompts))
        groups = (self.turns or self.engine).generate(
            prompts[start:stop],
            params,
            self.settings.group_size,
            self.engine.version,
            prompt_offset=start,
        )
        t1 = time.perf_counter()
        samples = [
            RolloutSample(index * len(prompts) + start + i, sample_prompt(p, c), c)
            for i, (p, completions) in enumerate(zip(prompts[start:stop], groups))
            for c in completions
        ]
        with self.reward_lock:
            metrics = self.rewards.score(samples)
        metrics.update({"time/generate": t1 - t0, "time/rewards": time.perf_counter() - t1})
        metrics.update(trajectory_metrics(samples))
        if self.turns is not None:  # the call's loop and engine: waits, prefill, servers
            metrics.update(self.turns.last_metrics)
        return samples, metrics

    def _reroll(self, groups: list[list[RolloutSample]]) -> tuple[float, float]:
        """Re-queue the prompts of groups without signal (flat, or not scored at all) that
        have re-rolls left; returns (re-queued, dropped: their prompt's re-rolls used up),
        counted in groups. A prompt is re-queued once per batch, one attempt, even when it
        fills several groups of it (a re-queued prompt served while the epoch order
        reaches it too): its groups are all re-queued ones."""
        if not self.reroll_attempts:
            return 0.0, 0.0
        retry: dict[int, Prompt] = {}
        requeued = dropped = 0
        for group in groups:
            if has_signal(group):
                continue
            prompt = group[0].prompt
            if prompt.uid not in retry and self.attempts.get(prompt.uid, 0) >= self.reroll_attempts:
                dropped += 1
                continue
            if prompt.uid not in retry:
                self.attempts[prompt.uid] = self.attempts.get(prompt.uid, 0) + 1
                retry[prompt.uid] = prompt
            requeued += 1
        self.sampler.requeue(list(retry.values()))
        return float(requeued), float(dropped)

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
            # streamed chunks dropped as stale, in checkpoints of versions that dropped them
            self.sampler.requeue_uids(state.get("requeued_late", []))
            self.attempts = {int(uid): int(n) for uid, n in state.get("reroll_attempts", [])}


def _seeded(params: SamplingParams, seed: int, index: int) -> SamplingParams:
    """Generation randomness is a hash of (run seed, batch index): resume is exact, and
    batches never share seeds (engines derive per-prompt/per-sample seeds from this one)."""
    return replace(params, seed=derive_seed(seed, index))


@dataclass
class BatchFinisher:
    """Turns a generated batch into a training batch: replay, advantages, flat groups out."""

    settings: RolloutSettings
    max_staleness: int
    replay: ReplayBuffer | None = None
    leave_out_flat: bool = False  # re-rolls on: a flat group is re-queued or dropped

    def finish(self, produced: ProducedBatch, trainer_version: int) -> RolloutBatch:
        batch = produced.batch
        used = 0.0
        groups = batch.groups()
        if self.replay is not None:
            groups, used = self._apply_replay(groups, trainer_version)
        batch.samples = [s for g in groups for s in g]
        check_staleness(batch.samples, trainer_version, self.max_staleness)
        # reward and advantage figures describe every group, as without re-rolls
        batch.metrics.update(compute_advantages(batch, self.settings.scale_rewards))
        batch.metrics["replay/groups_used"] = used
        if self.leave_out_flat:
            kept = [g for g in groups if not is_flat(g)]
            batch.samples = [s for g in kept for s in g]
            batch.metrics["reroll/left_out"] = float(len(groups) - len(kept))
        batch.samples, earlier = expand_episodes(batch.samples)
        if earlier:
            batch.metrics["agent/earlier_segments"] = float(earlier)
        return batch

    def _apply_replay(self, groups, trainer_version: int):
        """Flat groups swapped for buffered groups of earlier batches within the bound;
        then this batch's groups with signal join the buffer."""
        min_version = trainer_version - self.max_staleness  # the age at consumption
        out, used = [], 0
        for group in groups:
            stand_in = self.replay.take(min_version) if is_flat(group) else None
            used += stand_in is not None
            out.append(stand_in or group)
        for group in groups:
            self.replay.add(group)
        return out, float(used)

    def state_dict(self) -> dict:
        return {"replay": self.replay.state_dict()} if self.replay is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.replay is not None:
            self.replay.load_state_dict(state.get("replay", []))


def expand_episodes(samples: list[RolloutSample]) -> tuple[list[RolloutSample], int]:
    """Each agent episode's earlier segments as samples of their own, right before its
    last (see the module docstring); the samples' objects are not changed (a replay buffer
    may hold them); returns the samples and the number of segments added."""
    out, added = [], 0
    for s in samples:
        trajectory = s.completion.trajectory
        if trajectory is None or not trajectory.earlier:
            out.append(s)
            continue
        for c in trajectory.earlier:
            out.append(replace(s, prompt=c.trajectory.start, completion=c, rewards=dict(s.rewards)))
            added += 1
        last = replace(s.completion, trajectory=replace(trajectory, earlier=[]))
        out.append(replace(s, completion=last))
    return out, added


def check_staleness(samples: list[RolloutSample], trainer_version: int, bound: int) -> None:
    """Every sample handed to the trainer is 0..bound versions old, or the run stops."""
    ages = [trainer_version - s.version for s in samples]
    if ages and (max(ages) > bound or min(ages) < 0):
        raise RuntimeError(
            f"staleness bound broken: samples {min(ages)} to {max(ages)} versions old at "
            f"trainer version {trainer_version}, but pipeline.max_staleness allows 0 to {bound}"
        )
