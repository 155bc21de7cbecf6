"""train/skips.py: a batch with nothing to train on stops the run at once when its cause
is certain to last, and the stop at the limit names what exists (issue 38, item 8-9)."""

from __future__ import annotations

from pathlib import Path

from support.configs import ROOT, minimal_run

from leangrpo.config import config_from_dict, load_config
from leangrpo.contracts import Completion, Prompt, RolloutBatch, RolloutSample, Trajectory
from leangrpo.train.skips import certain_cause, skipped_batches_advice

METRICS = Path("run/metrics.jsonl")


def env_cfg(**rewards):
    cfg = load_config(ROOT / "examples" / "tools_demo.yaml", [])
    if rewards:
        cfg.rewards = cfg.rewards.model_copy(update=rewards)
    return cfg


def batch(errors: list[str | None], prompts: int = 4, **metrics: float) -> RolloutBatch:
    samples = []
    for i, error in enumerate(errors):
        trajectory = Trajectory(segments=[(1, True)], turn_versions=[0], messages=[], error=error)
        completion = Completion([1], "", [0.0], "stop", 0, trajectory=trajectory)
        samples.append(
            RolloutSample(i % prompts, Prompt(uid=i % prompts, text="", ids=[1]), completion)
        )
    return RolloutBatch(samples, len(errors) // prompts, dict(metrics))


def test_an_environment_failing_every_trajectory_alike_stops_at_the_first_batch() -> None:
    """bad_env_failure_blames_rewards.sh: the run went on for max_consecutive_skipped_batches
    batches, then blamed 'the reward functions' (there were none)."""
    cfg = env_cfg(functions=[])
    errors = [f"step failed: KeyError: 'boom' (turn {i % 3})" for i in range(8)]  # numbers aside
    cause = certain_cause(batch(errors), cfg, METRICS)
    assert cause is not None and cause.startswith("the environment 'tools' (environment.name)")
    assert (
        "failed all 8 trajectories of a generation batch the same way (step failed: KeyError"
        in cause
    )
    assert "reward" not in cause


def test_environment_failures_that_may_pass_do_not_stop_at_once() -> None:
    cfg = env_cfg()
    mixed = ["step failed: KeyError: 'boom'"] * 4 + ["finish failed: returned None"] * 4
    assert certain_cause(batch(mixed), cfg, METRICS) is None  # two ways
    assert (
        certain_cause(batch(["step failed: x"] * 8, prompts=1), cfg, METRICS) is None
    )  # one prompt
    some = ["step failed: x"] * 7 + [None]
    assert certain_cause(batch(some), cfg, METRICS) is None  # one trajectory ended well
    engine = ["generation failed: the engine ended the turn with finish reason 'error'"] * 8
    assert certain_cause(batch(engine), cfg, METRICS) is None  # the engine's, not the environment's


def test_a_reward_that_timed_out_on_every_sample_stops_at_the_first_batch() -> None:
    """bad_reward_always_timeout_slow.sh: 17 timeouts a batch, then a generic stop after
    max_consecutive_skipped_batches batches (about 28 minutes at the defaults)."""
    cfg = config_from_dict(minimal_run(rewards={"functions": ["math"], "timeout_s": 1}))
    timed_out = batch([None] * 8, **{"reward/math/timeouts": 8.0, "reward/math/failures": 8.0})
    cause = certain_cause(timed_out, cfg, METRICS)
    assert cause is not None and cause.startswith("reward 'math' timed out on all 8 samples")
    assert "rewards.timeout_s = 1 s" in cause
    some = batch([None] * 8, **{"reward/math/timeouts": 7.0})
    assert certain_cause(some, cfg, METRICS) is None
    warn = config_from_dict(
        minimal_run(rewards={"functions": ["math"], "systematic_failures": "warn"})
    )
    assert certain_cause(timed_out, warn, METRICS) is None


def test_the_stop_at_the_limit_names_what_the_run_has() -> None:
    errors = batch(["step failed: x"] * 8, **{"multiturn/env_errors": 8.0})
    advice = skipped_batches_advice(errors, env_cfg(functions=[]), METRICS)
    assert advice.startswith("check the environment 'tools' (multiturn/env_errors")
    assert "reward functions" not in advice
    advice = skipped_batches_advice(batch([None] * 8), env_cfg(), METRICS)
    assert advice.startswith("check the reward functions (reward/*/failures")
    advice = skipped_batches_advice(batch([None] * 8), env_cfg(functions=[]), METRICS)
    assert (
        advice == f"check the reward terms of the environment 'tools' (reward/env/*) in {METRICS}"
    )
