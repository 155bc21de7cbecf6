"""The batch in progress (train/inflight.py): resumed with its micro-batches and log-probs."""

from __future__ import annotations

import pytest
import torch
from support.steps import policy_and_optimizer, step_config, step_samples

from leangrpo.contracts import RolloutBatch
from leangrpo.train.inflight import BatchInProgress
from leangrpo.train.planning import plan_steps


def test_a_batch_in_progress_resumes_with_the_same_micro_batches_and_old_logprobs():
    policy, _ = policy_and_optimizer()
    cfg = step_config(train={"steps_per_generation": 2})
    samples = step_samples([1.0, -1.0, 0.5, -0.5, 0.25, -0.25])
    for s in samples:
        s.reward = s.advantage
    steps = plan_steps(samples, cfg, policy)
    for mb in (mb for step in steps for mb in step.micro_batches):
        mb.old_logprobs = torch.randn(mb.num_completion_tokens)  # what the old pass attached
    work = BatchInProgress(RolloutBatch(samples, 2), steps, iterations=2)
    work.take()
    work.take()
    work.take()  # inside the 2nd iteration (mu): one step of 4 left
    state = work.state_dict()
    torch.manual_seed(1)  # weights moved since: nothing may be recomputed from them
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(torch.randn_like(p))
    resumed = BatchInProgress.from_state(state, cfg, policy)
    assert (resumed.done, resumed.remaining) == (3, 1)
    assert resumed.take()[0] is resumed.steps[1]
    for old, new in zip(steps, resumed.steps):
        assert len(old.micro_batches) == len(new.micro_batches)
        for a, b in zip(old.micro_batches, new.micro_batches):
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.targets, b.targets)
            assert torch.equal(a.old_logprobs, b.old_logprobs) and b.ref_logprobs is None
            assert torch.equal(a.advantages, b.advantages)


def test_the_batch_metrics_are_saved_until_its_first_step_logs_them():
    """b5_inflight_metrics.py: a stop after a batch was scored and before its first step
    saved the batch without its metrics (reward/*, advantage/*, completions/*, ...), which
    a straight run logs with that first step, so the resumed row lacked them."""
    policy, _ = policy_and_optimizer()
    cfg = step_config()
    samples = step_samples([1.0, -1.0, 0.5, -0.5])
    for s in samples:
        s.reward = s.advantage
    metrics = {"reward/mean": 0.25, "advantage/abs_mean": 0.75, "samples/unscored": 0.0}
    steps = plan_steps(samples, cfg, policy)
    work = BatchInProgress(RolloutBatch(samples, 2), steps, 2, 0, metrics)
    resumed = BatchInProgress.from_state(work.state_dict(), cfg, policy)
    planned, logged = resumed.take()
    assert {k: logged[k] for k in metrics} == metrics
    assert planned.metrics.items() <= logged.items()
    after_first = BatchInProgress.from_state(resumed.state_dict(), cfg, policy)
    assert after_first.metrics == {} and not set(metrics) & set(after_first.take()[1])


def test_a_batch_generated_without_routes_is_refused_to_a_replay_run_saying_why():
    """moe_resume_replay_on.py: a run resumed mid-batch with rollout.routing_replay newly
    on stopped after its model loaded with 'sample 0 has no route record'. The checkpoint
    now records the batch's end and whether it carries routes (`summary`, checked before
    the model loads: checkpoint/rundir.py); a checkpoint saved without that record is
    refused here with the same sentence, naming the cause and what to do."""
    from support.moe import moe_policy

    from leangrpo.errors import RunError

    policy, _ = policy_and_optimizer()
    cfg = step_config(train={"steps_per_generation": 2})
    samples = step_samples([1.0, -1.0, 0.5, -0.5])
    for s in samples:
        s.reward = s.advantage
    work = BatchInProgress(RolloutBatch(samples, 2), plan_steps(samples, cfg, policy), 2)
    work.take()
    assert work.summary(step=7) == {"ends_at_step": 10, "routes": False}
    with pytest.raises(RunError) as err:
        BatchInProgress.from_state(work.state_dict(), cfg, moe_policy())
    assert str(err.value).startswith(
        "The checkpoint holds a batch in progress generated without route records (rollout.routing_replay was off when it was generated)"
    )
    assert "resume with rollout.routing_replay: false until that batch is done" in str(err.value)
