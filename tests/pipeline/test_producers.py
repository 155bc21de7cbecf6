"""Producers with a fake engine: staleness bound, version tags, failures, replay, re-roll."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from leangrpo.contracts import (
    Completion,
    EngineVersionError,
    Producer,
    Prompt,
    RolloutBatch,
    RolloutSample,
    SamplingParams,
    Trajectory,
)
from leangrpo.distributed.context import DistContext
from leangrpo.distributed.rollout import MainRankProducer
from leangrpo.errors import RunError
from leangrpo.pipeline.batch import BatchFinisher, ProducedBatch, RolloutSettings, RolloutWorker
from leangrpo.pipeline.producers import AsyncProducer, PipelineStallError, SyncProducer
from leangrpo.pipeline.replay import ReplayBuffer
from leangrpo.train.planning import group_indices


class FakeEngine:
    def __init__(self, delay: float = 0.0, fail_at: int | None = None):
        self.version = 0
        self.delay = delay
        self.fail_at = fail_at
        self.calls = 0

    def generate(self, prompts, params, n, version, prompt_offset=0):
        if version != self.version:
            raise EngineVersionError(f"holds {self.version}, asked {version}")
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise RuntimeError("generator crashed")
        time.sleep(self.delay)
        return [
            [
                Completion([1, 2], f"{p.uid}-{i}", [-0.5, -0.5], "stop", self.version)
                for i in range(n)
            ]
            for p in prompts
        ]

    def update_weights(self, named_tensors, version):
        list(named_tensors)
        self.version = version

    def load_adapter(self, path, version):
        self.version = version

    def close(self):
        pass


class FakeRewards:
    """Reward = completion index within the group, except prompts marked to fail."""

    def __init__(self, failing_uids=(), flat_uids=()):
        self.failing = set(failing_uids)
        self.flat = set(flat_uids)

    def score(self, samples):
        for s in samples:
            if s.prompt.uid in self.failing:
                s.rewards, s.reward = {"r": None}, None
            else:
                value = 0.0 if s.prompt.uid in self.flat else float(s.completion.text[-1])
                s.rewards, s.reward = {"r": value}, value
        return {"reward/mean": 0.0}


class FakeSampler:
    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self.position = 0
        self.queue: list[Prompt] = []

    def next_batch(self):
        out = self.queue[: self.batch_size]
        self.queue = self.queue[len(out) :]
        while len(out) < self.batch_size:
            out.append(Prompt(self.position, f"p{self.position}", [5, 6]))
            self.position += 1
        return out

    def requeue(self, prompts):
        self.queue.extend(prompts)

    def requeue_uids(self, uids):
        self.queue.extend(Prompt(uid, f"p{uid}", [5, 6]) for uid in uids)

    def state_dict(self):
        return {"position": self.position, "queue": [p.uid for p in self.queue]}

    def load_state_dict(self, state):
        self.position = state["position"]
        self.queue = []
        self.requeue_uids(state.get("queue", []))


def make_worker(engine, rewards=None, prompts=2, group=3, updates=1, reroll=0):
    settings = RolloutSettings(
        group, prompts, SamplingParams(), "group", seed=0, updates_per_batch=updates
    )
    sampler = FakeSampler(prompts)
    worker = RolloutWorker(
        engine, rewards or FakeRewards(), sampler, settings, reroll_attempts=reroll
    )
    return worker, settings


def consume(producer, steps: int, train_s: float = 0.0):
    """A fake trainer: one update per batch, pushing weights after each."""
    batches = []
    for version in range(steps):
        batches.append((version, producer.next_batch(version)))
        time.sleep(train_s)
        producer.push_weights(version + 1, lambda: [])
    return batches


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_async_never_exceeds_the_staleness_bound(max_staleness):
    worker, settings = make_worker(FakeEngine(delay=0.01))
    producer = AsyncProducer(
        worker,
        BatchFinisher(settings, max_staleness),
        prefetch_depth=3,
        max_staleness=max_staleness,
    )
    producer.start()
    try:
        batches = consume(producer, 8, train_s=0.02)
    finally:
        producer.close()
    staleness = [v - s.version for v, b in batches for s in b.samples]
    assert max(staleness) <= max_staleness
    if max_staleness == 0:
        assert set(staleness) == {0}


def test_zero_staleness_async_matches_sync_sample_for_sample():
    worker, settings = make_worker(FakeEngine())
    sync_producer = SyncProducer(worker, BatchFinisher(settings, 0))
    sync_producer.start()  # nothing to start: every producer is started the same way
    sync = consume(sync_producer, 4)
    worker2, settings2 = make_worker(FakeEngine())
    producer = AsyncProducer(worker2, BatchFinisher(settings2, 0), 2, 0)
    broadcast = MainRankProducer(sync_producer, DistContext())  # torchrun's, at world size 1
    assert all(isinstance(p, Producer) for p in (sync_producer, producer, broadcast))
    producer.start()
    try:
        asynchronous = consume(producer, 4)
    finally:
        producer.close()
    key = [
        [(s.prompt.uid, s.completion.text, s.version, s.advantage) for s in b.samples]
        for _, b in sync
    ]
    assert key == [
        [(s.prompt.uid, s.completion.text, s.version, s.advantage) for s in b.samples]
        for _, b in asynchronous
    ]


def test_a_crashing_producer_ends_the_run_promptly():
    worker, settings = make_worker(FakeEngine(fail_at=3))
    producer = AsyncProducer(worker, BatchFinisher(settings, 1), 1, 1)
    producer.start()
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="generator crashed"):
        consume(producer, 10)
    assert time.perf_counter() - t0 < 60  # not the stall timeout (600 s): a liveness bound
    producer.close()
    assert not any(t.name == "leangrpo-producer" and t.is_alive() for t in threading.enumerate())


def test_failed_groups_are_rerolled_and_really_reinjected():
    worker, settings = make_worker(FakeEngine(), FakeRewards(failing_uids={0}), reroll=1)
    producer = SyncProducer(worker, BatchFinisher(settings, 0))
    first = producer.next_batch(0)
    assert first.metrics["reroll/requeued"] == 1
    second = producer.next_batch(0)
    assert second.samples[0].prompt.uid == 0  # served again before new prompts
    third = producer.next_batch(0)
    assert 0 not in {s.prompt.uid for s in third.samples}  # attempts are capped


def test_a_prompt_filling_two_groups_of_a_batch_is_rerolled_once():
    """b8_reroll_duplicate.py: a re-queued prompt served while the epoch order reaches it too
    fills two groups of one batch; both flat, it was re-queued twice and its attempts
    counted twice, past reroll.max_attempts. One re-queue, one attempt: both its groups
    count as re-queued, and the next batch that serves it flat drops it."""
    worker, settings = make_worker(FakeEngine(), FakeRewards(flat_uids={0}), reroll=1)
    worker.sampler.requeue_uids([0])  # queued, and the next new prompt too: two groups
    producer = SyncProducer(worker, BatchFinisher(settings, 0, leave_out_flat=True))
    first = producer.next_batch(0)
    assert first.metrics["reroll/left_out"] == 2  # both groups were prompt 0's, flat
    assert (first.metrics["reroll/requeued"], first.metrics["reroll/dropped"]) == (2, 0)
    assert worker.attempts == {0: 1} and [p.uid for p in worker.sampler.queue] == [0]
    second = producer.next_batch(0)
    assert (second.metrics["reroll/requeued"], second.metrics["reroll/dropped"]) == (0, 1)
    third = producer.next_batch(0)
    assert 0 not in {s.prompt.uid for s in third.samples}


def test_flat_groups_are_rerolled_then_dropped_and_never_trained_on():
    """reroll_flat.py: only groups whose every reward was None were re-rolled, though
    pipeline.reroll promised prompts whose group carried no signal."""
    worker, settings = make_worker(FakeEngine(), FakeRewards(flat_uids={0}), reroll=1)
    producer = SyncProducer(worker, BatchFinisher(settings, 0, leave_out_flat=True))
    first = producer.next_batch(0)
    assert (first.metrics["reroll/requeued"], first.metrics["reroll/dropped"]) == (1, 0)
    assert [s.prompt.uid for s in first.samples[::3]] == [1]  # the flat group is left out
    assert first.metrics["reroll/left_out"] == 1 and first.metrics["frac_reward_zero_std"] == 0.5
    second = producer.next_batch(0)  # prompt 0 again first, flat again: re-rolls used up
    assert (second.metrics["reroll/requeued"], second.metrics["reroll/dropped"]) == (0, 1)
    assert [s.prompt.uid for s in second.samples[::3]] == [2]
    third = producer.next_batch(0)
    assert [s.prompt.uid for s in third.samples[::3]] == [3, 4]


def test_leaving_out_flat_groups_keeps_signal_stand_ins_and_unscored_groups():
    settings = RolloutSettings(2, 4, SamplingParams(), "batch", seed=0)

    def finish_second_batch(leave_out_flat: bool):
        finisher = BatchFinisher(settings, 1, ReplayBuffer(4), leave_out_flat=leave_out_flat)
        finished(finisher, [scored_group(0, [0.0, 1.0])], 0, 0)  # buffered
        groups = [
            scored_group(1, [1.0, 1.0], 1),  # flat: batch 0's group stands in
            scored_group(2, [2.0, 2.0], 1),  # flat, the buffer empty: left out
            scored_group(3, [None, None], 1),  # unscored: kept, the trainer leaves it out
            scored_group(4, [0.0, 3.0], 1),
        ]
        return finished(finisher, groups, 1, 1)

    plain, batch = finish_second_batch(False), finish_second_batch(True)
    assert [s.prompt.uid for s in plain.samples[::2]] == [0, 2, 3, 4]
    assert [s.prompt.uid for s in batch.samples[::2]] == [0, 3, 4]
    assert batch.metrics["reroll/left_out"] == 1 and batch.metrics["replay/groups_used"] == 1
    # advantages (batch-scaled here) and reward figures are those of the batch with every
    # group in it: leaving out a group whose advantages are all 0 changes nothing else
    kept = [s.advantage for s in plain.samples if s.prompt.uid != 2]
    assert [s.advantage for s in batch.samples] == kept
    assert {k: batch.metrics[k] for k in plain.metrics} == plain.metrics


def test_replay_swaps_zero_variance_groups_within_the_bound():
    engine = FakeEngine()
    worker, settings = make_worker(engine, FakeRewards(flat_uids={2, 3}))
    finisher = BatchFinisher(settings, max_staleness=1, replay=ReplayBuffer(4))
    producer = SyncProducer(worker, finisher)
    producer.next_batch(0)  # prompts 0, 1 have signal: buffered
    engine.version = 1
    second = producer.next_batch(1)  # prompts 2, 3 are flat: replaced by 0 and 1
    assert second.metrics["replay/groups_used"] == 2
    assert all(s.replayed and s.version == 0 for s in second.samples)


def scored_group(uid: int, rewards: list[float], version: int = 0) -> list:
    """One generated group of len(rewards) samples, group id = prompt uid."""
    prompt = Prompt(uid, f"p{uid}", [5, 6])
    return [
        RolloutSample(
            uid, prompt, Completion([1, 2], f"{uid}-{i}", [-0.5, -0.25], "stop", version), reward=r
        )
        for i, r in enumerate(rewards)
    ]


def finished(finisher, groups, index: int, version: int):
    batch = RolloutBatch([s for g in groups for s in g], len(groups[0]))
    return finisher.finish(ProducedBatch(batch, index, {}), trainer_version=version)


def test_replay_stands_in_with_groups_of_earlier_batches_only():
    """replay_dup.py: a flat group was replaced by a copy of a group of the same batch,
    which then shared its group id (one 2G-sample group) and was trained on twice."""
    settings = RolloutSettings(2, 2, SamplingParams(), "group", seed=0)
    finisher = BatchFinisher(settings, max_staleness=1, replay=ReplayBuffer(8))
    first = finished(finisher, [scored_group(0, [0.0, 1.0]), scored_group(1, [1.0, 1.0])], 0, 0)
    assert first.metrics["replay/groups_used"] == 0  # nothing from an earlier batch yet
    assert [s.group_id for s in first.samples] == [0, 0, 1, 1]
    assert not any(s.replayed for s in first.samples)
    flat = [scored_group(2, [0.0, 0.0], 1), scored_group(3, [1.0, 1.0], 1)]
    second = finished(finisher, flat, 1, 1)
    assert second.metrics["replay/groups_used"] == 1  # batch 0's group 0, once only
    stand_in, kept = second.groups()
    assert [s.completion for s in stand_in] == [s.completion for s in first.groups()[0]]
    assert all(s.replayed and s.version == 0 for s in stand_in)  # versions, log-probs kept
    assert {s.group_id for s in stand_in} == {-1} and [s.group_id for s in kept] == [3, 3]
    assert [s.advantage for s in stand_in] == [s.advantage for s in first.groups()[0]] != [0, 0]
    assert group_indices(second.samples) == [[0, 1], [2, 3]]
    third = finished(finisher, [scored_group(4, [0.0, 0.0], 2)], 2, 2)
    assert third.metrics["replay/groups_used"] == 0  # a replayed group never re-enters


def test_replayed_group_ids_never_repeat_across_a_resume():
    settings = RolloutSettings(2, 1, SamplingParams(), "group", seed=0)
    finisher = BatchFinisher(settings, max_staleness=3, replay=ReplayBuffer(8))
    for index in range(2):
        finished(finisher, [scored_group(index, [0.0, 1.0], index)], index, index)
    replayed = finished(finisher, [scored_group(9, [0.0, 0.0], 2)], 2, 2)
    assert {s.group_id for s in replayed.samples} == {-1}
    resumed = BatchFinisher(settings, max_staleness=3, replay=ReplayBuffer(8))
    resumed.load_state_dict(saved(finisher.state_dict()))
    again = finished(resumed, [scored_group(10, [0.0, 0.0], 3)], 3, 3)
    assert {(s.group_id, s.prompt.uid) for s in again.samples} == {(-2, 1)}


def test_replay_buffer_evicts_groups_beyond_the_staleness_bound():
    worker, _ = make_worker(FakeEngine())
    buffer = ReplayBuffer(4)
    group = worker.produce(0).batch.samples[:3]
    FakeRewards().score(group)
    buffer.add(group)
    assert buffer.take(min_version=1) is None
    assert not buffer.groups


def test_sample_versions_come_from_the_engine():
    engine = FakeEngine()
    worker, settings = make_worker(engine)
    producer = SyncProducer(worker, BatchFinisher(settings, 0))
    producer.push_weights(7, lambda: [])
    batch = producer.next_batch(7)
    assert {s.version for s in batch.samples} == {7}


def test_streaming_steps_start_with_the_groups_that_are_ready():
    engine = FakeEngine(delay=0.02)
    settings = RolloutSettings(3, 4, SamplingParams(), "group", seed=0)
    worker = RolloutWorker(engine, FakeRewards(), FakeSampler(1), settings)  # chunks of 1 group
    producer = AsyncProducer(
        worker, BatchFinisher(settings, 1), prefetch_depth=4, max_staleness=1, streaming=True
    )
    producer.start()
    try:
        batches = consume(producer, 6, train_s=0.03)
    finally:
        producer.close()
    sizes = [len(b.groups()) for _, b in batches]
    assert all(1 <= n <= 4 for n in sizes)
    staleness = [v - s.version for v, b in batches for s in b.samples]
    assert max(staleness) <= 1
    uids = [s.prompt.uid for _, b in batches for s in b.samples[::3]]
    assert uids == list(range(len(uids)))  # no chunk made to go stale: prompts in order


# -- admission from the versions the trainer really reaches ---------------------------------


def run_trainer(target, seconds: float = 10.0) -> bool:
    """Run a fake trainer in a thread; True when it finished (False: it hung)."""
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=seconds)
    return not thread.is_alive()


@pytest.mark.parametrize(("max_staleness", "skipped"), [(0, {1}), (1, {10, 30}), (1, {3, 4, 5})])
def test_skipped_steps_never_stall_the_async_producer(max_staleness, skipped):
    """deadlock_skip.py / deadlock_skip2.py: a skipped step does not advance the version."""
    worker, settings = make_worker(FakeEngine())
    producer = AsyncProducer(
        worker, BatchFinisher(settings, max_staleness), 2, max_staleness, stall_timeout_s=5
    )
    producer.start()
    ages = []

    def trainer():
        version = 0
        for step in range(40):
            batch = producer.next_batch(version)
            ages.extend(version - s.version for s in batch.samples)
            version += step not in skipped
            producer.report_progress(version, 0)
            producer.push_weights(version, lambda: [])

    try:
        assert run_trainer(trainer), "the trainer hung waiting for a batch"
    finally:
        producer.close()
    assert len(ages) == 40 * 6 and max(ages) <= max_staleness


def fake_trainer(
    producer,
    batches: int,
    updates: int,
    version: int = 0,
    steps_left: int = 0,
    train_s: float = 0.0,
):
    """Takes `updates` steps per batch (`train_s` each), reporting progress and pushing
    after each."""
    consumed = []
    for _ in range(steps_left):  # the rest of a batch a resumed trainer still holds
        version += 1
        producer.report_progress(version, steps_left := steps_left - 1)
        producer.push_weights(version, lambda: [])
    for _ in range(batches):
        batch = producer.next_batch(version)
        consumed.append((version, batch))
        for left in reversed(range(updates)):
            time.sleep(train_s)
            version += 1
            producer.report_progress(version, left)
            producer.push_weights(version, lambda: [])
    return consumed


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_async_with_several_updates_per_batch_keeps_the_bound_at_consumption(max_staleness):
    worker, settings = make_worker(FakeEngine(delay=0.005), updates=2)
    producer = AsyncProducer(worker, BatchFinisher(settings, max_staleness), 3, max_staleness)
    producer.start()
    result = []
    try:
        assert run_trainer(lambda: result.extend(fake_trainer(producer, 6, updates=2)))
    finally:
        producer.close()
    ages = [v - s.version for v, b in result for s in b.samples]
    assert len(ages) == 36 and max(ages) <= max_staleness
    if max_staleness == 0:  # consumed exactly at versions 0, 2, 4, ...: sync's schedule
        assert [v for v, _ in result] == [0, 2, 4, 6, 8, 10] and set(ages) == {0}


@pytest.mark.parametrize("steps_left", [0, 1])
def test_resume_inside_a_batch_admits_the_next_batch(steps_left):
    """resume_midbatch.py: checkpoint at step 5 with U = 2, inside batch 2.

    steps_left 1: the trainer finishes batch 2 from its checkpoint first; 0: it goes on at
    version 5 without it (the old checkpoints), which used to wait for version 6 forever.
    """
    worker, settings = make_worker(FakeEngine(), updates=2)
    producer = AsyncProducer(worker, BatchFinisher(settings, 0), 1, 0, stall_timeout_s=5)
    producer.load_state_dict({"index": 3, "sampler": {"position": 6}})
    producer.report_progress(5, steps_left)  # Trainer._maybe_resume
    producer.push_weights(5, lambda: [])
    producer.start()
    result = []
    try:
        assert run_trainer(
            lambda: result.extend(fake_trainer(producer, 2, 2, version=5, steps_left=steps_left))
        )
    finally:
        producer.close()
    versions = [5 + steps_left, 7 + steps_left]
    assert [v for v, _ in result] == versions
    assert [{s.version for s in b.samples} for _, b in result] == [{v} for v in versions]
    assert result[0][1].samples[0].prompt.uid == 6  # the sampler position was restored


def test_nothing_generated_before_the_resume_push_is_handed_out():
    """A resumed trainer's first batch comes from its own weights, however loose the bound."""
    engine = FakeEngine()  # a fresh engine: version 0, the initial weights
    worker, settings = make_worker(engine)
    producer = AsyncProducer(worker, BatchFinisher(settings, 10), 2, max_staleness=10)
    producer.report_progress(5, 0)  # resumed at version 5
    producer.start()
    time.sleep(0.3)
    assert engine.calls == 0, "the producer generated with weights older than the resume"
    producer.push_weights(5, lambda: [])
    try:
        batch = producer.next_batch(5)
    finally:
        producer.close()
    assert {s.version for s in batch.samples} == {5}


class DeafEngine(FakeEngine):
    """Ignores weight updates (a server that never loads them)."""

    def update_weights(self, named_tensors, version):
        list(named_tensors)


def test_a_producer_that_can_never_be_admitted_stops_the_run_with_the_reason():
    worker, settings = make_worker(DeafEngine())
    producer = AsyncProducer(worker, BatchFinisher(settings, 0), 1, 0, stall_timeout_s=0.5)
    producer.start()
    try:
        producer.next_batch(0)
        producer.report_progress(1, 0)
        producer.push_weights(1, lambda: [])
        with pytest.raises(PipelineStallError, match=r"version 1 or newer.*holds 0.*version 1"):
            producer.next_batch(1)
    finally:
        producer.close()
    assert issubclass(PipelineStallError, RunError)  # the CLI prints it as one sentence


def test_sync_mode_refuses_samples_beyond_the_bound():
    """cfg_sync.py: sync mode used to train on whatever the engine held."""
    worker, settings = make_worker(DeafEngine())
    producer = SyncProducer(worker, BatchFinisher(settings, 1))
    producer.push_weights(1, lambda: [])
    producer.next_batch(1)  # one version old: within the bound
    producer.push_weights(2, lambda: [])
    with pytest.raises(RuntimeError, match="staleness bound broken"):
        producer.next_batch(2)


# -- exact resume of the producer -------------------------------------------------------------


def batch_key(batch):
    return [
        (s.group_id, s.prompt.uid, s.completion.text, s.version, s.advantage, s.replayed)
        for s in batch.samples
    ]


@pytest.mark.parametrize("no_signal", ["failing_uids", "flat_uids"])
def test_async_rerolls_are_served_by_the_same_batch_as_in_sync(no_signal):
    """Re-rolls happen when a batch is made, not when the trainer takes it: no timing."""
    rewards = FakeRewards(**{no_signal: {0, 3}})
    worker, settings = make_worker(FakeEngine(), rewards, reroll=1)
    sync = [b for _, b in consume(SyncProducer(worker, BatchFinisher(settings, 4)), 6)]
    worker2, settings2 = make_worker(FakeEngine(), rewards, reroll=1)
    producer = AsyncProducer(worker2, BatchFinisher(settings2, 4), 3, 4)
    producer.start()
    time.sleep(0.3)  # the producer runs ahead of the trainer
    try:
        asynchronous = [b for _, b in consume(producer, 6)]
    finally:
        producer.close()
    uids = [[s.prompt.uid for s in b.samples[::3]] for b in asynchronous]
    assert uids == [[s.prompt.uid for s in b.samples[::3]] for b in sync]
    assert uids[:4] == [[0, 1], [0, 2], [3, 4], [3, 5]]  # each failed prompt came back once


def saved(state):
    """Through a checkpoint file and back, as the trainer stores it."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def make_sync(rewards):
    worker, settings = make_worker(FakeEngine(), rewards, reroll=1)
    finisher = BatchFinisher(settings, max_staleness=2, replay=ReplayBuffer(4))
    return SyncProducer(worker, finisher)


def test_sync_producer_state_holds_replay_buffer_and_reroll_attempts():
    rewards = FakeRewards(failing_uids={1}, flat_uids={2, 3, 4, 5, 6, 7})
    straight = make_sync(rewards)
    first = straight.next_batch(0)  # prompt 0 has signal: buffered; prompt 1 fails: re-queued
    state = saved(straight.state_dict())
    rest = [batch_key(straight.next_batch(0)) for _ in range(3)]
    assert first.metrics["reroll/requeued"] == 1
    # prompt 1 failed again: no 2nd re-roll; prompt 2 was flat: re-rolled once, first
    assert [key[1] for key in rest[1][::3]] == [2, 3]
    assert any(key[-1] for key in rest[0])  # prompt 2 is flat: prompt 0's group replayed
    resumed = make_sync(rewards)
    resumed.load_state_dict(state)
    assert [batch_key(resumed.next_batch(0)) for _ in range(3)] == rest


def streaming_producer(engine, max_staleness: int, updates: int = 2) -> AsyncProducer:
    """Chunks of one group, batches of up to 2; U = `updates` for a batch of one chunk."""
    settings = RolloutSettings(3, 2, SamplingParams(), "group", 0, updates, updates)
    worker = RolloutWorker(engine, FakeRewards(), FakeSampler(1), settings)
    finisher = BatchFinisher(settings, max_staleness)
    return AsyncProducer(worker, finisher, 4, max_staleness, streaming=True, stall_timeout_s=5)


def test_streaming_at_zero_staleness_is_sync_schedule_whatever_the_timing():
    """streaming_resume.py: chunks made while the trainer was inside a batch went stale and
    were re-queued, a number that timing decided (and a resume remade them fresh)."""
    engine = FakeEngine(delay=0.002)
    producer = streaming_producer(engine, max_staleness=0)
    producer.start()
    result = []
    try:
        trainer = lambda: result.extend(fake_trainer(producer, 5, updates=2, train_s=0.02))  # noqa: E731
        assert run_trainer(trainer)
    finally:
        producer.close()
    assert [v for v, _ in result] == [0, 2, 4, 6, 8]  # one chunk per batch, U = 2 each
    assert [[s.prompt.uid for s in b.samples[::3]] for _, b in result] == [[k] for k in range(5)]
    assert [{s.version for s in b.samples} for _, b in result] == [{v} for v in (0, 2, 4, 6, 8)]
    assert engine.calls <= 6, "chunks were generated only to be thrown away"


def test_streaming_chunks_merge_within_the_bound_and_none_goes_stale():
    """A loose bound lets chunks run ahead and merge; each is admitted as if trained alone."""
    engine = FakeEngine()
    producer = streaming_producer(engine, max_staleness=4)
    producer.start()
    time.sleep(0.3)  # the producer runs ahead: chunks 0 and 1 fit the bound at version 0
    result = []
    try:
        assert run_trainer(lambda: result.extend(fake_trainer(producer, 4, updates=2)))
    finally:
        producer.close()
    ages = [v - s.version for v, b in result for s in b.samples]
    assert max(ages) <= 4 and len(result[0][1].groups()) == 2  # merged
    uids = [s.prompt.uid for _, b in result for s in b.samples[::3]]
    assert uids == list(range(len(uids)))


def test_a_streamed_step_never_takes_more_than_a_batch_of_groups():
    """b9_streaming_overshoot.py: chunks of 4 groups, batches of 6 (the config allows a
    chunk size that does not divide the batch): a step took two ready chunks, 8 groups. The
    second chunk now waits for the next step, which takes it first."""
    settings = RolloutSettings(3, 6, SamplingParams(), "group", 0, 1, 1)
    worker = RolloutWorker(FakeEngine(), FakeRewards(), FakeSampler(4), settings)
    producer = AsyncProducer(worker, BatchFinisher(settings, 4), 4, 4, streaming=True)
    producer.start()
    try:
        deadline = time.monotonic() + 10
        while producer.queue.qsize() < 3 and time.monotonic() < deadline:
            time.sleep(0.01)  # three chunks ready: the first step could have taken two
        assert producer.queue.qsize() >= 3
        batches = [producer.next_batch(0) for _ in range(3)]
    finally:
        producer.close()
    assert [len(b.groups()) for b in batches] == [4, 4, 4]
    uids = [s.prompt.uid for b in batches for s in b.samples[::3]]
    assert uids == list(range(12))  # the chunk kept back comes first, nothing lost


class SharedWeightsEngine(FakeEngine):
    """Like HFEngine(share_weights=True): the version moves, the tensors are never read."""

    def update_weights(self, named_tensors, version):
        self.version = version


def test_sync_push_reads_the_tensors_only_when_the_engine_does():
    reads = []

    def tensors():
        reads.append(1)
        return [("w", torch.zeros(2))]

    for engine, expected in ((SharedWeightsEngine(), 0), (FakeEngine(), 1)):
        reads.clear()
        worker, settings = make_worker(engine)
        producer = SyncProducer(worker, BatchFinisher(settings, max_staleness=0))
        producer.push_weights(1, tensors)
        assert engine.version == 1 and len(reads) == expected


def episode(uid: int, reward: float, segments: int) -> RolloutSample:
    """An agent episode of `segments` segments (the agent edited its history in between)."""

    def segment(k: int) -> Completion:
        start = Prompt(uid, f"start {k}", [5, 6 + k], messages=[{"role": "user", "content": str(k)}])
        trajectory = Trajectory([(2, True)], [0], [], start=start)
        return Completion([1, 2 + k], f"turn {k}", [-0.5, -0.25], "stop", 0, trajectory)

    last = segment(segments - 1)
    last.trajectory.earlier = [segment(k) for k in range(segments - 1)]
    return RolloutSample(uid, last.trajectory.start, last, reward=reward)


def test_every_segment_of_an_episode_is_trained_with_its_advantage():
    settings = RolloutSettings(2, 1, SamplingParams(), "group", seed=0)
    finisher = BatchFinisher(settings, max_staleness=1, replay=ReplayBuffer(4))
    group = [episode(0, 1.0, 3), episode(0, 0.0, 1)]
    batch = finished(finisher, [group], 0, 0)
    assert batch.metrics["agent/earlier_segments"] == 2
    assert [s.completion.text for s in batch.samples] == ["turn 0", "turn 1", "turn 2", "turn 0"]
    assert [s.prompt.ids for s in batch.samples][:3] == [[5, 6], [5, 7], [5, 8]]  # each its own start
    first, second = batch.samples[:3], batch.samples[3]
    assert {s.advantage for s in first} == {-second.advantage} and second.advantage < 0
    assert {s.reward for s in first} == {1.0} and {s.group_id for s in batch.samples} == {0}
    assert all(not s.completion.trajectory.earlier for s in batch.samples)  # trained once each
    assert len(group[0].completion.trajectory.earlier) == 2  # the buffered episode is whole
    restored = ReplayBuffer(4)  # a checkpoint of the buffer keeps every segment and start
    restored.load_state_dict(finisher.replay.state_dict())
    (kept,) = restored.groups
    again = kept[0].completion.trajectory.earlier
    assert [c.ids for c in again] == [[1, 2], [1, 3]] and again[1].trajectory.start.ids == [5, 7]
