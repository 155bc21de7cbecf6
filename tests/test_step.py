"""One optimizer step: exact accumulation over micro-batches, and non-finite steps skipped."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from conftest import make_tiny_model

from leangrpo.attention import enable_packed_attention
from leangrpo.contracts import Completion, Prompt, RolloutSample, SamplingParams
from leangrpo.loss import LossConfig
from leangrpo.model import Policy
from leangrpo.packing import pack_samples
from leangrpo.step import normalisers, train_step

CFG = SimpleNamespace(
    loss=SimpleNamespace(
        type="grpo",
        epsilon_low=0.2,
        epsilon_high=0.2,
        delta=None,
        beta=0.0,
        mask_truncated_completions=False,
        is_correction="decoupled",
        is_mode="token_truncate",
        is_cap=2.0,
        is_min=0.0,
        scale_rewards="group",
        mu=1,
    ),
    logprobs=SimpleNamespace(chunked=True, row_tile=None, vocab_tile=None),
    rollout=SimpleNamespace(max_new_tokens=8),
    train=SimpleNamespace(max_grad_norm=1.0),
)


def make_samples(advantages: list[float]) -> list[RolloutSample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, adv in enumerate(advantages):
        prompt = torch.randint(2, 64, (4,), generator=g).tolist()
        comp = torch.randint(2, 64, (3 + i % 3,), generator=g).tolist()
        out.append(
            RolloutSample(
                i // 2,
                Prompt(i, "", prompt),
                Completion(comp, "", [-4.0] * len(comp), "stop", 0),
                advantage=adv,
            )
        )
    return out


def policy_and_optimizer():
    model = make_tiny_model("qwen2").train()
    enable_packed_attention(model, "sdpa_segments")
    policy = Policy(model, None, None, torch.device("cpu"), is_lora=False)
    return policy, torch.optim.AdamW(model.parameters(), lr=1e-2)


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_micro_batches_accumulate_to_the_single_batch_gradient():
    samples = make_samples([1.0, -1.0, 0.5, -0.5])
    grads = []
    for split in ([samples], [samples[:1], samples[1:3], samples[3:]]):
        policy, _ = policy_and_optimizer()
        optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.0)  # keep the grads' effect out
        captured = {}

        def keep(model=policy.model, captured=captured):
            for n, p in model.named_parameters():
                captured[n] = p.grad.detach().clone()

        optimizer.step = keep  # read the accumulated gradient at the moment of the step
        batches = [pack_samples(part) for part in split]
        train_step(
            policy, batches, optimizer, CFG, SamplingParams(), LossConfig.from_config(CFG.loss)
        )
        grads.append(captured)
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5)


def test_a_non_finite_loss_skips_the_update():
    policy, optimizer = policy_and_optimizer()
    before = snapshot(policy.model)
    batch = pack_samples(make_samples([float("nan"), 1.0]))
    result = train_step(
        policy, [batch], optimizer, CFG, SamplingParams(), LossConfig.from_config(CFG.loss)
    )
    assert not result.updated
    after = snapshot(policy.model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert all(p.grad is None for p in policy.model.parameters())


def test_normalisers_count_the_whole_step():
    batches = [pack_samples(make_samples([1.0, -1.0])), pack_samples(make_samples([1.0]))]
    norm = normalisers(batches, CFG)
    assert norm.sequences == 3
    assert norm.tokens == sum(b.num_completion_tokens for b in batches)


def test_normalisers_across_ranks_give_each_rank_its_share_of_the_global_counts():
    """FSDP averages gradients over ranks, so each rank divides by global / world_size."""
    batches = [pack_samples(make_samples([1.0, -1.0]))]
    local = normalisers(batches, CFG)
    seen = []

    def sum_over_ranks(values):  # as if the other rank held 5 sequences and 17 tokens
        seen.append(values)
        return [values[0] + 5, values[1] + 17]

    norm = normalisers(batches, CFG, world_size=2, sum_over_ranks=sum_over_ranks)
    assert seen == [[2.0, float(local.tokens)]]  # one reduction of the local counts
    assert norm.sequences == (2 + 5) / 2 and norm.tokens == (local.tokens + 17) / 2
    assert norm.global_tokens == local.tokens + 17 and norm.world_size == 2
