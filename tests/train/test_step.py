"""One optimizer step: exact accumulation over micro-batches, and non-finite steps skipped."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from support.models import make_tiny_model

from leangrpo.contracts import Completion, Prompt, RolloutBatch, RolloutSample, SamplingParams
from leangrpo.model.policy import Policy
from leangrpo.ops.attention.adapter import enable_packed_attention
from leangrpo.train.loss import LossConfig
from leangrpo.train.packing import pack_samples
from leangrpo.train.step import (
    BatchInProgress,
    loss_inputs,
    normalisers,
    plan_steps,
    reduce_is_metrics,
    train_step,
)

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


def step_metrics_for(split) -> dict[str, float]:
    policy, _ = policy_and_optimizer()
    optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.0)
    batches = [pack_samples(part) for part in split]
    cfg_loss = LossConfig.from_config(CFG.loss)
    return train_step(policy, batches, optimizer, CFG, SamplingParams(), cfg_loss).metrics


def test_is_metrics_are_token_weighted_over_micro_batches():
    """Two micro-batches of 3 and 12 completion tokens give the IS metrics of one batch."""
    samples = make_samples([1.0, -1.0, 0.5, -0.5])
    whole = step_metrics_for([samples])
    split = step_metrics_for([samples[:1], samples[1:]])
    assert [len(s.completion.ids) for s in samples] == [3, 4, 5, 3]
    for name in ("is/weight_mean", "is/mismatch_kl", "is/weight_min", "is/weight_max"):
        assert split[name] == pytest.approx(whole[name], rel=1e-5), name
    assert split["is/weight_min"] < split["is/weight_max"]  # the weights really differ


def test_reduce_is_metrics_by_hand():
    mb = [
        {"is/tokens": 3.0, "is/weight_mean": 1.0, "is/weight_min": 0.5, "is/weight_max": 1.5},
        {"is/tokens": 1.0, "is/weight_mean": 2.0, "is/weight_min": 2.0, "is/weight_max": 2.0},
        {"is/tokens": 0.0, "is/weight_mean": 0.0, "is/weight_min": 0.0, "is/weight_max": 0.0},
    ]
    got = reduce_is_metrics(mb)
    # (3 * 1.0 + 1 * 2.0) / 4 = 1.25 (a mean of means would say 1.0 or 1.5); the empty
    # micro-batch's 0 placeholders are not a minimum
    assert got == {"is/weight_mean": 1.25, "is/weight_min": 0.5, "is/weight_max": 2.0}
    assert reduce_is_metrics(mb[2:]) == {
        "is/weight_mean": 0.0,
        "is/weight_min": 0.0,
        "is/weight_max": 0.0,
    }


def plan_cfg(steps_per_generation: int):
    base = {k: v for k, v in vars(CFG).items() if k not in ("train", "rollout")}
    return SimpleNamespace(
        **base,
        rollout=SimpleNamespace(max_new_tokens=8, num_generations=2),
        train=SimpleNamespace(
            max_grad_norm=1.0, steps_per_generation=steps_per_generation, micro_batch_tokens=12
        ),
        packing=SimpleNamespace(balance="tokens", shared_prefix="off"),
    )


def test_a_batch_with_no_samples_plans_no_steps_and_few_groups_fewer_steps():
    """empty_batch.py: no scored sample used to reach packing_metrics' max([])."""
    policy, _ = policy_and_optimizer()
    assert plan_steps([], plan_cfg(2), policy) == []
    steps = plan_steps(make_samples([1.0, -1.0]), plan_cfg(3), policy)  # one group, 3 steps asked
    assert len(steps) == 1 and steps[0].micro_batches


def test_a_batch_in_progress_resumes_with_the_same_micro_batches_and_old_logprobs():
    policy, _ = policy_and_optimizer()
    cfg = plan_cfg(2)
    samples = make_samples([1.0, -1.0, 0.5, -0.5, 0.25, -0.25])
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


class StepHostReads(torch.overrides.TorchFunctionMode):
    """Counts tensor -> Python reads (item, tolist, float/int/bool of a tensor) made by
    step.py itself (the model, the log-probs and the optimizer have their own)."""

    NAMES = {"item", "tolist", "__float__", "__int__", "__bool__"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.NAMES:
            frame = sys._getframe(1)  # the direct caller, past torch's Tensor wrappers
            while frame.f_code.co_filename.endswith(("torch/overrides.py", "torch/_tensor.py")):
                frame = frame.f_back
            self.count += frame.f_code.co_filename.endswith("leangrpo/train/step.py")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_step_host_reads_do_not_grow_with_micro_batches(mask_truncated):
    """Loss, metrics and IS metrics of every micro-batch reach the host in one copy."""
    cfg = SimpleNamespace(**vars(CFG))
    cfg.loss = SimpleNamespace(**{**vars(CFG.loss), "mask_truncated_completions": mask_truncated})
    samples = make_samples([1.0, -1.0, 0.5, -0.5, 0.25, -0.25])
    counts, results = [], []
    for split in ([samples], [samples[:2], samples[2:4], samples[4:]]):
        policy, optimizer = policy_and_optimizer()
        batches = [pack_samples(part) for part in split]
        with StepHostReads() as reads:
            result = train_step(
                policy, batches, optimizer, cfg, SamplingParams(), LossConfig.from_config(cfg.loss)
            )
        counts.append(reads.count)
        results.append(result.metrics)
    # the metrics, the gradient norm, and the loss tokens when truncated ones are masked
    assert counts[0] == counts[1] == 2 + mask_truncated
    torch.testing.assert_close(results[1]["loss"], results[0]["loss"], rtol=1e-5, atol=1e-6)
    assert results[0]["is/weight_mean"] == pytest.approx(results[1]["is/weight_mean"])


def group_samples(prompt_len: int, comp_lens: list[list[int]]) -> list[RolloutSample]:
    """One group per entry of comp_lens, each with its own prompt of prompt_len tokens."""
    g = torch.Generator().manual_seed(3)
    out = []
    for gid, lens in enumerate(comp_lens):
        prompt = torch.randint(2, 64, (prompt_len,), generator=g).tolist()
        for n in lens:
            comp = torch.randint(2, 64, (n,), generator=g).tolist()
            lps = (-torch.rand(n, generator=g) * 3 - 1).tolist()
            adv = float(torch.randn(1, generator=g))
            out.append(
                RolloutSample(
                    gid,
                    Prompt(gid, "", prompt),
                    Completion(comp, "", lps, "stop", 0),
                    reward=adv,
                    advantage=adv,
                )
            )
    return out


def step_gradient(samples, loss_type: str, shared_prefix: str, budget: int):
    """The step's plan, loss, metrics and accumulated gradient (lr 0: read at the step)."""
    cfg = plan_cfg(1)
    cfg.loss = SimpleNamespace(**{**vars(CFG.loss), "type": loss_type})
    cfg.train.micro_batch_tokens = budget
    cfg.packing.shared_prefix = shared_prefix
    policy, _ = policy_and_optimizer()
    optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.0)
    grads = {}

    def keep(model=policy.model):
        grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})

    optimizer.step = keep
    (step,) = plan_steps(samples, cfg, policy)
    result = train_step(
        policy, step.micro_batches, optimizer, cfg, SamplingParams(), LossConfig.from_config(cfg.loss)
    )
    return step, result.metrics, grads


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_a_split_shared_prefix_group_trains_like_the_plain_and_unsplit_layouts(loss_type):
    """prefix_budget.py: a group over train.micro_batch_tokens is split across micro-batches,
    its prompt once in each; loss, IS metrics and gradient equal the other layouts."""
    samples = group_samples(10, [[3, 6, 4, 5], [2, 5, 6]])  # groups of 28 and 23 tokens
    budget = 24
    split, split_metrics, split_grads = step_gradient(samples, loss_type, "on", budget)
    assert split.metrics["packing/shared_prefix"] == 1.0
    assert split.metrics["packing/split_groups"] == 1.0  # only the 28-token group
    assert [mb.num_tokens for mb in split.micro_batches] == [24, 14, 23]  # 10 + 14 and 10 + 4
    assert max(float(g.abs().max()) for g in split_grads.values()) > 1e-3  # a real gradient
    for reference in (("off", budget), ("on", 1000)):  # plain; shared prefix, one micro-batch
        ref, ref_metrics, ref_grads = step_gradient(samples, loss_type, *reference)
        assert ref.metrics["packing/split_groups"] == 0.0
        names = ("loss", "grad_norm", "loss/tokens", "loss/sequences", "loss/entropy")
        for name in (*names, "is/weight_mean", "is/mismatch_kl"):
            assert split_metrics[name] == pytest.approx(ref_metrics[name], rel=1e-5, abs=1e-6)
        assert split_grads.keys() == ref_grads.keys()
        for name in ref_grads:
            torch.testing.assert_close(split_grads[name], ref_grads[name], atol=1e-6, rtol=1e-5)


def test_bypass_applies_no_is_weight_whatever_the_is_mode():
    """bypass_ignores_is_mode.py: in bypass the behaviour log-probs are the old ones, so no IS
    weight exists and is_mode / is_cap / is_min change nothing (preflight lists them as
    ignored); the same settings do change a decoupled step."""
    samples = make_samples([1.0, -1.0, 0.5, -0.5])
    modes = [("token_truncate", 2.0, 0.0), ("token_mask", 1.05, 0.95), ("sequence_mask", 1.01, 0.99)]
    results = {}
    for correction in ("bypass", "decoupled"):
        for mode, cap, low in modes:
            cfg = SimpleNamespace(**vars(CFG))
            setting = {"is_correction": correction, "is_mode": mode, "is_cap": cap, "is_min": low}
            cfg.loss = SimpleNamespace(**{**vars(CFG.loss), **setting})
            policy, _ = policy_and_optimizer()
            optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.0)
            grads = {}
            optimizer.step = lambda m=policy.model, g=grads: g.update(
                {n: p.grad.clone() for n, p in m.named_parameters()}
            )
            batch = pack_samples(samples)
            logprobs = torch.full((batch.num_completion_tokens,), -3.0)
            inputs, is_metrics = loss_inputs(batch, logprobs, None, cfg)
            if correction == "bypass":
                assert inputs.is_weights is None and is_metrics == {}
                assert torch.equal(inputs.old_logprobs, batch.behaviour_logprobs)
            loss_cfg = LossConfig.from_config(cfg.loss)
            train_step(policy, [batch], optimizer, cfg, SamplingParams(), loss_cfg)
            results[correction, mode] = grads
    for correction, equal in (("bypass", True), ("decoupled", False)):
        first = results[correction, modes[0][0]]
        for mode, _, _ in modes[1:]:
            same = all(torch.equal(first[n], results[correction, mode][n]) for n in first)
            assert same == equal, (correction, mode)


class _PeerRank:
    """A DistContext of rank 1 of 2 whose peer trained 3 sequences of 20 loss tokens."""

    distributed, world_size, rank = True, 2, 1

    def __init__(self):
        self.reduced: list[list[float]] = []

    def all_reduce(self, values, op="sum"):
        self.reduced.append([float(v) for v in values])
        return [values[0] + 3.0, values[1] + 20.0] if op == "sum" else list(values)

    def all_true(self, flag):
        return flag

    def barrier(self):
        return 0.0

    def all_gather_object(self, obj):
        return [({"clip_frac": 0.0}, [], 0.5), obj]


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_a_rank_dealt_no_group_trains_padding_only_with_truncated_completions_masked(
    mask_truncated,
):
    """dist_empty_share_mask.py: fewer groups than ranks leaves a rank with padding
    micro-batches only; with loss.mask_truncated_completions its loss-token count was
    torch.stack([]) and the step raised. It counts 0 and runs the padding passes."""
    from leangrpo.distributed.fsdp import padding_batch
    from leangrpo.model.scoring import PackedScorer, install_chunked_head

    cfg = SimpleNamespace(**vars(CFG))
    cfg.loss = SimpleNamespace(**{**vars(CFG.loss), "mask_truncated_completions": mask_truncated})
    assert normalisers([], cfg, 2, lambda counts: [3.0, 20.0]).tokens == 10.0
    policy, optimizer = policy_and_optimizer()
    install_chunked_head(policy.model)
    policy.root = PackedScorer(policy.model)
    ctx = _PeerRank()
    result = train_step(
        policy, [padding_batch(0)] * 2, optimizer, cfg, SamplingParams(),
        LossConfig.from_config(cfg.loss), ctx,
    )  # fmt: skip
    assert ctx.reduced[0] == [0.0, 0.0]  # this rank's sequences and loss tokens
    assert result.updated and result.metrics["loss"] == 0.25  # the peer's loss, averaged
