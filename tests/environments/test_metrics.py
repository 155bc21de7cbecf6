"""The `multiturn/*` metrics of a batch (environments/metrics.py) on trajectories made by
hand, each figure checked against its value: finish fractions, per-trajectory means and
counts, per-tool counts, turn lengths, the environment's own metrics."""

from __future__ import annotations

import pytest

from leangrpo.contracts import Completion, Prompt, RolloutSample, Trajectory
from leangrpo.environments.metrics import trajectory_metrics


def sample(finish, segments, stats, metrics=None, error=None) -> RolloutSample:
    turns = sum(m for _, m in segments)
    trajectory = Trajectory(segments, [0] * turns, [], metrics=metrics or {}, stats=stats, error=error)
    ids = [5] * sum(n for n, _ in segments)
    model = sum(n for n, m in segments if m)
    return RolloutSample(0, Prompt(0, "", [1]), Completion(ids, "", [-1.0] * model, finish, 0, trajectory))


def test_every_figure_is_its_value():
    samples = [
        sample("stop", [(4, True), (3, False), (2, True)], {"turns": 2, "tool_calls": 1, "tool_calls/add": 1},
               {"valid": 1.0}),
        sample("stop", [(6, True)], {"turns": 1}, {"valid": 0.5}),
        sample("length", [(3, True), (2, False), (8, True)], {"turns": 2, "tool_calls": 2, "tool_calls/add": 2,
               "tool_errors": 1, "tool_errors/add": 1, "env_s": 0.25}),
        sample("error", [(5, True)], {"turns": 1, "env_s": 0.5}, error="step failed: x"),
    ]  # fmt: skip
    m = trajectory_metrics(samples)
    assert m["multiturn/finish/stop"] == 0.5 and m["multiturn/finish/length"] == 0.25
    assert m["multiturn/finish/error"] == 0.25 and m["multiturn/finish/max_turns"] == 0.0
    assert m["multiturn/turns"] == 1.5 and m["multiturn/turns_max"] == 2
    assert m["multiturn/env_errors"] == 1.0 and m["multiturn/env_s"] == 0.75
    assert m["multiturn/tool_calls"] == 0.75 and m["multiturn/tool_calls/add"] == 0.75
    assert m["multiturn/tool_errors"] == 0.25 and m["multiturn/tool_errors/add"] == 0.25
    assert m["multiturn/turn_0_length"] == pytest.approx((4 + 6 + 3 + 5) / 4)
    assert m["multiturn/turn_1_length"] == pytest.approx((2 + 8) / 2)  # of those that reached it
    assert m["multiturn/env/valid"] == 0.75  # the mean over the trajectories that report it
    assert trajectory_metrics(samples, "eval/multiturn")["eval/multiturn/finish/stop"] == 0.5


def test_single_turn_samples_give_nothing():
    plain = RolloutSample(0, Prompt(0, "", [1]), Completion([5], "", [-1.0], "stop", 0))
    assert trajectory_metrics([plain]) == {}
