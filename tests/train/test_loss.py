"""loss.py: hand-computed values per variant, autograd against a per-sequence loop,
exactness under micro-batching, delta clip, KL k3, IS weights by hand."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import get_args

import pytest
import torch
from pydantic import ValidationError

from leangrpo.config.training import LossConfig
from leangrpo.contracts import LossInputs, LossNormalisers
from leangrpo.train.loss import (
    VARIANTS,
    build_mask,
    compute_loss,
    importance_weights,
    sums_to_means,
)

F64 = torch.float64
LN = math.log

# Two sequences (3 + 2 tokens). Ratios r = exp(logp - old) = [1.0, 1.5, 0.5, 1.1, 0.7];
# advantages +1 for sequence 0 and -2 for sequence 1.
LOGP = [-1.0, -0.5, -2.0, -0.2, -1.5]
LOG_RATIO = [0.0, LN(1.5), LN(0.5), LN(1.1), LN(0.7)]
ADV = [1.0, 1.0, 1.0, -2.0, -2.0]
TOKEN_SEQ = [0, 0, 0, 1, 1]
NORM = LossNormalisers(
    sequences=2, tokens=5, global_tokens=22, world_size=2, max_completion_length=4
)


def make_inputs(mask=None, ref_minus_logp=None, is_weights=None, dtype=F64) -> LossInputs:
    logp = torch.tensor(LOGP, dtype=dtype, requires_grad=True)
    old = (logp.detach() - torch.tensor(LOG_RATIO, dtype=dtype)).to(dtype)
    ref = (
        None
        if ref_minus_logp is None
        else logp.detach() + torch.tensor(ref_minus_logp, dtype=dtype)
    )
    return LossInputs(
        logprobs=logp,
        old_logprobs=old,
        advantages=torch.tensor(ADV, dtype=dtype),
        mask=torch.tensor(mask or [1.0] * 5, dtype=torch.float32),
        token_seq=torch.tensor(TOKEN_SEQ),
        num_sequences=2,
        ref_logprobs=ref,
        is_weights=None if is_weights is None else torch.tensor(is_weights, dtype=dtype),
    )


# Clipped per-token losses with eps 0.2 (clip range [0.8, 1.2]):
#   seq 0, A=+1: r=1.0 -> -1.0;  r=1.5 -> -min(1.5, 1.2) = -1.2;  r=0.5 -> -min(0.5, 0.8) = -0.5
#   seq 1, A=-2: r=1.1 -> -min(-2.2, -2.2) = 2.2;  r=0.7 -> -min(-1.4, -1.6) = 1.6
#   token sum = -2.7 + 3.8 = 1.1
# gspo: s0 = (1.0*1.5*0.5)^(1/3) = 0.75^(1/3) = 0.9085602964160698 (inside the clip range),
#       s1 = (1.1*0.7)^(1/2) = sqrt(0.77) = 0.8774964387392122 (inside)
# cispo (cap 1.3): w = [1.0, 1.3, 0.5, 1.1, 0.7]; -w*A*logp =
#   [-1*1*-1.0, -1.3*1*-0.5, -0.5*1*-2.0, -1.1*-2*-0.2, -0.7*-2*-1.5]
#   = [1.0, 0.65, 1.0, -0.44, -2.1], sum 0.11
HAND = {
    "grpo": ({}, (-2.7 / 3 + 3.8 / 2) / 2),  # (-0.9 + 1.9) / 2 = 0.5
    "bnpo": ({}, 1.1 / 5),  # 0.22
    "dr_grpo": ({}, 1.1 / (2 * 4)),  # 0.1375
    "dapo": ({}, 1.1 / (22 / 2)),  # 0.1
    "gspo": ({}, (-0.9085602964160698 + 2 * 0.8774964387392122) / 2),  # 0.42321629
    "cispo": ({"epsilon_high": 1.3}, 0.11 / (22 / 2)),  # 0.01
}


def test_every_variant_has_a_hand_value():
    assert set(HAND) == set(VARIANTS)


@pytest.mark.parametrize("variant", sorted(HAND))
def test_hand_values(variant):
    overrides, expected = HAND[variant]
    cfg = LossConfig(type=variant, **overrides)
    out = compute_loss(make_inputs(), NORM, cfg)
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)


def test_gspo_clipped_sequence_by_hand():
    # eps 0.05: s1 = 0.877 < 0.95 and A=-2 -> -min(-1.755, -1.9) = 1.9 for both tokens;
    # s0 = 0.9086 < 0.95 with A=+1 is not clipped (min picks s0): -0.9086.
    cfg = LossConfig(type="gspo", epsilon_low=0.05, epsilon_high=0.05)
    inputs = make_inputs()
    out = compute_loss(inputs, NORM, cfg)
    assert out.loss.item() == pytest.approx((-0.9085602964160698 + 1.9) / 2, abs=1e-12)
    out.loss.backward()
    # d/dlogp_t of the token mean of -s0 (grad sg form: ds_t/dlogp_t = s0), / 2 sequences
    grad = inputs.logprobs.grad
    assert torch.allclose(grad[:3], torch.full((3,), -0.9085602964160698 / 3 / 2, dtype=F64))
    assert torch.equal(grad[3:], torch.zeros(2, dtype=F64))  # clipped sequence: no gradient


def test_mask_excludes_tokens():
    # token 2 (r=0.5) masked: seq 0 mean = (-1.0 - 1.2) / 2 = -1.1; (-1.1 + 1.9) / 2 = 0.4
    out = compute_loss(make_inputs(mask=[1, 1, 0, 1, 1]), NORM, LossConfig(type="grpo"))
    assert out.loss.item() == pytest.approx(0.4, abs=1e-12)
    # bnpo with the step's 4 unmasked tokens: (-2.2 + 3.8) / 4 = 0.4
    norm4 = replace(NORM, tokens=4)
    out = compute_loss(make_inputs(mask=[1, 1, 0, 1, 1]), norm4, LossConfig(type="bnpo"))
    assert out.loss.item() == pytest.approx(0.4, abs=1e-12)


def test_delta_two_sided_clip():
    # r = [1.5, 2.0], A = -1, eps 0.2, delta 1.8:
    #   unclipped*A = [-1.5, -min(2.0, 1.8)] = [-1.5, -1.8]; clipped*A = [-1.2, -1.2]
    #   -min -> [1.5, 1.8], bnpo over 2 tokens: 1.65 (without delta: (1.5 + 2.0) / 2 = 1.75)
    def run(delta):
        logp = torch.tensor([-1.0, -1.0], dtype=F64, requires_grad=True)
        inputs = LossInputs(
            logprobs=logp,
            old_logprobs=logp.detach() - torch.tensor([LN(1.5), LN(2.0)], dtype=F64),
            advantages=torch.tensor([-1.0, -1.0], dtype=F64),
            mask=torch.ones(2),
            token_seq=torch.tensor([0, 0]),
            num_sequences=1,
        )
        loss = compute_loss(inputs, LossNormalisers(1, 2, 2), LossConfig(type="bnpo", delta=delta)).loss
        loss.backward()
        return loss.item(), logp.grad.tolist()

    loss, grad = run(1.8)
    assert loss == pytest.approx(1.65, abs=1e-12)
    assert grad == pytest.approx([1.5 / 2, 0.0], abs=1e-12)  # dl/dlogp = r / 2; capped: 0
    loss, grad = run(None)
    assert loss == pytest.approx(1.75, abs=1e-12)
    assert grad == pytest.approx([1.5 / 2, 2.0 / 2], abs=1e-12)


def test_kl_k3_value():
    # ref - logp = [0, ln2, -ln2, 0, 0]: k3 = e^d - d - 1 = [0, 2-ln2-1, 0.5+ln2-1, 0, 0]
    #   = [0, 0.3068528194400546, 0.1931471805599454, 0, 0], sum 0.5
    # grpo, beta 0.1: seq 0 = (-2.7 + 0.1*0.5) / 3 = -0.88333; (-0.88333 + 1.9) / 2 = 0.508333
    d = [0.0, LN(2), -LN(2), 0.0, 0.0]
    out = compute_loss(make_inputs(ref_minus_logp=d), NORM, LossConfig(type="grpo", beta=0.1))
    assert out.loss.item() == pytest.approx((-2.65 / 3 + 1.9) / 2, abs=1e-12)
    assert out.metrics["kl"].item() == pytest.approx(0.5, abs=1e-12)
    out0 = compute_loss(make_inputs(ref_minus_logp=d), NORM, LossConfig(type="grpo", beta=0.0))
    assert out0.loss.item() == pytest.approx(0.5, abs=1e-12)  # kl reported, not added
    assert out0.metrics["kl"].item() == pytest.approx(0.5, abs=1e-12)


def test_is_weights_multiply_policy_term_not_kl():
    # weights [1, 2, 0, 0.5, 1]: policy terms [-1.0, -2.4, 0, 1.1, 1.6], sum -0.7;
    # plus beta*kl = 0.1*0.5 unweighted: (-0.7 + 0.05) / 5 tokens = -0.13
    d = [0.0, LN(2), -LN(2), 0.0, 0.0]
    inputs = make_inputs(ref_minus_logp=d, is_weights=[1.0, 2.0, 0.0, 0.5, 1.0])
    out = compute_loss(inputs, NORM, LossConfig(type="bnpo", beta=0.1))
    assert out.loss.item() == pytest.approx(-0.13, abs=1e-12)
    assert out.metrics["is/weight_applied"].item() == pytest.approx(4.5)


def test_metrics_by_hand_and_reduce():
    # r = [1.0, 1.5, 0.5, 1.1, 0.7], A = [1, 1, 1, -2, -2], clip range [0.8, 1.2]
    # low (r<0.8, A<0): token 4; high (r>1.2, A>0): token 1; region: tokens 1, 2, 4
    m = compute_loss(make_inputs(), NORM, LossConfig(type="grpo")).metrics
    sums = {k: v.item() for k, v in m.items()}
    assert sums == pytest.approx(
        {
            "tokens": 5,
            "filtered_tokens": 0,
            "sequences": 2,
            "clip/low_frac": 1,
            "clip/high_frac": 1,
            "clip/region_frac": 3,
            "ratio/mean": 4.8,
        }  # fmt: skip
    )
    # two micro-batches' sums add up; reduce turns them into means
    doubled = {k: 2 * v for k, v in sums.items()}
    means = sums_to_means(doubled)
    assert means == pytest.approx(
        {
            "tokens": 10,
            "filtered_tokens": 0,
            "sequences": 4,
            "clip/low_frac": 0.2,
            "clip/high_frac": 0.2,
            "clip/region_frac": 0.6,
            "ratio/mean": 0.96,
        }  # fmt: skip
    )
    cispo = compute_loss(make_inputs(), NORM, LossConfig(type="cispo", epsilon_high=1.3)).metrics
    assert cispo["clip/high_frac"].item() == 1  # only r=1.5 exceeds the cap 1.3
    assert cispo["clip/low_frac"].item() == 0


def test_bf16_inputs_computed_in_float32():
    out = compute_loss(make_inputs(dtype=torch.bfloat16), NORM, LossConfig(type="bnpo"))
    assert out.loss.dtype == torch.float32
    assert out.loss.item() == pytest.approx(0.22, abs=2e-2)


# ------------------------------------------------------------ reference loop and autograd

LENS = [3, 1, 5, 2]


def random_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(LENS)
    logp = -2.0 * torch.rand(t, generator=g, dtype=F64)
    seq_adv = torch.randn(len(LENS), generator=g, dtype=F64)
    mask = torch.ones(t, dtype=F64)
    mask[[1, 6]] = 0.0
    return {
        "logp": logp,
        "old": logp + 0.5 * torch.randn(t, generator=g, dtype=F64),
        "ref": logp + 0.3 * torch.randn(t, generator=g, dtype=F64),
        "seq_adv": seq_adv,
        "adv": torch.repeat_interleave(seq_adv, torch.tensor(LENS)),
        "mask": mask,
        "token_seq": torch.repeat_interleave(torch.arange(len(LENS)), torch.tensor(LENS)),
        "w_token": 2.0 * torch.rand(t, generator=g, dtype=F64),
        "w_seq": torch.repeat_interleave(
            torch.tensor([0.5, 1.5, 1.0, 2.0], dtype=F64), torch.tensor(LENS)
        ),  # fmt: skip
    }


def reference_loss(kind, logp, case, cfg, norm):
    """Straightforward per-sequence loop; gspo as TRL's sequence level (grad via the mean)."""
    w = case["w_seq"] if kind == "gspo" else case["w_token"]
    total = logp.new_zeros(())
    start = 0
    for i, n in enumerate(LENS):
        keep = case["mask"][start : start + n].bool()
        lp, old = logp[start : start + n][keep], case["old"][start : start + n][keep]
        ref, wi = case["ref"][start : start + n][keep], w[start : start + n][keep]
        a = case["seq_adv"][i]
        start += n
        if kind == "gspo":
            r = torch.exp((lp - old).mean()).expand(lp.shape)
        else:
            r = torch.exp(lp - old)
        if kind == "cispo":
            per_tok = -torch.clamp(r, max=cfg.epsilon_high).detach() * a * lp
        else:
            unclipped = torch.clamp(r, max=cfg.delta)  # every clipped case sets delta
            clipped = torch.clamp(r, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
            per_tok = -torch.min(unclipped * a, clipped * a)
        per_tok = per_tok * wi + cfg.beta * (torch.exp(ref - lp) - (ref - lp) - 1)
        if kind in ("grpo", "gspo"):
            total = total + per_tok.mean() / norm.sequences
        elif kind == "bnpo":
            total = total + per_tok.sum() / norm.tokens
        elif kind == "dr_grpo":
            total = total + per_tok.sum() / (norm.sequences * norm.max_completion_length)
        else:
            total = total + per_tok.sum() / (norm.global_tokens / norm.world_size)
    return total


def case_cfg(kind):
    if kind == "cispo":
        return LossConfig(type=kind, epsilon_high=1.5, beta=0.07)
    return LossConfig(type=kind, epsilon_low=0.15, epsilon_high=0.25, delta=1.6, beta=0.07)


CASE_NORM = LossNormalisers(
    sequences=4, tokens=9, global_tokens=27, world_size=3, max_completion_length=6
)


def inputs_for(case, logp, kind, seqs):
    """LossInputs for the sequences `seqs` (consecutive) of the random case."""
    starts = [sum(LENS[:i]) for i in range(len(LENS))]
    lo, hi = starts[seqs[0]], starts[seqs[-1]] + LENS[seqs[-1]]
    w = case["w_seq"] if kind == "gspo" else case["w_token"]
    return LossInputs(
        logprobs=logp[lo:hi],
        old_logprobs=case["old"][lo:hi],
        advantages=case["adv"][lo:hi],
        mask=case["mask"][lo:hi],
        token_seq=case["token_seq"][lo:hi] - seqs[0],
        num_sequences=len(seqs),
        ref_logprobs=case["ref"][lo:hi],
        is_weights=w[lo:hi],
    )


@pytest.mark.parametrize("kind", sorted(VARIANTS))
def test_loss_and_grad_match_reference_loop(kind):
    case, cfg = random_case(), case_cfg(kind)
    logp = case["logp"].clone().requires_grad_(True)
    out = compute_loss(inputs_for(case, logp, kind, [0, 1, 2, 3]), CASE_NORM, cfg)
    out.loss.backward()
    logp_ref = case["logp"].clone().requires_grad_(True)
    expected = reference_loss(kind, logp_ref, case, cfg, CASE_NORM)
    expected.backward()
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(logp.grad, logp_ref.grad, rtol=1e-12, atol=1e-14)
    assert out.metrics["clip/region_frac"].item() > 0  # the case exercises clipping
    assert logp.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", sorted(VARIANTS))
def test_micro_batching_is_exact(kind):
    case, cfg = random_case(seed=1), case_cfg(kind)
    logp_full = case["logp"].clone().requires_grad_(True)
    full = compute_loss(inputs_for(case, logp_full, kind, [0, 1, 2, 3]), CASE_NORM, cfg).loss
    full.backward()
    logp = case["logp"].clone().requires_grad_(True)
    total = 0.0
    for seqs in ([0, 1], [2, 3]):
        loss = compute_loss(inputs_for(case, logp, kind, seqs), CASE_NORM, cfg).loss
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(full.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(logp.grad, logp_full.grad, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------ config and bad input


def test_the_config_section_configures_the_loss_and_refuses_bad_settings():
    """The loss reads the config's own `loss` section (one LossConfig); the rules the loss
    relies on are the section's validators, one sentence each."""
    cfg = LossConfig(type="dapo", epsilon_low=0.1, epsilon_high=0.3, delta=None, beta=0.0,
                     mask_truncated_completions=True, is_correction="bypass",
                     is_mode="sequence_mask", is_cap=3.0, is_min=0.1, scale_rewards="batch")  # fmt: skip
    assert (cfg.type, cfg.epsilon_high, cfg.is_mode, cfg.is_min) == (
        "dapo",
        0.3,
        "sequence_mask",
        0.1,
    )
    out = compute_loss(make_inputs(), NORM, cfg)
    # clip range [0.9, 1.3]: seq 0 -> [-1.0, -1.3, -0.5]; seq 1 -> [2.2, -min(-1.4, -1.8) = 1.8]
    # sum 1.2 over 22 / 2 tokens per rank
    assert out.loss.item() == pytest.approx(1.2 / 11, abs=1e-12)
    assert set(VARIANTS) == set(get_args(LossConfig.model_fields["type"].annotation))
    with pytest.raises(ValidationError, match="'grpo', 'bnpo', 'dr_grpo', 'dapo', 'gspo'"):
        LossConfig(type="ppo")
    with pytest.raises(ValidationError, match="typically 5.0"):
        LossConfig(type="cispo")  # epsilon_high 0.2 is no cap for cispo
    with pytest.raises(ValidationError, match="must exceed 1 \\+ loss.epsilon_high"):
        LossConfig(type="bnpo", delta=1.1)
    with pytest.raises(ValidationError, match="must be below loss.is_cap"):
        LossConfig(is_min=2.0, is_cap=2.0)
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_loss(make_inputs(), NORM, LossConfig(beta=0.1))
    bad = replace(make_inputs(), mask=torch.ones(4))
    with pytest.raises(ValueError, match="mask has shape"):
        compute_loss(bad, NORM, LossConfig())


def test_build_mask():
    token_seq = torch.tensor([0, 0, 1, 1, 1])
    truncated = torch.tensor([False, True])
    assert build_mask(token_seq, truncated, True).tolist() == [1, 1, 0, 0, 0]
    assert build_mask(token_seq, truncated, False).tolist() == [1, 1, 1, 1, 1]


# ------------------------------------------------------------ importance weights


def weights(log_ratio, token_seq, mode, cap, min_weight=0.0, mask=None):
    lr = torch.tensor(log_ratio, dtype=torch.float32)
    beh = torch.full_like(lr, -1.0)
    mask = torch.ones_like(lr) if mask is None else torch.tensor(mask, dtype=torch.float32)
    seq = torch.tensor(token_seq)
    return importance_weights(beh + lr, beh, seq, int(seq.max()) + 1, mask, mode, cap, min_weight)


def test_token_truncate():
    # exp(lr) = [0.5, 1.5, 3.0] -> min(., 2) = [0.5, 1.5, 2.0]
    w, m = weights([LN(0.5), LN(1.5), LN(3.0)], [0, 0, 1], "token_truncate", 2.0)
    assert w.tolist() == pytest.approx([0.5, 1.5, 2.0], rel=1e-6)
    assert m["is/weight_mean"].item() == pytest.approx(4.0 / 3, rel=1e-6)
    assert m["is/weight_min"].item() == pytest.approx(0.5, rel=1e-6)
    assert m["is/weight_max"].item() == pytest.approx(2.0, rel=1e-6)
    assert m["is/truncated_frac"].item() == pytest.approx(1 / 3)
    assert m["is/masked_frac"].item() == 0.0


def test_token_mask_gives_exact_zeros():
    # exp(lr) = [0.5, 1.5, 3.0], kept inside [0.6, 2]: [0, 1.5, 0]
    w, m = weights([LN(0.5), LN(1.5), LN(3.0)], [0, 0, 1], "token_mask", 2.0, 0.6)
    assert w[0].item() == 0.0 and w[2].item() == 0.0
    assert w[1].item() == pytest.approx(1.5, rel=1e-6)
    assert m["is/masked_frac"].item() == pytest.approx(2 / 3)
    assert m["is/weight_min"].item() == 0.0


def test_sequence_truncate_and_mask():
    # seq 0: lr = [ln2, ln8], mean ln4 -> 4 -> capped at 2; seq 1: [ln0.5, ln2], mean 0 -> 1
    lr, seq = [LN(2), LN(8), LN(0.5), LN(2)], [0, 0, 1, 1]
    w, _ = weights(lr, seq, "sequence_truncate", 2.0)
    assert w.tolist() == pytest.approx([2.0, 2.0, 1.0, 1.0], rel=1e-6)
    w, m = weights(lr, seq, "sequence_mask", 2.0)
    assert w[:2].tolist() == [0.0, 0.0]  # exactly zero, not 1/cap or cap
    assert w[2:].tolist() == pytest.approx([1.0, 1.0], rel=1e-6)
    assert m["is/masked_frac"].item() == pytest.approx(0.5)


def test_sequence_mean_ignores_masked_tokens():
    # the masked ln8 token is left out: exp(ln2) = 2 (cap 3), broadcast to both tokens
    w, _ = weights([LN(2), LN(8)], [0, 0], "sequence_truncate", 3.0, mask=[1, 0])
    assert w.tolist() == pytest.approx([2.0, 2.0], rel=1e-6)


@pytest.mark.parametrize("mode", ["sequence_truncate", "sequence_mask"])
def test_sequence_weight_is_length_independent(mode):
    # ten tokens and one token, each with lr 0.3: both exp(0.3) = 1.3498588075760032
    # (a sum would give exp(3.0) = 20.1 for the long one, capped or masked)
    w, _ = weights([0.3] * 11, [0] * 10 + [1], mode, 2.0)
    assert w.tolist() == pytest.approx([1.3498588075760032] * 11, rel=1e-6)


def test_mismatch_kl_and_detached():
    # k3 with r = exp(old - behaviour) = [2, 1]: [2 - ln2 - 1, 0], mean 0.1534264097200273
    old = torch.tensor([LN(2.0) - 1.0, -1.0], requires_grad=True)
    beh = torch.tensor([-1.0, -1.0])
    w, m = importance_weights(old, beh, torch.tensor([0, 1]), 2, torch.ones(2),
                              "token_truncate", 2.0)  # fmt: skip
    assert not w.requires_grad
    assert m["is/mismatch_kl"].item() == pytest.approx(0.1534264097200273, rel=1e-5)


def test_importance_weights_bad_input():
    with pytest.raises(ValueError, match="importance sampling mode"):
        weights([0.0], [0], "sequence_clip", 2.0)
    with pytest.raises(ValueError, match="min_weight < cap"):
        weights([0.0], [0], "token_mask", 2.0, 3.0)


# ------------------------------------------------------------ filtered targets (top-k / min-p)


def filtered_case():
    """Six tokens through the chunked lm_head with top_k=5; token 0's target is ranked 6th
    by the trainer (the engine ranked it 5th: a 1e-3 kernel difference at the boundary)."""
    from leangrpo.ops.logprobs.api import chunked_logprobs

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 16, generator=g, dtype=F64) * 0.1
    hidden = torch.randn(6, 16, generator=g, dtype=F64, requires_grad=True)
    z = hidden.detach() @ weight.T
    targets = z.argmax(1)
    targets[0] = z[0].topk(6).indices[-1]
    lp, _ = chunked_logprobs(hidden, weight, targets, top_k=5, row_tile=4, vocab_tile=16)
    assert torch.isneginf(lp[0]) and torch.isfinite(lp[1:]).all()
    return hidden, lp


def filtered_inputs(lp, mode: str, mask=None) -> LossInputs:
    """The repro's cases: old = current (decoupled/none at mu=1), old = behaviour (bypass),
    a reference that excludes token 1, and token 0 inside a masked (truncated) sequence."""
    seq = torch.tensor([0, 0, 0, 1, 1, 1])
    old = lp.detach().clone()
    ref = None
    if mode == "bypass":
        old[0] = -2.0  # the engine's finite log-prob
    if mode == "reference":
        ref = lp.detach() - 0.1
        ref[1] = float("-inf")
    mask = torch.ones(6) if mask is None else torch.tensor(mask, dtype=torch.float32)
    adv = torch.tensor([1.0, 1.0, 1.0, -0.5, -0.5, -0.5], dtype=F64)
    return LossInputs(lp, old, adv, mask, seq, 2, ref_logprobs=ref)


@pytest.mark.parametrize("kind", sorted(VARIANTS))
@pytest.mark.parametrize("mode", ["current", "bypass", "reference", "masked"])
def test_filtered_targets_leave_loss_and_gradient_finite(kind, mode):
    hidden, lp = filtered_case()
    mask = [0, 0, 0, 1, 1, 1] if mode == "masked" else None
    beta = 0.04 if mode == "reference" else 0.0
    cfg = LossConfig(type=kind, beta=beta, epsilon_high=1.3 if kind == "cispo" else 0.2)
    norm = LossNormalisers(sequences=2, tokens=6, global_tokens=6, max_completion_length=3)
    out = compute_loss(filtered_inputs(lp, mode, mask), norm, cfg)
    assert torch.isfinite(out.loss)
    (grad,) = torch.autograd.grad(out.loss, hidden)
    assert torch.isfinite(grad).all()
    dropped = {"current": [0], "bypass": [0], "reference": [0, 1], "masked": [0, 1, 2]}[mode]
    assert (grad[dropped] == 0).all()  # the chunked backward gets exactly 0 for them
    # equal to the loss with the dropped tokens masked out and given harmless values
    clean_lp = lp.detach().clone().requires_grad_()
    clean = filtered_inputs(clean_lp, mode, mask)
    keep = torch.ones(6)
    keep[dropped] = 0.0
    for name in ("old_logprobs", "ref_logprobs"):
        t = getattr(clean, name)
        if t is not None:
            t[dropped] = -1.0
    with torch.no_grad():
        clean_lp[dropped] = -1.0
    want = compute_loss(replace(clean, mask=keep), norm, cfg)
    assert out.loss.item() == pytest.approx(want.loss.item(), rel=1e-12, abs=1e-12)
    expected_count = {"current": 1, "bypass": 1, "reference": 2, "masked": 0}[mode]
    assert out.metrics["filtered_tokens"].item() == expected_count
    assert out.metrics["tokens"].item() == 6 - len(dropped)
    assert all(torch.isfinite(v) for v in out.metrics.values())


def test_is_weights_skip_filtered_and_masked_tokens():
    # token 1: old -inf (filtered by the trainer's old pass); token 2: masked and -inf
    old = torch.tensor([LN(2.0) - 1.0, float("-inf"), float("-inf"), -1.0])
    beh = torch.full((4,), -1.0)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    seq = torch.tensor([0, 0, 0, 1])
    for mode in IS_MODES_ALL:
        w, m = importance_weights(old, beh, seq, 2, mask, mode, 3.0)
        assert torch.isfinite(w).all(), mode
        assert all(torch.isfinite(v) for v in m.values()), mode
        assert m["is/tokens"].item() == 2
    w, m = importance_weights(old, beh, seq, 2, mask, "token_truncate", 3.0)
    assert w[[0, 3]].tolist() == pytest.approx([2.0, 1.0])
    assert m["is/weight_mean"].item() == pytest.approx(1.5)
    assert m["is/weight_min"].item() == pytest.approx(1.0)
    # k3 of r = [2, 1] over the two kept tokens: (2 - ln2 - 1) / 2
    assert m["is/mismatch_kl"].item() == pytest.approx((1 - LN(2)) / 2, rel=1e-6)
    w, _ = importance_weights(old, beh, seq, 2, mask, "sequence_truncate", 3.0)
    assert w[0].item() == pytest.approx(2.0, rel=1e-6)  # sequence 0: only token 0 counts


IS_MODES_ALL = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
