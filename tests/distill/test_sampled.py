"""`distill.objective: sampled` against a naive reference (issue 39): full logits of both
models, one sequence at a time, float64, the advantage summed token by token and the
loss written out per type. The packed path (chunked lm_head, teacher log-probs attached
by the no-grad pass, `loss_inputs`, `compute_loss`) must give the same loss and the same
gradient for every loss type, single-turn and multi-turn (model tokens only), with and
without a discount, in the plain and the shared-prefix layouts."""

from __future__ import annotations

import pytest
import torch
from support.models import make_tiny_model
from support.steps import step_config

from leangrpo.contracts import Completion, Prompt, RolloutSample, Trajectory
from leangrpo.distill.advantages import discounted_sums
from leangrpo.distill.teacher import teacher_logprobs
from leangrpo.model.scoring import score
from leangrpo.ops.attention.adapter import enable_packed_attention
from leangrpo.train.inputs import loss_inputs, normalisers
from leangrpo.train.loss import VARIANTS, compute_loss
from leangrpo.train.packing import pack_samples

F64 = torch.float64
TEMPERATURE = 0.7
# (prompt length, completion segments); True = a model turn, False = the environment's
SHAPES = [
    (4, [(5, True)]),
    (3, [(1, True)]),
    (5, [(3, True), (2, False), (4, True)]),  # multi-turn: a tool reply in between
    (4, [(6, True)]),
]
SEQ_ADV = [0.8, -0.8, 0.3, -0.3]


def tiny_pair():
    """A float64 student and a bigger teacher of the same 64-token vocabulary."""
    student = make_tiny_model("qwen2", seed=0, dtype=F64)
    teacher = make_tiny_model("qwen2", seed=1, dtype=F64, hidden_size=48, num_layers=3)
    for m in (student, teacher):
        enable_packed_attention(m, "sdpa_segments")
    return student, teacher.requires_grad_(False)


def make_samples(seed: int = 0, shared_prompts: bool = False) -> list[RolloutSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    prompt = None
    for i, (plen, segments) in enumerate(SHAPES):
        if prompt is None or not shared_prompts or i % 2 == 0:
            prompt = Prompt(i // 2, "", torch.randint(2, 64, (plen,), generator=g).tolist())
        ids = torch.randint(2, 64, (sum(n for n, _ in segments),), generator=g).tolist()
        model_tokens = sum(n for n, m in segments if m)
        trajectory = None
        if len(segments) > 1:
            trajectory = Trajectory(segments, [0] * sum(m for _, m in segments), [])
        behaviour = (-torch.rand(model_tokens, generator=g) * 3).tolist()
        completion = Completion(ids, "", behaviour, "stop", 0, trajectory)
        out.append(RolloutSample(i // 2, prompt, completion, advantage=SEQ_ADV[i]))
    return out


def model_positions(sample: RolloutSample) -> list[int]:
    """Completion offsets of the model's tokens, spelt out from SHAPES-like segments."""
    t = sample.completion.trajectory
    if t is None:
        return list(range(len(sample.completion.ids)))
    out, pos = [], 0
    for n, is_model in t.segments:
        out += list(range(pos, pos + n)) if is_model else []
        pos += n
    return out


def naive_logprobs(model, sample: RolloutSample) -> torch.Tensor:
    """(model tokens,) log-probs from the full logits of one plain forward, float64."""
    ids = sample.prompt.ids + sample.completion.ids
    logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].to(F64)
    logp = torch.log_softmax(logits / TEMPERATURE, -1)
    p = len(sample.prompt.ids)
    pos = torch.tensor(model_positions(sample))
    targets = torch.tensor(sample.completion.ids)[pos]
    return logp[p - 1 + pos].gather(1, targets[:, None])[:, 0]


def naive_advantages(student_old, teacher_lp, seq_adv, weight, discount) -> torch.Tensor:
    """A_t = A_seq + weight * sum_{k >= t} discount^(k - t) (teacher_k - student_k)."""
    r = (teacher_lp - student_old).tolist()
    d = [sum(discount ** (k - t) * r[k] for k in range(t, len(r))) for t in range(len(r))]
    return seq_adv + weight * torch.tensor(d, dtype=F64)


def naive_loss(kind, cfg, logps, olds, advs, max_len) -> torch.Tensor:
    """The loss of `kind` written out per sequence (no mask, no IS weights, beta 0)."""
    s_count = len(logps)
    tokens = sum(len(lp) for lp in logps)
    total = torch.zeros((), dtype=F64)
    for lp, old, a in zip(logps, olds, advs):
        if kind == "gspo":
            r = torch.exp((lp - old).mean()).detach() * torch.exp(lp - lp.detach())
        else:
            r = torch.exp(lp - old)
        if kind == "cispo":
            per_tok = -torch.clamp(r, max=cfg.epsilon_high).detach() * a * lp
        else:
            clipped = torch.clamp(r, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
            per_tok = -torch.min(r * a, clipped * a)
        if kind in ("grpo", "gspo"):
            total = total + per_tok.mean() / s_count
        elif kind == "bnpo" or kind in ("dapo", "cispo"):
            total = total + per_tok.sum() / tokens
        elif kind == "dr_grpo":
            total = total + per_tok.sum() / (s_count * max_len)
    return total


def run_config(kind: str, discount: float, weight: float = 0.6):
    loss = {"type": kind, "is_correction": "none", "epsilon_low": 0.1, "epsilon_high": 0.15}
    if kind == "cispo":
        loss["epsilon_high"] = 1.05
    return step_config(
        loss=loss,
        rollout={"temperature": TEMPERATURE},
        distill={"teacher": "unused", "weight": weight, "discount": discount},
    )


@pytest.mark.parametrize("discount", [0.0, 0.7])
@pytest.mark.parametrize("kind", sorted(VARIANTS))
def test_loss_and_gradient_equal_the_naive_reference(kind, discount):
    cfg = run_config(kind, discount)
    student, teacher = tiny_pair()
    samples = make_samples()
    g = torch.Generator().manual_seed(5)
    noise = [0.4 * torch.randn(len(model_positions(s)), generator=g, dtype=F64) for s in samples]

    # the naive reference: full logits, one sequence at a time
    with torch.no_grad():
        olds = [naive_logprobs(student, s) + n for s, n in zip(samples, noise)]
        teachers = [naive_logprobs(teacher, s) for s in samples]
    logps = [naive_logprobs(student, s) for s in samples]
    advs = [
        naive_advantages(old, t, s.advantage, cfg.distill.weight, discount)
        for old, t, s in zip(olds, teachers, samples)
    ]
    expected = naive_loss(kind, cfg.loss, logps, olds, advs, cfg.model_token_budget())
    expected.backward()
    want = {n: p.grad.clone() for n, p in student.named_parameters()}
    student.zero_grad()

    # the packed path
    mb = pack_samples(samples)
    sampling = cfg.rollout.sampling_params()
    mb.teacher_logprobs = teacher_logprobs(teacher, mb, sampling, cfg.logprobs)
    torch.testing.assert_close(
        mb.teacher_logprobs.to(F64), torch.cat(teachers), rtol=1e-5, atol=1e-5
    )
    logp, entropy = score(student, mb, sampling, cfg.logprobs)
    mb.old_logprobs = logp.detach() + torch.cat(noise).to(logp.dtype)
    inputs, _ = loss_inputs(mb, logp, entropy, cfg.loss, cfg.distill)
    torch.testing.assert_close(inputs.advantages.to(F64), torch.cat(advs), rtol=1e-5, atol=1e-5)
    norm = normalisers([mb], cfg.loss, cfg.model_token_budget())
    out = compute_loss(inputs, norm, cfg.loss)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-9)  # float32 loss
    for name, p in student.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-7)  # float32 loss
    assert out.metrics["clip/region_frac"].item() > 0  # the case exercises clipping
    kl = torch.cat([lp.detach() - t for lp, t in zip(logps, teachers)]).sum()
    assert out.metrics["distill/reverse_kl"].item() == pytest.approx(kl.item(), abs=1e-5)


def test_the_advantage_changes_sign_with_the_teacher():
    """A token the teacher likes more than the student gets a positive advantage: the
    policy gradient pushes its log-prob up (reverse KL goes down)."""
    cfg = run_config("grpo", 0.0, weight=1.0)
    student, teacher = tiny_pair()
    samples = make_samples()
    for s in samples:
        s.advantage = 0.0
    mb = pack_samples(samples)
    sampling = cfg.rollout.sampling_params()
    mb.teacher_logprobs = teacher_logprobs(teacher, mb, sampling, cfg.logprobs)
    logp, _ = score(student, mb, sampling, cfg.logprobs)
    inputs, _ = loss_inputs(mb, logp, None, cfg.loss, cfg.distill)
    diff = (mb.teacher_logprobs - logp.detach()).float()
    assert torch.equal(inputs.advantages > 0, diff > 0)
    torch.testing.assert_close(inputs.advantages, diff)


@pytest.mark.parametrize("shared", [False, True])
def test_packed_teacher_logprobs_equal_one_padded_sequence_at_a_time(shared):
    """The teacher's pass over the packed row (plain, or prompts shared by a group) equals
    one sequence at a time, padded to the batch's longest (left padding, attention mask)."""
    cfg = run_config("grpo", 0.0)
    _, teacher = tiny_pair()
    samples = make_samples(seed=3, shared_prompts=shared)
    mb = pack_samples(samples, shared_prefix=shared)
    got = teacher_logprobs(teacher, mb, cfg.rollout.sampling_params(), cfg.logprobs)
    rows = [s.prompt.ids + s.completion.ids for s in samples]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = teacher(input_ids=ids, attention_mask=attention, position_ids=positions).logits
    want = []
    for row, s in zip(range(len(rows)), samples):
        logp = torch.log_softmax(logits[row].to(F64) / TEMPERATURE, -1)
        start = width - len(rows[row]) + len(s.prompt.ids) - 1
        pos = torch.tensor(model_positions(s))
        targets = torch.tensor(s.completion.ids)[pos]
        want.append(logp[start + pos].gather(1, targets[:, None])[:, 0])
    torch.testing.assert_close(got.to(F64), torch.cat(want), rtol=1e-6, atol=1e-6)


def test_discounted_sums_stay_inside_each_sequence():
    g = torch.Generator().manual_seed(0)
    lens = [1, 7, 2, 16, 3]
    token_seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    rewards = torch.randn(sum(lens), generator=g, dtype=F64)
    for discount in (0.0, 0.5, 0.93, 1.0):
        got = discounted_sums(rewards, token_seq, discount)
        want, start = [], 0
        for n in lens:
            r = rewards[start : start + n].tolist()
            want += [sum(discount ** (k - t) * r[k] for k in range(t, n)) for t in range(n)]
            start += n
        torch.testing.assert_close(got, torch.tensor(want, dtype=F64), rtol=1e-12, atol=1e-12)
