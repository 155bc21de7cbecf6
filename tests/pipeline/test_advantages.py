"""advantages.py: hand values for group/batch/none, None rewards, zero-std counting, and
overflow-safe statistics (huge rewards, bit-identical results for ordinary ones)."""

from __future__ import annotations

import math
import sys

import pytest

from leangrpo.contracts import Completion, Prompt, RolloutBatch, RolloutSample
from leangrpo.pipeline.advantages import compute_advantages, mean_std


def make_batch(groups: list[list[float | None]]) -> RolloutBatch:
    samples = []
    for gid, rewards in enumerate(groups):
        prompt = Prompt(uid=gid, text="p", ids=[1, 2])
        for r in rewards:
            completion = Completion(ids=[3], text="c", logprobs=[-0.1], finish_reason="stop",
                                    version=0)  # fmt: skip
            samples.append(RolloutSample(group_id=gid, prompt=prompt, completion=completion,
                                         reward=r, advantage=123.0))  # fmt: skip
    return RolloutBatch(samples=samples, group_size=len(groups[0]))


def advantages(batch: RolloutBatch) -> list[float]:
    return [s.advantage for s in batch.samples]


def test_group_scale_by_hand():
    # [1, 2, 3]: mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1 -> [-1, 0, 1] / (1 + eps)
    batch = make_batch([[1.0, 2.0, 3.0]])
    metrics = compute_advantages(batch, "group", eps=1e-4)
    assert advantages(batch) == pytest.approx([-1 / 1.0001, 0.0, 1 / 1.0001], abs=1e-12)
    assert metrics["reward/mean"] == pytest.approx(2.0)
    assert metrics["reward/std"] == pytest.approx(1.0)
    assert metrics["advantage/abs_mean"] == pytest.approx(2 / 3 / 1.0001)


def test_batch_scale_by_hand():
    # group means 2 and 4/3; batch std of [1, 2, 3, 0, 0, 4]: mean 10/6,
    # sum of squares 30 - 6 * (10/6)^2 = 40/3, / 5 = 8/3, std sqrt(8/3) = 1.632993161855452
    batch = make_batch([[1.0, 2.0, 3.0], [0.0, 0.0, 4.0]])
    compute_advantages(batch, "batch", eps=0.0)
    s = 1.632993161855452
    expected = [-1 / s, 0.0, 1 / s, -4 / 3 / s, -4 / 3 / s, (4 - 4 / 3) / s]
    assert advantages(batch) == pytest.approx(expected, abs=1e-12)


def test_no_scaling_by_hand():
    batch = make_batch([[1.0, 2.0, 3.0], [0.0, 0.0, 4.0]])
    compute_advantages(batch, "none")
    # r - group mean: [-1, 0, 1], [-4/3, -4/3, 8/3]
    assert advantages(batch) == pytest.approx([-1, 0, 1, -4 / 3, -4 / 3, 8 / 3], abs=1e-12)


def test_unscored_samples_are_left_out():
    # group 0: [1, None, 3] -> mean 2, std sqrt(((1-2)^2 + (3-2)^2) / 1) = sqrt(2)
    # group 1: all None -> unscored; group 2: one scored -> too few, all advantages 0
    batch = make_batch([[1.0, None, 3.0], [None, None, None], [5.0, None, None]])
    metrics = compute_advantages(batch, "group", eps=0.0)
    r2 = 1 / math.sqrt(2)
    assert advantages(batch) == pytest.approx([-r2, 0.0, r2] + [0.0] * 6, abs=1e-12)
    assert metrics["groups/unscored"] == 1.0
    assert metrics["groups/too_few_scored"] == 1.0
    # reward stats over the scored rewards [1, 3, 5]: mean 3, unbiased std 2
    assert metrics["reward/mean"] == pytest.approx(3.0)
    assert metrics["reward/std"] == pytest.approx(2.0)


def test_zero_std_groups_are_counted():
    # group 1's rewards are all 0.1 (their float mean is not exactly 0.1): zero std, A = 0;
    # group 2 is unscored and is not counted among the groups with a std
    batch = make_batch([[0.0, 1.0, 1.0], [0.1, 0.1, 0.1], [None, None, None]])
    metrics = compute_advantages(batch, "group")
    assert metrics["frac_reward_zero_std"] == pytest.approx(0.5)
    assert advantages(batch)[3:6] == pytest.approx([0.0, 0.0, 0.0], abs=1e-9)


def test_bad_input():
    batch = make_batch([[1.0, 2.0]])
    with pytest.raises(ValueError, match="scale_rewards='mean'"):
        compute_advantages(batch, "mean")
    batch.samples.pop()
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        compute_advantages(batch, "group")
    mixed = make_batch([[1.0, 2.0], [3.0, 4.0]])
    mixed.samples[1], mixed.samples[2] = mixed.samples[2], mixed.samples[1]
    with pytest.raises(ValueError, match="mixes group_ids"):
        compute_advantages(mixed, "group")


def _plain(groups: list[list[float]], scale: str, eps: float) -> list[float]:
    """The textbook formulas, for rewards small enough not to overflow."""

    def std(v: list[float]) -> float:
        m = sum(v) / len(v)
        return math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1))

    batch_std = std([r for g in groups for r in g])
    out = []
    for g in groups:
        divisor = {"group": std(g) + eps, "batch": batch_std + eps, "none": 1.0}[scale]
        out += [(r - sum(g) / len(g)) / divisor for r in g]
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_scaling_keeps_ordinary_rewards_bit_identical(scale):
    import random

    rng = random.Random(0)
    for magnitude in (1e-6, 1.0, 37.5, 1e9):
        groups = [[rng.uniform(-1, 1) * magnitude for _ in range(4)] for _ in range(5)]
        batch = make_batch(groups)
        compute_advantages(batch, scale, eps=1e-4)
        assert advantages(batch) == _plain(groups, scale, 1e-4)  # exactly, not approx


def test_huge_rewards_give_finite_advantages():
    # 1e200 and -1e200 in one group: mean 0, std 1e200 -> A = [1, -1, 0] (eps is negligible);
    # the plain formulas overflow ((1e200)^2 = inf) and crashed or gave NaN
    batch = make_batch([[1e200, -1e200, 0.0], [1.0, 2.0, 3.0]])
    metrics = compute_advantages(batch, "group")
    assert advantages(batch) == pytest.approx([1.0, -1.0, 0.0, -1 / 1.0001, 0.0, 1 / 1.0001])
    assert all(math.isfinite(v) for v in metrics.values())
    # near the float limit the std itself overflows (sqrt(2) * top): the advantages stay
    # finite (+-1/sqrt(2)), the reported std saturates at the largest float
    top = 1.7e308
    for scale in ("group", "batch"):
        batch = make_batch([[top, -top], [top, top]] if scale == "group" else [[top, -top]])
        metrics = compute_advantages(batch, scale)
        assert advantages(batch)[:2] == pytest.approx([2**-0.5, -(2**-0.5)])
    assert metrics["reward/std"] == sys.float_info.max and metrics["reward/mean"] == 0.0


def test_scale_none_with_rewards_past_float32_zeroes_the_group():
    # A = r - mean = +-1e200 cannot enter the float32 loss: the group is zeroed and counted
    batch = make_batch([[1e200, -1e200], [1.0, 3.0]])
    metrics = compute_advantages(batch, "none")
    assert advantages(batch) == [0.0, 0.0, -1.0, 1.0]
    assert metrics["groups/advantage_overflow"] == 1.0


def test_mean_std_is_overflow_safe():
    assert mean_std([1e308, 1e308, 1e308]) == (1e308, 0.0)  # the plain sum overflows
    mean, std = mean_std([1e200, -1e200], ddof=0)
    assert mean == 0.0 and std == pytest.approx(1e200)
    assert all(math.isfinite(x) for x in mean_std([5e-324, 0.0], ddof=1))  # subnormals


def test_eval_metrics_average_huge_rewards_without_overflow():
    """A reward of +-1e308 (finite, so accepted) gave eval/reward = nan through np.mean."""
    from leangrpo.pipeline.evaluation import eval_metrics

    batch = make_batch([[1e308, 1e308, -1e308, None]])  # 1e308 + 1e308 overflows
    for s in batch.samples:
        s.rewards = {"f": s.reward}
    metrics = eval_metrics(batch.samples, version=3)
    assert metrics["eval/reward"] == metrics["eval/reward/f"] == pytest.approx(1e308 / 3)
    assert metrics["eval/failures"] == 1.0 and metrics["eval/completion_length"] == 1.0
