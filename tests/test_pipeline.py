"""Producers with a fake engine: staleness bound, version tags, failures, replay, re-roll."""

from __future__ import annotations

import threading
import time

import pytest

from leangrpo.contracts import Completion, EngineVersionError, Prompt, SamplingParams
from leangrpo.pipeline import (
    AsyncProducer,
    BatchFinisher,
    ReplayBuffer,
    RolloutSettings,
    RolloutWorker,
    SyncProducer,
)


class FakeEngine:
    def __init__(self, delay: float = 0.0, fail_at: int | None = None):
        self.version = 0
        self.delay = delay
        self.fail_at = fail_at
        self.calls = 0

    def generate(self, prompts, params, n, version):
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

    def state_dict(self):
        return {"position": self.position, "queue": [p.uid for p in self.queue]}

    def load_state_dict(self, state):
        self.position = state["position"]


def make_worker(engine, rewards=None, prompts=2, group=3, updates=1):
    settings = RolloutSettings(
        group, prompts, SamplingParams(), "group", seed=0, updates_per_batch=updates
    )
    sampler = FakeSampler(prompts)
    return RolloutWorker(engine, rewards or FakeRewards(), sampler, settings), settings


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
    sync = consume(SyncProducer(worker, BatchFinisher(settings, 0)), 4)
    worker2, settings2 = make_worker(FakeEngine())
    producer = AsyncProducer(worker2, BatchFinisher(settings2, 0), 2, 0)
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
    assert time.perf_counter() - t0 < 5
    producer.close()
    assert not any(t.name == "leangrpo-producer" and t.is_alive() for t in threading.enumerate())


def test_failed_groups_are_rerolled_and_really_reinjected():
    worker, settings = make_worker(FakeEngine(), FakeRewards(failing_uids={0}))
    finisher = BatchFinisher(
        settings, 0, reroll_attempts=1, sampler=worker.sampler, sampler_lock=worker.sampler_lock
    )
    producer = SyncProducer(worker, finisher)
    first = producer.next_batch(0)
    assert first.metrics["reroll/requeued"] == 1
    second = producer.next_batch(0)
    assert second.samples[0].prompt.uid == 0  # served again before new prompts
    third = producer.next_batch(0)
    assert 0 not in {s.prompt.uid for s in third.samples}  # attempts are capped


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
    assert len(uids) == len(set(uids)) or producer.dropped_stale > 0
