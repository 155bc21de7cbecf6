"""Why a generation batch has nothing to train on, and when that stops the run.

The trainer skips a batch with no scored sample (trainer.py `skip_batch`). Most causes
pass (a reward service down for a while, one bad prompt), so the run stops only after
`pipeline.max_consecutive_skipped_batches` such batches. Two causes are certain at the
first batch and stop it there, once its row is logged (`certain_cause`):

- the environment failed every trajectory the same way (its error alike on 2 or more
  prompts, numbers aside: a reset with an unknown role, a step that raises or returns the
  wrong type, a NaN reward, step timeouts ...): it will fail the next batch too;
- a reward function timed out on every sample (`reward/<name>/timeouts`, rewards/pool.py
  gives up after its chunks and two samples alone), unless rewards.systematic_failures is
  'warn'.

`skipped_batches_advice` names what to look at when the run stops at the limit: the
environment's errors and the reward functions that exist, never rewards a run has none of.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from leangrpo.contracts import RolloutBatch

# trajectory errors that are the engine's, not the environment's (environments/driver.py)
NOT_THE_ENVIRONMENT = ("generation failed",)


def certain_cause(batch: RolloutBatch, cfg: Any, metrics_path: Path) -> str | None:
    """The sentence a run stops with at this batch (which has no scored sample), or None
    when its cause may pass."""
    prompts = len({s.prompt.uid for s in batch.samples})
    if prompts < 2:  # one prompt's failures may be its data row's
        return None
    return _environment_failed_alike(batch, cfg, metrics_path) or _rewards_timed_out(batch, cfg)


def _environment_failed_alike(batch: RolloutBatch, cfg: Any, metrics_path: Path) -> str | None:
    errors = [s.completion.trajectory and s.completion.trajectory.error for s in batch.samples]
    if cfg.environment is None or not errors or not all(errors):
        return None
    if len({_way(e) for e in errors}) != 1 or errors[0].startswith(NOT_THE_ENVIRONMENT):
        return None
    return (
        f"the environment {cfg.environment.name!r} (environment.name) failed all "
        f"{len(errors)} trajectories of a generation batch the same way ({errors[0]}), so "
        f"there is nothing to train on and the next batch would fail alike; fix the "
        f"environment (multiturn/env_errors in {metrics_path} counts such failures)"
    )


def _way(error: str) -> str:
    """An error with its numbers left out: a kind of failure, not one instance of it."""
    return re.sub(r"\d+(\.\d+)?", "#", error)


def _rewards_timed_out(batch: RolloutBatch, cfg: Any) -> str | None:
    if cfg.rewards.systematic_failures != "stop":
        return None
    n = len(batch.samples)
    for key in reward_keys(batch.metrics, "timeouts"):
        if batch.metrics[f"reward/{key}/timeouts"] >= n:
            return (
                f"reward {key!r} timed out on all {n} samples of a generation batch (its "
                f"chunks, then samples alone, each past rewards.timeout_s = "
                f"{cfg.rewards.timeout_s:g} s), so it cannot score within its limit; make it "
                f"faster or raise rewards.timeout_s, or set rewards.systematic_failures: warn "
                f"to go on with such samples unscored"
            )
    return None


def reward_keys(metrics: dict[str, float], suffix: str) -> list[str]:
    """The reward functions (and environment terms) a batch's metrics name with `suffix`."""
    found = (re.fullmatch(rf"reward/(.+)/{suffix}", k) for k in metrics)
    return [m[1] for m in found if m]


def skipped_batches_advice(batch: RolloutBatch, cfg: Any, metrics_path: Path) -> str:
    """What to look at once max_consecutive_skipped_batches batches had nothing to train on."""
    causes = []
    if cfg.environment is not None and batch.metrics.get("multiturn/env_errors", 0):
        causes.append(
            f"the environment {cfg.environment.name!r} (multiturn/env_errors counts its failed trajectories)"
        )
    if cfg.rewards.functions:
        causes.append(
            "the reward functions (reward/*/failures and reward/*/timeouts count their failures, "
            "frac_reward_zero_std the groups they scored all alike)"
        )
    elif cfg.environment is not None:
        causes.append(
            f"the reward terms of the environment {cfg.environment.name!r} (reward/env/*)"
        )
    return f"check {' and '.join(dict.fromkeys(causes))} in {metrics_path}"
