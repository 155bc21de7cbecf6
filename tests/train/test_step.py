"""One optimizer step (train/step.py): exact accumulation over micro-batches, non-finite
steps skipped, the step's figures in one host copy, and a torchrun rank's padding."""

from __future__ import annotations

import sys

import pytest
import torch
from support.steps import policy_and_optimizer, step_config, step_samples

from leangrpo.contracts import Completion, Prompt, RolloutSample, SamplingParams
from leangrpo.distributed.dealing import padding_batch
from leangrpo.train.inputs import loss_inputs, normalisers
from leangrpo.train.packing import pack_samples
from leangrpo.train.planning import plan_steps
from leangrpo.train.ranks import clip_gradients
from leangrpo.train.step import reduce_is_metrics, train_step

CFG = step_config()


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_micro_batches_accumulate_to_the_single_batch_gradient():
    samples = step_samples([1.0, -1.0, 0.5, -0.5])
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
        train_step(policy, batches, optimizer, CFG, SamplingParams())
        grads.append(captured)
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5)


def test_a_non_finite_loss_skips_the_update():
    policy, optimizer = policy_and_optimizer()
    before = snapshot(policy.model)
    batch = pack_samples(step_samples([float("nan"), 1.0]))
    result = train_step(policy, [batch], optimizer, CFG, SamplingParams())
    assert not result.updated
    after = snapshot(policy.model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert all(p.grad is None for p in policy.model.parameters())


def step_metrics_for(split) -> dict[str, float]:
    policy, _ = policy_and_optimizer()
    optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.0)
    batches = [pack_samples(part) for part in split]
    return train_step(policy, batches, optimizer, CFG, SamplingParams()).metrics


def test_is_metrics_are_token_weighted_over_micro_batches():
    """Two micro-batches of 3 and 12 completion tokens give the IS metrics of one batch."""
    samples = step_samples([1.0, -1.0, 0.5, -0.5])
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


# the step's own modules: the step, its inputs and the ranks it spans (one process here)
STEP_MODULES = ("leangrpo/train/step.py", "leangrpo/train/inputs.py", "leangrpo/train/ranks.py")


class StepHostReads(torch.overrides.TorchFunctionMode):
    """Counts tensor -> Python reads (item, tolist, float/int/bool of a tensor) made by
    the step's own modules (the model, the log-probs and the optimizer have their own)."""

    NAMES = {"item", "tolist", "__float__", "__int__", "__bool__"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.NAMES:
            frame = sys._getframe(1)  # the direct caller, past torch's Tensor wrappers
            while frame.f_code.co_filename.endswith(("torch/overrides.py", "torch/_tensor.py")):
                frame = frame.f_back
            self.count += frame.f_code.co_filename.endswith(STEP_MODULES)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_step_host_reads_do_not_grow_with_micro_batches(mask_truncated):
    """Loss, metrics and IS metrics of every micro-batch reach the host in one copy."""
    cfg = step_config(loss={"mask_truncated_completions": mask_truncated})
    samples = step_samples([1.0, -1.0, 0.5, -0.5, 0.25, -0.25])
    counts, results = [], []
    for split in ([samples], [samples[:2], samples[2:4], samples[4:]]):
        policy, optimizer = policy_and_optimizer()
        batches = [pack_samples(part) for part in split]
        with StepHostReads() as reads:
            result = train_step(policy, batches, optimizer, cfg, SamplingParams())
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
    cfg = step_config(
        loss={"type": loss_type},
        train={"micro_batch_tokens": budget},
        packing={"shared_prefix": shared_prefix},
    )
    policy, _ = policy_and_optimizer()
    optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.0)
    grads = {}

    def keep(model=policy.model):
        grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})

    optimizer.step = keep
    (step,) = plan_steps(samples, cfg, policy)
    result = train_step(policy, step.micro_batches, optimizer, cfg, SamplingParams())
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
    samples = step_samples([1.0, -1.0, 0.5, -0.5])
    modes = [("token_truncate", 2.0, 0.0), ("token_mask", 1.05, 0.95), ("sequence_mask", 1.01, 0.99)]
    results = {}
    for correction in ("bypass", "decoupled"):
        for mode, cap, low in modes:
            setting = {"is_correction": correction, "is_mode": mode, "is_cap": cap, "is_min": low}
            cfg = step_config(loss=setting)
            policy, _ = policy_and_optimizer()
            optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.0)
            grads = {}
            optimizer.step = lambda m=policy.model, g=grads: g.update(
                {n: p.grad.clone() for n, p in m.named_parameters()}
            )
            batch = pack_samples(samples)
            logprobs = torch.full((batch.num_completion_tokens,), -3.0)
            inputs, is_metrics = loss_inputs(batch, logprobs, None, cfg.loss)
            if correction == "bypass":
                assert inputs.is_weights is None and is_metrics == {}
                assert torch.equal(inputs.old_logprobs, batch.behaviour_logprobs)
            train_step(policy, [batch], optimizer, cfg, SamplingParams())
            results[correction, mode] = grads
    for correction, equal in (("bypass", True), ("decoupled", False)):
        first = results[correction, modes[0][0]]
        for mode, _, _ in modes[1:]:
            same = all(torch.equal(first[n], results[correction, mode][n]) for n in first)
            assert same == equal, (correction, mode)


class _PeerRank:
    """Rank 1 of 2 (a contracts.StepRanks) whose peer trained 3 sequences of 20 loss tokens."""

    world_size, rank, processes = 2, 1, 2

    def __init__(self):
        self.reduced: list[list[float]] = []

    def all_reduce(self, values, op="sum"):
        self.reduced.append([float(v) for v in values])
        return [values[0] + 3.0, values[1] + 20.0] if op == "sum" else list(values)

    def all_true(self, flag):
        return flag

    def all_gather_object(self, obj):
        return [({"clip_frac": 0.0}, [], 0.5), obj]

    def clip_gradients(self, parameters, max_norm):
        return clip_gradients(parameters, max_norm)

    def release_gathered(self, policy):
        pass


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_a_rank_dealt_no_group_trains_padding_only_with_truncated_completions_masked(
    mask_truncated,
):
    """dist_empty_share_mask.py: fewer groups than ranks leaves a rank with padding
    micro-batches only; with loss.mask_truncated_completions its loss-token count was
    torch.stack([]) and the step raised. It counts 0 and runs the padding passes."""
    from leangrpo.model.scoring import PackedScorer, install_chunked_head

    cfg = step_config(loss={"mask_truncated_completions": mask_truncated})
    assert normalisers([], cfg.loss, 8, 2, lambda counts: [3.0, 20.0]).tokens == 10.0
    policy, optimizer = policy_and_optimizer()
    install_chunked_head(policy.model)
    policy.root = PackedScorer(policy.model)
    ranks = _PeerRank()
    result = train_step(
        policy, [padding_batch(0)] * 2, optimizer, cfg, SamplingParams(), ranks
    )
    assert ranks.reduced[0] == [0.0, 0.0]  # this rank's sequences and loss tokens
    assert result.updated and result.metrics["loss"] == 0.25  # the peer's loss, averaged
