"""Multi-turn trajectories in the packed step (issue 22, "what must hold" 2): only the
model's tokens are trained on. The environment's tokens sit in the row as context (no
target, no behaviour log-prob, no loss, no KL, no entropy) and every normaliser counts
model tokens only, so the packed step's loss and gradient equal a per-sequence reference
(one sequence at a time, full logits, an explicit per-token mask) for every loss type, in
the plain and the shared-prefix layouts, with truncated trajectories masked or not."""

from __future__ import annotations

import pytest
import torch
from support.steps import policy_and_optimizer, step_config

from leangrpo.contracts import Completion, Prompt, RolloutSample, SamplingParams, Trajectory
from leangrpo.train.packing import pack_samples
from leangrpo.train.planning import plan_steps
from leangrpo.train.step import train_step

LOSSES = ["grpo", "bnpo", "dr_grpo", "dapo", "gspo", "cispo"]
# (prompt length, [segments of each trajectory of the group]); True = model turn
GROUPS = [
    (5, [[(4, True), (5, False), (2, True)], [(3, True)]]),
    (3, [[(2, True), (3, False), (3, True), (4, False), (1, True)], [(5, True), (2, False), (6, True)]]),
]  # fmt: skip
FINISH = ["stop", "max_turns", "length", "stop"]


def model_mask(sample: RolloutSample) -> list[bool]:
    """Per completion token: written by the model? Spelt out from the GROUPS shapes, token by
    token, not through Trajectory.model_offsets (what packing itself uses)."""
    mask = []
    for n, is_model in sample.completion.trajectory.segments:
        mask += [is_model] * n
    return mask


def trajectory_samples(seed: int = 0) -> list[RolloutSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for gid, (prompt_len, shapes) in enumerate(GROUPS):
        prompt = Prompt(gid, "", torch.randint(2, 64, (prompt_len,), generator=g).tolist())
        for segments in shapes:
            i = len(out)
            ids = torch.randint(2, 64, (sum(n for n, _ in segments),), generator=g).tolist()
            model = sum(n for n, m in segments if m)
            logprobs = (-torch.rand(model, generator=g) * 3).tolist()  # behaviour
            turns = sum(m for _, m in segments)
            trajectory = Trajectory(segments, [0] * turns, [])
            completion = Completion(ids, "", logprobs, FINISH[i], 0, trajectory)
            out.append(RolloutSample(gid, prompt, completion, advantage=[1.0, -0.5, 0.7, -1.2][i]))
    return out


def reference_loss(model, samples, cfg) -> torch.Tensor:
    """One sequence at a time through the plain model, log-probs of the model tokens only."""
    loss_cfg, masked = cfg.loss, cfg.loss.mask_truncated_completions
    per_seq, token_sum, tokens = [], torch.zeros(()), 0
    for s in samples:
        ids = torch.tensor([s.prompt.ids + s.completion.ids])
        logits = model(input_ids=ids, use_cache=False).logits[0].float()  # (L, V)
        positions = torch.tensor([j for j, m in enumerate(model_mask(s)) if m]) + len(s.prompt.ids)
        logp = torch.log_softmax(logits[positions - 1], -1).gather(1, ids[0, positions, None])[:, 0]
        behaviour = torch.tensor(s.completion.logprobs)
        keep = 0.0 if masked and s.truncated else 1.0
        if loss_cfg.type == "gspo":
            log_s = (logp - behaviour).mean()
            ratio = torch.exp(log_s.detach() + logp - logp.detach())
        else:
            ratio = torch.exp(logp - behaviour)
        adv = torch.tensor(s.advantage)
        if loss_cfg.type == "cispo":
            per = -ratio.clamp(max=loss_cfg.epsilon_high).detach() * adv * logp
        else:
            clipped = ratio.clamp(1 - loss_cfg.epsilon_low, 1 + loss_cfg.epsilon_high)
            per = -torch.minimum(ratio * adv, clipped * adv)
        per_seq.append(per.mean() * keep)
        token_sum = token_sum + per.sum() * keep
        tokens += len(per) * int(keep)
    if loss_cfg.type in ("grpo", "gspo"):
        return torch.stack(per_seq).sum() / len(samples)
    if loss_cfg.type == "dr_grpo":
        return token_sum / (len(samples) * cfg.model_token_budget())
    return token_sum / tokens  # bnpo, dapo, cispo (one process: global tokens = tokens)


def step_config_for(loss_type: str, shared: str, masked: bool):
    return step_config(
        loss={
            "type": loss_type,
            "is_correction": "bypass",
            "epsilon_high": 5.0 if loss_type == "cispo" else 0.2,
            "mask_truncated_completions": masked,
        },
        train={"micro_batch_tokens": 64},
        packing={"shared_prefix": shared},
        rollout={"max_new_tokens": 8},
    )


def packed_step(samples, cfg):
    """The trainer's own path: plan_steps (packing) -> train_step; lr 0, gradient kept."""
    policy, _ = policy_and_optimizer()
    optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.0)
    grads = {}
    optimizer.step = lambda: grads.update(
        {n: p.grad.detach().clone() for n, p in policy.model.named_parameters()}
    )
    (step,) = plan_steps(samples, cfg, policy)
    result = train_step(policy, step.micro_batches, optimizer, cfg, SamplingParams())
    return step, result.metrics, grads


@pytest.mark.parametrize("shared", ["off", "on"])
@pytest.mark.parametrize("loss_type", LOSSES)
def test_packed_multiturn_loss_and_gradient_equal_the_per_sequence_reference(loss_type, shared):
    samples = trajectory_samples()
    for masked in (False, True) if loss_type in ("grpo", "dapo") else (False,):
        cfg = step_config_for(loss_type, shared, masked)
        step, metrics, grads = packed_step(samples, cfg)
        assert step.metrics["packing/shared_prefix"] == float(shared == "on")
        mb = step.micro_batches[0]
        model_tokens = sum(len(s.completion.logprobs) for s in samples)
        assert mb.num_completion_tokens == model_tokens < sum(len(s.completion.ids) for s in samples)
        policy, _ = policy_and_optimizer()  # the same initial weights
        expected = reference_loss(policy.model, samples, cfg)
        expected.backward()
        assert metrics["loss"] == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
        kept = model_tokens - masked * sum(
            len(s.completion.logprobs) for s in samples if s.truncated
        )
        assert metrics["loss/tokens"] == kept
        for name, param in policy.model.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, atol=1e-6, rtol=1e-5)


def test_model_tokens_are_the_targets_and_environment_tokens_context():
    samples = trajectory_samples()
    for shared in (False, True):
        batch = pack_samples(samples, shared_prefix=shared)
        row = batch.input_ids[0]
        # every target is a model token, predicted by the position right before it
        expected = [
            t
            for s in (samples if not shared else sorted(samples, key=lambda s: s.group_id))
            for t in [tok for tok, m in zip(s.completion.ids, model_mask(s)) if m]
        ]
        assert batch.targets.tolist() == expected
        assert batch.completion_lens.tolist() == [len(s.completion.logprobs) for s in samples]
        assert batch.truncated.tolist() == [False, True, True, False]
        if not shared:
            assert torch.equal(row[batch.completion_index + 1], batch.targets)
            assert batch.num_tokens == sum(s.num_tokens for s in samples)


def test_a_one_turn_trajectory_packs_bit_identically_to_a_single_turn_completion():
    samples = trajectory_samples()
    single = [
        RolloutSample(s.group_id, s.prompt, Completion(s.completion.ids, "", [-1.0] * len(s.completion.ids), "stop", 0))
        for s in samples
    ]  # fmt: skip
    one_turn = [
        RolloutSample(
            s.group_id,
            s.prompt,
            Completion(s.completion.ids, "", [-1.0] * len(s.completion.ids), "stop", 0,
                       Trajectory([(len(s.completion.ids), True)], [0], [])),
        )
        for s in samples
    ]  # fmt: skip
    for shared in (False, True):
        a, b = pack_samples(single, shared_prefix=shared), pack_samples(one_turn, shared_prefix=shared)
        for name in ("input_ids", "position_ids", "cu_seqlens", "completion_index", "targets",
                     "token_seq", "completion_lens", "behaviour_logprobs", "truncated"):  # fmt: skip
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_packing_refuses_log_probs_that_do_not_match_the_model_tokens():
    sample = trajectory_samples()[0]
    sample.completion.logprobs = sample.completion.logprobs + [0.0]  # one per id, not per model token
    with pytest.raises(ValueError, match="6 model tokens but 7 behaviour log-probs"):
        pack_samples([sample])
    sample = trajectory_samples()[0]
    sample.completion.trajectory.segments[1] = (4, False)
    with pytest.raises(ValueError, match="segments must cover the ids"):
        pack_samples([sample])


def test_groups_whose_trajectories_start_from_different_prompts_are_packed_plain():
    samples = trajectory_samples()
    samples[1].prompt = Prompt(0, "", samples[1].prompt.ids[:-1] + [7])  # another reset
    cfg = step_config_for("grpo", "on", False)
    step, _, _ = packed_step(samples, cfg)
    assert step.metrics["packing/shared_prefix"] == 0.0
