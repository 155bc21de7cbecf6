"""Planning a batch (train/planning.py): optimizer steps of whole groups."""

from __future__ import annotations

from support.steps import policy_and_optimizer, step_config, step_samples

from leangrpo.train.planning import plan_steps


def test_a_batch_with_no_samples_plans_no_steps_and_few_groups_fewer_steps():
    """empty_batch.py: no scored sample used to reach packing_metrics' max([])."""
    policy, _ = policy_and_optimizer()
    assert plan_steps([], step_config(train={"steps_per_generation": 2}), policy) == []
    three = step_config(train={"steps_per_generation": 3})
    steps = plan_steps(step_samples([1.0, -1.0]), three, policy)  # one group, 3 steps asked
    assert len(steps) == 1 and steps[0].micro_batches
