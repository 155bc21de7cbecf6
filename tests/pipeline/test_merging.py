"""Streamed chunks' metrics merged by their declared rules (pipeline/merging.py), against the
whole batch's metrics computed at once by the same code that computes a chunk's: the
reward pool's summary and the trajectories' figures."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from leangrpo.contracts import Completion, Prompt, RolloutSample, Trajectory
from leangrpo.environments.metrics import FINISH_REASONS, trajectory_metrics
from leangrpo.pipeline.merging import merge_metrics, rule_for
from leangrpo.rewards.pool import _apply_and_summarise

SPECS = [
    SimpleNamespace(key="math", weight=1.0),
    SimpleNamespace(key="format", weight=0.5),
    SimpleNamespace(key="watched", weight=0.0),  # reported, never unscores a sample
]
TOOLS = ("search", "calc", "read")


def trajectory(rng: random.Random) -> Trajectory:
    turns = rng.randint(1, 4)
    segments = []
    for k in range(turns):
        segments.append((rng.randint(1, 9), True))
        if k < turns - 1:
            segments.append((rng.randint(1, 5), False))
    stats = {"turns": float(turns), "env_s": rng.random(), "model_tokens": 5.0 * turns}
    stats.update({name: float(rng.randint(0, 3)) for name in ("tool_calls", "tool_errors",
                  "parse_errors", "env_tokens", "control_tokens_stripped")})  # fmt: skip
    for tool in rng.sample(TOOLS, rng.randint(0, 2)):  # per tool: only the tools it called
        stats[f"tool_calls/{tool}"] = float(rng.randint(1, 3))
        stats[f"tool_errors/{tool}"] = float(rng.randint(0, 1))
    metrics = {"accuracy": rng.random()} if rng.random() < 0.6 else {}
    error = "the environment failed" if rng.random() < 0.15 else None
    return Trajectory(segments, [0] * turns, [], rewards={"bonus": rng.random()},
                      metrics=metrics, stats=stats, error=error)  # fmt: skip


def random_batch(rng: random.Random, groups: int, size: int, multiturn: float, scale: float):
    """Samples, each function's values (None: failed) and its failure count, per group."""
    samples, values = [], [[] for _ in SPECS]
    for g in range(groups):
        for _ in range(size):
            traj = trajectory(rng) if rng.random() < multiturn else None
            finish = rng.choice(FINISH_REASONS) if traj else rng.choice(("stop", "length"))
            completion = Completion([1] * rng.randint(1, 8), "x", [], finish, 0, traj)
            samples.append(RolloutSample(g, Prompt(g, "p", [1, 2]), completion))
            for f in range(len(SPECS)):
                value = None if rng.random() < 0.2 else scale * rng.uniform(-1, 1)
                values[f].append(value)
    return samples, values


def chunk_metrics(samples, values, failures, extra) -> dict[str, float]:
    """What RolloutWorker computes for one chunk (batch.py `_make_share` and `produce`)."""
    metrics = _apply_and_summarise(samples, SPECS, values, failures)
    metrics.update(trajectory_metrics(samples))
    metrics.update(extra)
    return metrics


@pytest.mark.parametrize("multiturn,scale", [(0.0, 1.0), (0.5, 1.0), (1.0, 3.0), (0.5, 1e300)])
@pytest.mark.parametrize("seed", range(6))
def test_merged_chunks_give_the_whole_batchs_metrics(seed, multiturn, scale):
    """b10_streaming_metrics.py: the merge averaged counts (reward/unscored 1.33 for 4
    unscored samples) and weighted every mean by samples, not by what it averages over."""
    rng = random.Random(seed)
    size = 3
    samples, values = random_batch(rng, rng.randint(3, 9), size, multiturn, scale)
    cuts = sorted(rng.sample(range(1, len(samples) // size), rng.randint(1, 3)))
    bounds = list(zip([0, *cuts], [*cuts, len(samples) // size]))
    parts, totals = [], {"failures": [0] * len(SPECS)}
    for start, stop in bounds:
        rows = slice(start * size, stop * size)
        failures = [rng.randint(0, 2) for _ in SPECS]
        extra = {"time/generate": rng.random(), "time/rewards": rng.random(),
                 "reroll/requeued": float(rng.randint(0, 2)), "reroll/dropped": 1.0}  # fmt: skip
        metrics = chunk_metrics(samples[rows], [v[rows] for v in values], failures, extra)
        parts.append((samples[rows], metrics))
        totals["failures"] = [a + b for a, b in zip(totals["failures"], failures)]
        for key, value in extra.items():
            totals[key] = totals.get(key, 0.0) + value
    extra = {k: v for k, v in totals.items() if k != "failures"}
    whole = chunk_metrics(samples, values, totals["failures"], extra)

    merged = merge_metrics(parts)
    assert sorted(merged) == sorted(whole)
    for key, want in whole.items():
        assert math.isclose(merged[key], want, rel_tol=1e-9, abs_tol=1e-12 * scale), key
    assert merged["reward/unscored"] == sum(s.reward is None for s in samples)
    if multiturn:
        assert any(k.startswith("multiturn/tool_calls/") for k in merged)


def test_a_metric_without_a_rule_is_an_error():
    with pytest.raises(KeyError, match="'reward/median' has no merge rule"):
        rule_for("reward/median")
    assert rule_for("reward/env/bonus/mean")[0].kind == "mean"
    assert rule_for("reward/mean/mean")[0].kind == "mean"  # a function named "mean"
    assert rule_for("multiturn/tool_errors/calc")[0].kind == "mean"
    assert rule_for("multiturn/turns_max")[0].kind == "max"


def test_the_reward_pools_own_chunk_metrics_merge():
    """b10_streaming_metrics.py after the sandbox: the pool adds
    `reward/<limit kind>_failures` (timeout, cpu, memory, ...), which no rule named, so every
    streamed step with more than one chunk stopped the run with a KeyError. Merged from
    the real pool's chunks, they are the whole batch's (counts add up)."""
    from support.configs import rewards_section

    from leangrpo.rewards import RewardPool

    def samples(texts):
        return [
            RolloutSample(
                i // 2,
                Prompt(i, "q", [1], columns={"answer": "42"}),
                Completion([1], t, [0.0], "stop", 0),
            )  # fmt: skip
            for i, t in enumerate(texts)
        ]

    texts = ["so 42", "7", "42", "no", "it is 42", "x"]
    with RewardPool(rewards_section("math", ("length", 0.5, {"target": 3}))) as pool:
        chunks = [samples(texts[:2]), samples(texts[2:])]
        parts = [(chunk, pool.score(chunk)) for chunk in chunks]
        whole = pool.score(samples(texts))
    assert any(k.endswith("_failures") and k.count("/") == 1 for k in whole)  # the limit kinds
    merged = merge_metrics(parts)
    assert sorted(merged) == sorted(whole)
    for key, want in whole.items():
        assert math.isclose(merged[key], want, rel_tol=1e-9, abs_tol=1e-12), key
