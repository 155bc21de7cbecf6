"""`distill.objective: jsd` (issue 39): the tiled generalised JSD against a naive
float64 reference (both models' full logits) in values and gradients, every beta regime,
per dtype with its tolerance; against TRL 1.16's own kernel where TRL is installed (the
`bench` extra); the whole loss (policy-gradient term + weight x the divergence's token
mean) against a reference written out per sequence, single- and multi-turn; the step
under context parallelism (C = 2, threads) against one process."""

from __future__ import annotations

import copy

import pytest
import torch
from support.configs import DEMO_MODEL
from support.context import cp_config, cp_samples, one_step, simulated_step
from support.models import make_tiny_model
from support.steps import step_config

from leangrpo.contracts import Completion, Prompt, RolloutSample, Trajectory
from leangrpo.model.policy import build_policy
from leangrpo.model.scoring import score_distill, teacher_rows
from leangrpo.ops.attention.adapter import enable_packed_attention
from leangrpo.ops.logprobs.divergence import chunked_divergence, naive_divergence
from leangrpo.train.inputs import loss_inputs, normalisers
from leangrpo.train.loss import compute_loss
from leangrpo.train.packing import pack_samples

F64 = torch.float64
TEMPERATURE = 0.7
BETAS = [0.0, 0.3, 1.0]


def operands(dtype, n=13, hs=6, ht=10, vocab=37, seed=0):
    """Student (hidden, weight, bias) requiring grad, a wider teacher with 3 padding rows."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, dtype=F64)).to(dtype)

    student = [r(n, hs), r(vocab, hs), r(vocab, scale=0.5)]
    for t in student:
        t.requires_grad_(True)
    teacher = [r(n, ht), r(vocab + 3, ht), r(vocab + 3, scale=0.5)]
    targets = torch.randint(0, vocab, (n,), generator=g)
    return student, teacher, targets


def values_and_grads(fn, student, teacher, targets, beta, **kw):
    hs, ws, bs = student
    ht, wt, bt = teacher
    outs = fn(hs, ws, ht, wt, targets, bs, bt, beta=beta, temperature=TEMPERATURE, **kw)
    g = torch.Generator().manual_seed(9)
    upstream = [torch.randn(o.shape, generator=g, dtype=F64).to(o.dtype) for o in outs]
    total = sum((o * u).sum() for o, u in zip(outs, upstream))
    return [o.detach() for o in outs], list(torch.autograd.grad(total, student))


@pytest.mark.parametrize("beta", BETAS)
def test_divergence_equals_the_float64_reference(beta):
    """Values (divergence, log-probs, entropy) and every student gradient, float64: row
    and vocabulary tiles that divide neither N nor V, a bias, a temperature."""
    student, teacher, targets = operands(F64)
    got, got_grads = values_and_grads(chunked_divergence, student, teacher, targets, beta,
                                      row_tile=4, vocab_tile=8)  # fmt: skip
    want, want_grads = values_and_grads(naive_divergence, student, teacher, targets, beta)
    for a, b in zip(got + got_grads, want + want_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert (want[0] > 0).all()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_divergence_in_low_precision_is_within_the_dtypes_tolerance(dtype, tol, beta):
    """fp32 / bf16 inputs (fp32 accumulation) against the float64 reference of the same
    (rounded) inputs."""
    student, teacher, targets = operands(dtype)
    got, got_grads = values_and_grads(chunked_divergence, student, teacher, targets, beta,
                                      row_tile=5, vocab_tile=16)  # fmt: skip
    exact = [[t.detach().to(F64).requires_grad_(t.requires_grad) for t in part]
             for part in (student, teacher)]  # fmt: skip
    want, want_grads = values_and_grads(naive_divergence, *exact, targets, beta)
    for a, b in zip(got + got_grads, want + want_grads):
        scale = float(b.abs().max())
        torch.testing.assert_close(a.to(F64), b, rtol=tol, atol=tol * scale)


def test_a_teacher_that_requires_grad_is_refused():
    student, teacher, targets = operands(F64)
    teacher[0].requires_grad_(True)
    with pytest.raises(ValueError, match="teacher is frozen"):
        chunked_divergence(*student[:2], *teacher[:2], targets, beta=0.5)


@pytest.mark.parametrize("beta", BETAS)
def test_divergence_matches_trl_distillation_kernel(beta):
    """TRL 1.16's ChunkedDivergenceFunction (its torch path on CPU): the same divergence
    and the same student gradients, temperature included."""
    kernel = pytest.importorskip("trl.kernels.chunked_divergence")
    student, teacher, targets = operands(torch.float32)
    vocab = student[1].shape[0]
    teacher = [teacher[0], teacher[1][:vocab], teacher[2][:vocab]]
    got, got_grads = values_and_grads(chunked_divergence, student, teacher, targets, beta)
    hs, ws, bs = student
    ht, wt, bt = teacher
    div, _ = kernel.ChunkedDivergenceFunction.apply(hs, ws, bs, ht, wt, bt, beta, TEMPERATURE)
    g = torch.Generator().manual_seed(9)
    upstream = torch.randn(div.shape, generator=g, dtype=F64).float()
    trl_grads = torch.autograd.grad((div * upstream).sum(), student)
    ours = torch.autograd.grad((chunked_divergence(hs, ws, ht, wt, targets, bs, bt, beta=beta,
                                temperature=TEMPERATURE)[0] * upstream).sum(), student)  # fmt: skip
    torch.testing.assert_close(got[0], div, rtol=1e-5, atol=1e-6)
    for a, b in zip(ours, trl_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------ the loss on a model

# (prompt length, completion segments); True = a model turn, False = the environment's
SHAPES = [(4, [(5, True)]), (3, [(1, True)]), (5, [(3, True), (2, False), (4, True)])]
SEQ_ADV = [0.8, -0.8, 0.3]


def tiny_pair():
    """A float64 student and a wider, deeper teacher of the same 64-token vocabulary."""
    student = make_tiny_model("qwen2", seed=0, dtype=F64)
    teacher = make_tiny_model("qwen2", seed=1, dtype=F64, hidden_size=48, num_layers=3)
    for m in (student, teacher):
        enable_packed_attention(m, "sdpa_segments")
    return student, teacher.requires_grad_(False)


def make_samples() -> list[RolloutSample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, (plen, segments) in enumerate(SHAPES):
        prompt = Prompt(i, "", torch.randint(2, 64, (plen,), generator=g).tolist())
        ids = torch.randint(2, 64, (sum(n for n, _ in segments),), generator=g).tolist()
        model_tokens = sum(n for n, m in segments if m)
        trajectory = None
        if len(segments) > 1:
            trajectory = Trajectory(segments, [0] * sum(m for _, m in segments), [])
        behaviour = [-1.0] * model_tokens
        completion = Completion(ids, "", behaviour, "stop", 0, trajectory)
        out.append(RolloutSample(i, prompt, completion, advantage=SEQ_ADV[i]))
    return out


def model_positions(sample: RolloutSample) -> list[int]:
    t = sample.completion.trajectory
    if t is None:
        return list(range(len(sample.completion.ids)))
    out, pos = [], 0
    for n, is_model in t.segments:
        out += list(range(pos, pos + n)) if is_model else []
        pos += n
    return out


def naive_terms(student, teacher, sample, beta):
    """(log-probs, divergences) of the sample's model tokens from both models' full logits."""
    ids = torch.tensor([sample.prompt.ids + sample.completion.ids])
    zs = student(input_ids=ids, use_cache=False).logits[0] / TEMPERATURE
    with torch.no_grad():
        zt = teacher(input_ids=ids, use_cache=False).logits[0] / TEMPERATURE
    rows = len(sample.prompt.ids) - 1 + torch.tensor(model_positions(sample))
    targets = torch.tensor(sample.completion.ids)[torch.tensor(model_positions(sample))]
    log_ps, log_pt = zs[rows].log_softmax(-1), zt[rows].log_softmax(-1)
    ps, pt = log_ps.exp(), log_pt.exp()
    if beta == 0.0:
        div = (pt * (log_pt - log_ps)).sum(-1)
    elif beta == 1.0:
        div = (ps * (log_ps - log_pt)).sum(-1)
    else:
        log_m = ((1 - beta) * ps + beta * pt).log()
        div = beta * (pt * (log_pt - log_m)).sum(-1) + (1 - beta) * (ps * (log_ps - log_m)).sum(-1)
    return log_ps.gather(1, targets[:, None])[:, 0], div


@pytest.mark.parametrize("kind", ["grpo", "dapo"])
@pytest.mark.parametrize("beta", BETAS)
def test_loss_and_gradient_equal_the_naive_reference(kind, beta):
    """loss = the policy-gradient loss of the reward advantages (on-policy: ratio 1) +
    weight x sum over every model token of D / tokens; multi-turn: model tokens only."""
    weight = 0.6
    cfg = step_config(
        loss={"type": kind, "is_correction": "none"},
        rollout={"temperature": TEMPERATURE},
        distill={"teacher": "unused", "objective": "jsd", "jsd_beta": beta, "weight": weight},
    )
    student, teacher = tiny_pair()
    samples = make_samples()
    terms = [naive_terms(student, teacher, s, beta) for s in samples]
    tokens = sum(len(lp) for lp, _ in terms)
    pg = torch.zeros((), dtype=F64)
    for (lp, _), s in zip(terms, samples):
        per_token = -torch.exp(lp - lp.detach()) * s.advantage
        pg = pg + (per_token.mean() / len(samples) if kind == "grpo" else per_token.sum() / tokens)
    expected = pg + weight * sum(d.sum() for _, d in terms) / tokens
    expected.backward()
    want = {n: p.grad.clone() for n, p in student.named_parameters()}
    student.zero_grad()

    mb = pack_samples(samples)
    sampling = cfg.rollout.sampling_params()
    rows = teacher_rows(teacher, mb, beta)
    assert not rows.hidden.requires_grad and rows.hidden.shape == (tokens, 48)
    logp, entropy, div = score_distill(student, mb, sampling, cfg.logprobs, rows)
    torch.testing.assert_close(div.to(F64), torch.cat([d for _, d in terms]).detach(),
                               rtol=1e-6, atol=1e-9)  # fmt: skip
    inputs, _ = loss_inputs(mb, logp, entropy, cfg.loss, cfg.distill, div)
    torch.testing.assert_close(inputs.advantages, mb.advantages[mb.token_seq])  # no sampled term
    out = compute_loss(inputs, pack_norm(mb, cfg), cfg.loss)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-9)
    for name, p in student.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-7)
    jsd_sum = sum(d.sum() for _, d in terms).item()
    assert out.metrics["distill/jsd"].item() == pytest.approx(jsd_sum, rel=1e-5)


def test_the_full_logits_switch_gives_the_same_divergence(monkeypatch):
    """logprobs.chunked: false takes the full-logits reference for the divergence too
    (and only then), with the same values and gradients."""
    import leangrpo.model.scoring as scoring

    calls = []
    reference = scoring.naive_divergence
    monkeypatch.setattr(scoring, "naive_divergence",
                        lambda *a, **k: calls.append(1) or reference(*a, **k))  # fmt: skip
    student, teacher = tiny_pair()
    mb = pack_samples(make_samples())
    rows = teacher_rows(teacher, mb, 0.3)
    got = {}
    for chunked in (True, False):
        cfg = step_config(rollout={"temperature": TEMPERATURE}, logprobs={"chunked": chunked},
                          distill={"teacher": "unused", "objective": "jsd", "jsd_beta": 0.3})  # fmt: skip
        outs = score_distill(student, mb, cfg.rollout.sampling_params(), cfg.logprobs, rows)
        grads = torch.autograd.grad(sum(o.sum() for o in outs), list(student.parameters()))
        got[chunked] = [o.detach() for o in outs] + list(grads)
        assert len(calls) == (0 if chunked else 1)
    for a, b in zip(got[True], got[False]):
        torch.testing.assert_close(a.to(F64), b.to(F64), rtol=1e-9, atol=1e-11)


def pack_norm(mb, cfg):
    return normalisers([mb], cfg.loss, cfg.model_token_budget())


def test_the_divergence_pulls_the_student_towards_the_teacher():
    """A few SGD steps on the jsd term alone lower it (the sign is the descent's)."""
    cfg = step_config(rollout={"temperature": 1.0},
                      distill={"teacher": "unused", "objective": "jsd", "jsd_beta": 0.5})  # fmt: skip
    student, teacher = tiny_pair()
    samples = make_samples()
    for s in samples:
        s.advantage = 0.0
    mb = pack_samples(samples)
    rows = teacher_rows(teacher, mb, 0.5)
    sampling = cfg.rollout.sampling_params()
    opt = torch.optim.SGD(student.parameters(), lr=0.5)
    seen = []
    for _ in range(4):
        logp, entropy, div = score_distill(student, mb, sampling, cfg.logprobs, rows)
        inputs, _ = loss_inputs(mb, logp, entropy, cfg.loss, cfg.distill, div)
        loss = compute_loss(inputs, pack_norm(mb, cfg), cfg.loss).loss
        seen.append(div.mean().item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert seen[-1] < 0.9 * seen[0], seen


# ------------------------------------------------------------- context parallelism


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_context_parallel_step_equals_one_process(tmp_path, lora):
    """One optimizer step of the jsd objective (reward advantages too), C = 2 threads on
    the demo model with a noised teacher split like the student, against one process:
    loss metrics (distill/jsd included) and every gradient; full fine-tuning (the head
    trained) and LoRA (the head frozen: no weight gradient from the divergence).
    Multi-turn rows whose sequences straddle the shard boundary."""
    from support.models import save_demo_teacher
    from transformers import AutoModelForCausalLM

    teacher_dir = save_demo_teacher(tmp_path / "teacher")
    sections = {"loss": {"type": "grpo", "beta": 0.0},
                "distill": {"teacher": str(teacher_dir), "objective": "jsd", "jsd_beta": 0.5,
                            "weight": 0.5}}  # fmt: skip
    if lora:
        sections["lora"] = {"enabled": True, "r": 4, "alpha": 8}
    base = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)

    def policy(cfg):
        torch.manual_seed(0)
        out = build_policy(copy.deepcopy(base), cfg, None, torch.device("cpu"))
        g = torch.Generator().manual_seed(1)
        for name, p in sorted(out.model.named_parameters()):
            if "lora_B" in name:  # adapters away from 0, so their gradients flow
                p.data.normal_(0, 0.05, generator=g)
        out.teacher = copy.deepcopy(teacher).eval().requires_grad_(False)
        enable_packed_attention(out.teacher, out.attention_backend)
        return out

    samples = cp_samples(multiturn=True)
    cfg1 = cp_config(DEMO_MODEL, 1, **sections)
    want = one_step(policy(cfg1), samples, cfg1)
    assert want["metrics"]["loss/distill/jsd"] > 0 and want["grads"]
    cfg2 = cp_config(DEMO_MODEL, 2, **sections)
    for got in simulated_step(policy(cfg2), samples, cfg2, 2):
        for name, grad in want["grads"].items():
            scale = float(grad.abs().max())
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6 + 1e-4 * scale)
        for name, value in want["metrics"].items():
            if name.startswith(("loss", "grad_norm")):
                assert got["metrics"][name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
