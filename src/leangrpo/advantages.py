"""Group-relative advantages (GRPO), written in place on each `RolloutSample.advantage`.

    A_i = r_i - mean(group's scored rewards), then divided by
      scale="group": std(group's scored rewards) + eps
      scale="batch": std(all scored rewards of the batch) + eps
      scale="none":  nothing (Dr. GRPO)

Choices:
- std is the unbiased sample std (ddof=1), torch.std's default, as TRL uses.
- A sample whose `reward` is None (a reward function failed) is left out of every
  statistic and gets advantage 0.0; the trainer does not pack it. A group with fewer than
  two scored samples has no baseline, so all its samples get 0.0.
- A group's std is zero when its scored rewards are all equal (compared exactly, so that
  float rounding in the mean cannot hide a zero-signal group). `frac_reward_zero_std` is
  over the groups with at least two scored samples.
Pure Python: a batch holds at most a few thousand samples.
"""

from __future__ import annotations

import math

from leangrpo.contracts import RolloutBatch, RolloutSample

SCALES = ("group", "batch", "none")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _std(values: list[float]) -> float:
    """Unbiased sample std; 0.0 for fewer than two values."""
    if len(values) < 2:
        return 0.0
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _scored(group: list[RolloutSample]) -> list[float]:
    return [s.reward for s in group if s.reward is not None]


def _check_groups(batch: RolloutBatch, scale: str) -> list[list[RolloutSample]]:
    if scale not in SCALES:
        raise ValueError(f"scale_rewards={scale!r} is not one of {', '.join(SCALES)}")
    if batch.group_size < 1 or len(batch.samples) % batch.group_size:
        raise ValueError(
            f"RolloutBatch has {len(batch.samples)} samples, not a multiple of group_size="
            f"{batch.group_size}; keep every group whole (G consecutive samples per prompt)"
        )
    groups = batch.groups()
    for group in groups:
        ids = {s.group_id for s in group}
        if len(ids) != 1:
            raise ValueError(
                f"a group of {batch.group_size} consecutive samples mixes group_ids {sorted(ids)}; "
                "keep each prompt's completions consecutive"
            )
    return groups


def compute_advantages(batch: RolloutBatch, scale: str, eps: float = 1e-4) -> dict[str, float]:
    """Set `sample.advantage` for every sample of `batch`; return reward/advantage metrics."""
    groups = _check_groups(batch, scale)
    all_scored = [r for group in groups for r in _scored(group)]
    batch_std = _std(all_scored)
    zero_std = usable = unscored = 0
    for group in groups:
        rewards = _scored(group)
        unscored += not rewards
        for sample in group:
            sample.advantage = 0.0
        if len(rewards) < 2:
            continue
        usable += 1
        zero_std += max(rewards) == min(rewards)
        mean = _mean(rewards)
        divisor = {"group": _std(rewards) + eps, "batch": batch_std + eps, "none": 1.0}[scale]
        for sample in group:
            if sample.reward is not None:
                sample.advantage = (sample.reward - mean) / divisor
    scored_samples = [s for s in batch.samples if s.reward is not None]
    return {
        "frac_reward_zero_std": zero_std / usable if usable else 0.0,
        "reward/mean": _mean(all_scored) if all_scored else 0.0,
        "reward/std": batch_std,
        "advantage/abs_mean": (
            _mean([abs(s.advantage) for s in scored_samples]) if scored_samples else 0.0
        ),
        "groups/unscored": float(unscored),
        "groups/too_few_scored": float(len(groups) - usable - unscored),
    }
