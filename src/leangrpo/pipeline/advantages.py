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
- Overflow-safe: rewards may be any finite float (1e200 and -1e200 in one group). Every
  statistic is computed on rewards divided by 2^e, the power of two just above the largest
  |reward| of the group (of the batch for batch statistics), so every intermediate stays
  within [-4n, 4n]. Dividing by a power of two is exact, so the results are bit-identical to the plain formulas whenever
  those neither overflow nor underflow. Group- and batch-scaled advantages stay small (the
  spread divides out); with scale="none" (A = r - mean) a group whose advantages leave the float32 range the
  loss computes in gets 0.0 and is counted in `groups/advantage_overflow`. A reported
  std beyond the float range is reported as the largest float.
Pure Python: a batch holds at most a few thousand samples.
"""

from __future__ import annotations

import logging
import math
import sys

from leangrpo.contracts import RolloutBatch, RolloutSample

SCALES = ("group", "batch", "none")
FLOAT32_MAX = 3.4028234663852886e38
log = logging.getLogger("leangrpo")


def _exponent(values: list[float]) -> int:
    """e such that every |v| / 2^e <= 1 (0 for an empty or all-zero list)."""
    top = max((abs(v) for v in values), default=0.0)
    return math.frexp(top)[1] if top else 0


def _unscale(x: float, e: int) -> float:
    """x * 2^e, saturating at the largest float instead of overflowing."""
    try:
        return math.ldexp(x, e)
    except OverflowError:
        return math.copysign(sys.float_info.max, x)


def _scaled_mean_std(ys: list[float], ddof: int) -> tuple[float, float]:
    mean = sum(ys) / len(ys)
    if len(ys) <= ddof:
        return mean, 0.0
    return mean, math.sqrt(sum((y - mean) ** 2 for y in ys) / (len(ys) - ddof))


def mean_std(values: list[float], ddof: int = 0) -> tuple[float, float]:
    """Mean and std (ddof=0: population, 1: sample; 0.0 for too few values) of finite
    floats, without overflow (see the module docstring); `values` must not be empty."""
    e = _exponent(values)
    mean, std = _scaled_mean_std([math.ldexp(v, -e) for v in values], ddof)
    return _unscale(mean, e), _unscale(std, e)


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


def _group_advantages(
    rewards: list[float], scale: str, eps: float, batch_scale: tuple[int, float]
) -> list[float]:
    """A for one group's scored rewards, in the group's own scale 2^e (so that a group of
    small rewards in a batch of huge ones does not underflow); `batch_scale` is the batch's
    (exponent, std in its own scale)."""
    e = _exponent(rewards)
    ys = [math.ldexp(r, -e) for r in rewards]
    mean_y, std_y = _scaled_mean_std(ys, 1)
    if scale == "group":  # eps / 2^e saturates for tiny rewards: A -> 0, as eps rules
        return [(y - mean_y) / (std_y + _unscale(eps, -e)) for y in ys]
    if scale == "batch":  # (r - mean) / (std_b + eps), rescaled by 2^(e - e_b) <= 1
        e_b, std_b = batch_scale
        divisor = std_b + _unscale(eps, -e_b)
        return [_unscale((y - mean_y) / divisor, e - e_b) for y in ys]
    return [_unscale(y - mean_y, e) for y in ys]


def compute_advantages(batch: RolloutBatch, scale: str, eps: float = 1e-4) -> dict[str, float]:
    """Set `sample.advantage` for every sample of `batch`; return reward/advantage metrics."""
    groups = _check_groups(batch, scale)
    all_scored = [r for group in groups for r in _scored(group)]
    e_b = _exponent(all_scored)
    ys = [math.ldexp(r, -e_b) for r in all_scored]
    batch_mean_y, batch_std_y = _scaled_mean_std(ys, 1) if ys else (0.0, 0.0)
    zero_std = usable = unscored = overflow = 0
    for group in groups:
        rewards = _scored(group)
        unscored += not rewards
        for sample in group:
            sample.advantage = 0.0
        if len(rewards) < 2:
            continue
        usable += 1
        zero_std += max(rewards) == min(rewards)
        advantages = _group_advantages(rewards, scale, eps, (e_b, batch_std_y))
        if not all(abs(a) <= FLOAT32_MAX for a in advantages):  # only with scale="none"
            overflow += 1
            continue
        for sample, advantage in zip([s for s in group if s.reward is not None], advantages):
            sample.advantage = advantage
    if overflow:
        log.warning(
            "%d group(s) got advantage 0: with loss.scale_rewards none their rewards' spread "
            "exceeds the float32 range; rescale the reward or scale by group/batch",
            overflow,
        )
    scored_samples = [s for s in batch.samples if s.reward is not None]
    return {
        "frac_reward_zero_std": zero_std / usable if usable else 0.0,
        "reward/mean": _unscale(batch_mean_y, e_b),
        "reward/std": _unscale(batch_std_y, e_b),
        "advantage/abs_mean": (
            sum(abs(s.advantage) for s in scored_samples) / len(scored_samples)
            if scored_samples
            else 0.0
        ),
        "groups/unscored": float(unscored),
        "groups/too_few_scored": float(len(groups) - usable - unscored),
        "groups/advantage_overflow": float(overflow),
    }
