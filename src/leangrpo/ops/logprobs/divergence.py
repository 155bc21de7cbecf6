"""The generalised Jensen-Shannon divergence between a student's and a teacher's
next-token distributions, from both models' hidden states and lm_heads, in tiles: neither
model's (N, V) logits exist, in forward or backward (on-policy distillation,
`distill.objective: jsd`).

Per row (a completion-predicting position), with z = lm_head(hidden) / temperature for
each model, p_s = softmax(z_s), p_t = softmax(z_t) and m = (1 - beta) p_s + beta p_t:

    D = beta * KL(p_t || m) + (1 - beta) * KL(p_s || m)     0 < beta < 1
    D = KL(p_t || p_s)   (forward KL)                        beta = 0
    D = KL(p_s || p_t)   (reverse KL)                        beta = 1

TRL 1.16's `DistillationTrainer` definition (its `ChunkedDivergenceFunction`), the same
temperature handling (both models' logits divided by it, no filter). The same pass also
returns the student's log-prob of each target token and its entropy (what the policy loss
and its metrics need), so distillation costs no extra sweep of the student's head.

Algorithm (row tiles outer, vocabulary tiles inner, fp32 accumulation; float64 inputs stay
float64): pass 1 keeps, per row, both models' online log-sum-exp (running max, sum of
exp(z - m)), the student's sum of exp(z_s - m) z_s (entropy), its target's logit, and for
beta 0 / 1 the weighted gap sum exp(z_t - m_t)(z_t - z_s) / exp(z_s - m_s)(z_s - z_t), which
gives the KL in the same pass; for 0 < beta < 1 pass 2 recomputes the tiles with both
log-normalisers known and sums the mixture terms (and KL(p_s || m), which the gradient
needs). Saved for backward: the inputs (by reference) and four (N,) vectors. The backward
recomputes each tile pair and forms d/dz_s of g_D * D + g_lp * log p_s(y) + g_H * H:

    dD/dz_s = p_s - p_t                                   beta = 0
            = p_s (log p_s - log p_t - D)                 beta = 1
            = (1 - beta) p_s (log p_s - log m - KL(p_s||m)) otherwise

plus g_lp (onehot - p_s) and g_H p_s (log Z_s - H - z_s), divided by the temperature;
the teacher gets no gradient (it is frozen: its inputs must not require one). Gradients of
the student's hidden states, lm_head weight and bias accumulate in fp32 (a (V, H) buffer
when the weight is trained). The matmuls run in each model's own dtype (autocast's when
it is on), like its lm_head.

Memory: each tile pair is consumed where it is made (its two tiles overwritten in place by
what comes next, the operations and their order unchanged, so the values are those of the
out-of-place formulas bit for bit), so at most three fp32 tiles are alive (beta 0 or 1)
or four (0 < beta < 1: the mixture's log m and one difference beside the pair), forward
and backward; `leangrpo plan` counts that (planner/inventory.py `divergence_head_bytes`,
checked against this kernel's allocations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from leangrpo.ops.logprobs.tiles import (
    _accumulate_mm,
    _matmul_dtype,
    _no_autocast,
    _target_slots,
    _tile_logits,
    _vocab_ranges,
)

__all__ = ["chunked_divergence", "naive_divergence"]

DEFAULT_TILES: dict[str, tuple[int, int]] = {"cpu": (4096, 2048), "cuda": (1024, 8192)}


@dataclass(frozen=True)
class _DivSpec:
    beta: float
    temperature: float
    row_tile: int
    vocab_tile: int
    student: torch.dtype  # the student's head matmul dtype
    teacher: torch.dtype  # the teacher's
    acc: torch.dtype  # accumulation: fp32, float64 for float64 students


def _check(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    targets: Tensor,
    beta: float,
    temperature: float,
) -> None:
    n = student_hidden.shape[0]
    if student_hidden.dim() != 2 or student_weight.dim() != 2 or teacher_hidden.dim() != 2:
        raise ValueError("divergence: hidden states must be (N, H) and lm_head weights (V, H)")
    if student_hidden.shape[1] != student_weight.shape[1]:
        raise ValueError(
            f"divergence: the student's hidden width {student_hidden.shape[1]} is not its "
            f"lm_head's {student_weight.shape[1]}"
        )
    if teacher_hidden.shape != (n, teacher_weight.shape[1]):
        raise ValueError(
            f"divergence: the teacher's hidden states must be ({n}, {teacher_weight.shape[1]})"
            f" (the student's rows, the teacher's width), got {tuple(teacher_hidden.shape)}"
        )
    if teacher_weight.shape[0] < student_weight.shape[0]:
        raise ValueError(
            f"divergence: the teacher's vocabulary ({teacher_weight.shape[0]} rows) does not "
            f"cover the student's ({student_weight.shape[0]})"
        )
    if targets.shape != (n,) or targets.is_floating_point():
        raise ValueError(f"divergence: targets must be ({n},) token ids")
    if teacher_hidden.requires_grad or teacher_weight.requires_grad:
        raise ValueError(
            "divergence: the teacher is frozen; pass its hidden states and weight detached"
        )
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"divergence: beta must be in [0, 1], got {beta}")
    if not (temperature > 0.0 and math.isfinite(temperature)):
        raise ValueError(f"divergence: temperature must be a finite number > 0, got {temperature}")


def _spec(student_hidden, student_weight, teacher_hidden, teacher_weight, beta, temperature,
          row_tile, vocab_tile) -> _DivSpec:  # fmt: skip
    rows, vocab = DEFAULT_TILES.get(student_hidden.device.type, DEFAULT_TILES["cuda"])
    row_tile, vocab_tile = row_tile or rows, vocab_tile or vocab
    if row_tile <= 0 or vocab_tile <= 0:
        raise ValueError(f"divergence: tiles must be > 0, got {row_tile} x {vocab_tile}")
    student = _matmul_dtype(student_hidden, student_weight)
    acc = torch.promote_types(student, torch.float32)
    teacher = _matmul_dtype(teacher_hidden, teacher_weight)
    return _DivSpec(float(beta), float(temperature), int(row_tile), int(vocab_tile), student,
                    teacher, acc)  # fmt: skip


class _Online:
    """One model's running log-sum-exp over the vocabulary tiles of a row tile."""

    def __init__(self, n: int, acc: torch.dtype, device: torch.device):
        self.m = torch.full((n,), -math.inf, dtype=acc, device=device)
        self.s = torch.zeros(n, dtype=acc, device=device)

    def add(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """Fold tile z in; returns (exp(z - new max), the old sums' rescale factor)."""
        m_new = torch.maximum(self.m, z.amax(dim=1))
        scale = torch.exp(self.m - m_new)
        e = (z - m_new[:, None]).exp_()  # one tile, not two
        self.s.mul_(scale).add_(e.sum(dim=1))
        self.m = m_new
        return e, scale

    def log_z(self) -> Tensor:
        return self.m + self.s.log()


def _tiles(h_s, ws, bs, h_t, wt, bt, spec: _DivSpec, v0: int, v1: int):
    z_s = _tile_logits(h_s, ws, bs, v0, v1, spec, spec.acc)
    z_t = _tile_logits(h_t, wt, bt, v0, v1, spec, spec.acc)
    return z_s, z_t


def _log_mixture(log_ps: Tensor, log_pt: Tensor, beta: float, *, consume: bool) -> Tensor:
    """log m: in log_pt's memory when `consume` (log p_t not needed after), else a new
    tile; one more tile alive while it is made."""
    weighted_t = log_pt.add_(math.log(beta)) if consume else log_pt + math.log(beta)
    return torch.logaddexp(log_ps + math.log(1.0 - beta), weighted_t, out=weighted_t)


class _RowSums:
    """Pass 1's per-row state of one row tile (see the module docstring)."""

    def __init__(self, n: int, acc: torch.dtype, device: torch.device):
        self.student, self.teacher = _Online(n, acc, device), _Online(n, acc, device)
        self.x_sum = torch.zeros(n, dtype=acc, device=device)  # sum exp(z_s - m_s) z_s
        self.gap = torch.zeros(n, dtype=acc, device=device)  # beta 0 / 1: the KL's gap
        self.z_target = torch.zeros(n, dtype=acc, device=device)

    def add(self, z_s: Tensor, z_t: Tensor, slots: tuple[Tensor, Tensor], beta: float) -> None:
        """Fold one tile pair in, consuming both (overwritten in place): at most three
        tiles alive, these two included."""
        in_tile, local = slots
        self.z_target = torch.where(in_tile, z_s.gather(1, local[:, None]).squeeze(1),
                                    self.z_target)  # fmt: skip
        e_t, scale_t = self.teacher.add(z_t)
        if beta == 0.0:  # sum exp(z_t - m_t) (z_t - z_s)
            self.gap.mul_(scale_t).add_(z_t.sub_(z_s).mul_(e_t).sum(dim=1))
        del e_t
        e_s, scale_s = self.student.add(z_s)
        if beta == 1.0:  # sum exp(z_s - m_s) (z_s - z_t)
            self.gap.mul_(scale_s).add_(torch.sub(z_s, z_t, out=z_t).mul_(e_s).sum(dim=1))
        self.x_sum.mul_(scale_s).add_(e_s.mul_(z_s).sum(dim=1))


def _forward_rows(h_s, ws, bs, h_t, wt, bt, targets, spec: _DivSpec):
    """One row tile: (divergence, aux, student log Z, teacher log Z, target z, entropy).
    Each tile pair is consumed where it is made (`_RowSums.add`, `_mixture_terms`), so no
    more than three (pass 1) or four (pass 2) fp32 tiles are ever alive."""
    n, dev, acc, beta = h_s.shape[0], h_s.device, spec.acc, spec.beta
    sums = _RowSums(n, acc, dev)
    ranges = _vocab_ranges(ws.shape[0], spec.vocab_tile)
    for v0, v1 in ranges:
        sums.add(*_tiles(h_s, ws, bs, h_t, wt, bt, spec, v0, v1), _target_slots(targets, v0, v1),
                 beta)  # fmt: skip
    ls, lt = sums.student.log_z(), sums.teacher.log_z()
    entropy = ls - sums.x_sum / sums.student.s
    z_target = sums.z_target
    if beta == 0.0:
        div = sums.gap / sums.teacher.s - lt + ls
        return div, div, ls, lt, z_target, entropy
    if beta == 1.0:
        div = sums.gap / sums.student.s - ls + lt
        return div, div, ls, lt, z_target, entropy
    div = torch.zeros(n, dtype=acc, device=dev)
    kl_s = torch.zeros(n, dtype=acc, device=dev)  # KL(p_s || m), the gradient's baseline
    for v0, v1 in ranges:
        kt, ks = _mixture_terms(*_tiles(h_s, ws, bs, h_t, wt, bt, spec, v0, v1), ls, lt, beta)
        div.add_(beta * kt + (1.0 - beta) * ks)
        kl_s.add_(ks)
    return div, kl_s, ls, lt, z_target, entropy


def _mixture_terms(z_s: Tensor, z_t: Tensor, ls: Tensor, lt: Tensor, beta: float):
    """One tile pair's row sums of p_t (log p_t - log m) and p_s (log p_s - log m),
    consuming both tiles (in place): four tiles alive at most, these two included."""
    log_ps, log_pt = z_s.sub_(ls[:, None]), z_t.sub_(lt[:, None])
    log_m = _log_mixture(log_ps, log_pt, beta, consume=False)
    kt = (log_pt - log_m).mul_(log_pt.exp_()).sum(dim=1)
    ks = torch.sub(log_ps, log_m, out=log_m).mul_(log_ps.exp_()).sum(dim=1)
    return kt, ks


def _forward(h_s, ws, bs, h_t, wt, bt, targets, spec: _DivSpec):
    """(divergence, logprobs, entropy, saved (aux, log Z_s, log Z_t)), each (N,)."""
    n, dev, acc = h_s.shape[0], h_s.device, spec.acc
    out = [torch.empty(n, dtype=acc, device=dev) for _ in range(6)]
    for r0 in range(0, n, spec.row_tile):
        r1 = min(r0 + spec.row_tile, n)
        rows = _forward_rows(h_s[r0:r1].to(spec.student), ws, bs, h_t[r0:r1].to(spec.teacher),
                             wt, bt, targets[r0:r1], spec)  # fmt: skip
        for buffer, value in zip(out, rows):
            buffer[r0:r1] = value
    div, aux, ls, lt, z_target, entropy = out
    return div, z_target - ls, entropy, (aux, ls, lt)


def _grad_z(z_s, z_t, rows_saved, slots, grads, spec: _DivSpec) -> Tensor:
    """d loss / d z_s for one tile pair (see the module docstring), divided by T; made in
    the two tiles' memory (both consumed), three fp32 tiles alive at most (four for
    0 < beta < 1)."""
    aux, ls, lt, entropy = rows_saved
    g_div, g_lp, g_ent = grads
    beta = spec.beta
    # the entropy term's g_H (log Z_s - H - z_s), before z_s becomes log p_s
    ent = (ls - entropy)[:, None].sub(z_s).mul_(g_ent[:, None])
    log_ps, log_pt = z_s.sub_(ls[:, None]), z_t.sub_(lt[:, None])
    if beta == 0.0:  # p_s - p_t
        gz = torch.sub(log_ps.exp_(), log_pt.exp_(), out=log_pt)
    elif beta == 1.0:  # p_s (log p_s - log p_t - D)
        gz = torch.sub(log_ps, log_pt, out=log_pt).sub_(aux[:, None]).mul_(log_ps.exp_())
    else:  # (1 - beta) p_s (log p_s - log m - KL(p_s || m))
        log_m = _log_mixture(log_ps, log_pt, beta, consume=True)
        gz = torch.sub(log_ps, log_m, out=log_m).sub_(aux[:, None]).mul_(log_ps.exp_())
    p_s = log_ps
    gz.mul_(g_div[:, None] if beta in (0.0, 1.0) else (1.0 - beta) * g_div[:, None])
    ent.mul_(p_s)
    gz.sub_(p_s.mul_(g_lp[:, None]))
    gz.add_(ent)
    in_tile, local = slots
    gz.scatter_add_(1, local[:, None], (g_lp * in_tile)[:, None])
    if spec.temperature != 1.0:
        gz.div_(spec.temperature)
    return gz


def _backward_tile(h, ht, inputs, v0, v1, rows, grads, spec: _DivSpec, out) -> None:
    """One tile pair's gradient, added to `out` = (hidden's, weight's, bias's); every tile
    it makes is gone when it returns."""
    _, ws, bs, _, wt, bt, targets = inputs
    rows_saved, (r0, r1) = rows
    g_h, grad_w, grad_b = out
    slots = _target_slots(targets[r0:r1], v0, v1)
    gz = _grad_z(*_tiles(h, ws, bs, ht, wt, bt, spec, v0, v1), rows_saved, slots, grads, spec)
    g = gz.to(h.dtype)
    if g_h is not None:
        _accumulate_mm(g_h, g, ws[v0:v1].to(h.dtype))
    if grad_w is not None:
        _accumulate_mm(grad_w[v0:v1], g.T, h)
    if grad_b is not None:
        grad_b[v0:v1].add_(gz.sum(dim=0))


def _backward(inputs, saved, grads, spec: _DivSpec, needs: tuple[bool, bool, bool]):
    h_s, ws, bs, h_t, wt, bt, targets = inputs
    n, dev, acc = h_s.shape[0], h_s.device, spec.acc
    need_h, need_w, need_b = needs
    grad_h = torch.empty_like(h_s) if need_h else None
    grad_w = torch.zeros(ws.shape, dtype=acc, device=dev) if need_w else None
    grad_b = torch.zeros(ws.shape[0], dtype=acc, device=dev) if need_b else None
    for r0 in range(0, n, spec.row_tile):
        r1 = min(r0 + spec.row_tile, n)
        rows_saved = tuple(t[r0:r1] for t in saved)
        rows_grads = tuple(g[r0:r1].to(acc) for g in grads)
        h, ht = h_s[r0:r1].to(spec.student), h_t[r0:r1].to(spec.teacher)
        g_h = torch.zeros(h.shape, dtype=acc, device=dev) if need_h else None
        for v0, v1 in _vocab_ranges(ws.shape[0], spec.vocab_tile):
            _backward_tile(h, ht, inputs, v0, v1, (rows_saved, (r0, r1)), rows_grads, spec,
                           (g_h, grad_w, grad_b))  # fmt: skip
        if grad_h is not None:
            grad_h[r0:r1] = g_h
    return grad_h, grad_w, grad_b


class _ChunkedDivergence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_s, ws, bs, h_t, wt, bt, targets, spec):
        with _no_autocast(h_s.device):
            div, logprobs, entropy, saved = _forward(h_s, ws, bs, h_t, wt, bt, targets, spec)
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(h_s, ws, bs, h_t, wt, bt, targets, *saved, entropy)
        return div, logprobs, entropy

    @staticmethod
    def backward(ctx, g_div, g_lp, g_ent):
        h_s, ws, bs, h_t, wt, bt, targets, aux, ls, lt, entropy = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                 bs is not None and ctx.needs_input_grad[2])  # fmt: skip
        if not any(needs) or (g_div is None and g_lp is None and g_ent is None):
            return (None,) * 8
        zeros = torch.zeros_like(ls)
        grads = tuple(zeros if g is None else g for g in (g_div, g_lp, g_ent))
        with _no_autocast(h_s.device):
            grad_h, grad_w, grad_b = _backward(
                (h_s, ws, bs, h_t, wt, bt, targets), (aux, ls, lt, entropy), grads, ctx.spec,
                needs,
            )  # fmt: skip
        grad_w = None if grad_w is None else grad_w.to(ws.dtype)
        grad_b = None if grad_b is None else grad_b.to(bs.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def chunked_divergence(
    student_hidden: Tensor,  # (N, H_s)
    student_weight: Tensor,  # (V, H_s)
    teacher_hidden: Tensor,  # (N, H_t), detached
    teacher_weight: Tensor,  # (V_t >= V, H_t), detached
    targets: Tensor,  # (N,) the sampled ids: the student's log-probs of them are returned too
    student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    *,
    beta: float,
    temperature: float = 1.0,
    row_tile: int | None = None,
    vocab_tile: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(divergence, student log-probs of targets, student entropy), each (N,) fp32 (float64
    for float64 inputs), differentiable in the student's hidden states, weight and bias.
    A teacher with more vocabulary rows than the student (padding rows) is read on the
    student's rows only."""
    _check(student_hidden, student_weight, teacher_hidden, teacher_weight, targets, beta,
           temperature)  # fmt: skip
    vocab = student_weight.shape[0]
    teacher_weight = teacher_weight[:vocab]
    teacher_bias = None if teacher_bias is None else teacher_bias[:vocab]
    spec = _spec(student_hidden, student_weight, teacher_hidden, teacher_weight, beta,
                 temperature, row_tile, vocab_tile)  # fmt: skip
    args = (student_hidden, student_weight, student_bias, teacher_hidden.detach(),
            teacher_weight.detach(), None if teacher_bias is None else teacher_bias.detach(),
            targets.long(), spec)  # fmt: skip
    needs_graph = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (student_hidden, student_weight, student_bias)
    )
    if needs_graph:
        return _ChunkedDivergence.apply(*args)
    with _no_autocast(student_hidden.device):
        div, logprobs, entropy, _ = _forward(*args)
    return div, logprobs, entropy


def naive_divergence(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    targets: Tensor,
    student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    *,
    beta: float,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """The reference: both models' full logits, log_softmax, the definition term by term."""
    vocab = student_weight.shape[0]
    zs = torch.nn.functional.linear(student_hidden, student_weight, student_bias) / temperature
    bt = None if teacher_bias is None else teacher_bias[:vocab]
    zt = torch.nn.functional.linear(teacher_hidden, teacher_weight[:vocab], bt) / temperature
    log_ps, log_pt = zs.log_softmax(-1), zt.to(zs.dtype).log_softmax(-1)
    ps, pt = log_ps.exp(), log_pt.exp()
    if beta == 0.0:
        div = (pt * (log_pt - log_ps)).sum(-1)
    elif beta == 1.0:
        div = (ps * (log_ps - log_pt)).sum(-1)
    else:
        m = (1.0 - beta) * ps + beta * pt
        div = beta * (pt * (log_pt - m.log())).sum(-1) + (1.0 - beta) * (
            ps * (log_ps - m.log())
        ).sum(-1)
    logprobs = log_ps.gather(1, targets.long()[:, None]).squeeze(1)
    entropy = -(ps * log_ps).sum(-1)
    return div, logprobs, entropy
