"""The chunked lm_head: tiled forward, tiled backward and their autograd.Function.

Rows (completion positions) x vocabulary are walked in (row_tile x vocab_tile) tiles. The
forward keeps, per row, an online log-sum-exp in fp32 (running max m, sum of exp(z - m),
and for the entropy the sum of exp(z - m) * z) plus the target's logit; the backward
recomputes each logits tile from hidden and weight, rebuilds the softmax tile with the
saved log-normaliser and accumulates the gradients of hidden, weight and bias.

Choices:
- z = (hidden @ weight.T + bias) in the inputs' dtype, or autocast's when autocast is on
  (what the model's lm_head would do), the same in forward and backward; then upcast to
  fp32 (float64 stays float64) and divided by the temperature.
- Sampling filters match the engine: top-k keeps z >= the k-th largest z of the row (ties
  kept), min-p keeps z >= max z + log(min_p) (<=> p >= min_p * p_max). Filtered tokens leave
  the normaliser and get no gradient; a filtered target gets -inf (engines never sample
  one). With a filter the forward makes one extra pass over the vocabulary to find each
  row's threshold (running top-k values, running max); the threshold is saved (N floats),
  so the backward needs no extra pass.
- Saved for backward: the inputs (by reference), log-normaliser (N,), threshold (N,) when
  filtered, entropy (N,) when asked. Nothing O(N*V). Under no_grad nothing is saved.
- Entropy (of the filtered, renormalised distribution) is differentiable: its gradient is
  one more term in the tile, dH/dz = p * (log Z - H - z).
- Backward loop order: rows outer, vocabulary inner, grad_hidden accumulating in an fp32
  row tile and grad_weight in a (V, H) fp32 buffer (allocated only when the weight requires
  grad: not for a frozen lm_head under LoRA); or, when the weight is bf16/fp16 and trained
  (e.g. gathered by FSDP), vocabulary outer: each (vocab_tile, H) fp32 tile sums over all
  rows and is written once into a gradient of the weight's dtype, with an (N, H) fp32
  grad_hidden instead, so no full fp32 copy of the weight exists. Both sum in the same
  order (identical results). Matmuls run in the inputs' dtype, accumulation in fp32.
- Optional torch.compile (`compile=True`, config `logprobs.compile`): the row-tile loops
  (`_forward_rows`, `_backward_rows`) are compiled as they are, so the elementwise work
  around each tile's matmul fuses into a few kernels instead of a dozen passes over an fp32
  tile. Same algorithm and memory plan; off by default until benchmarks/gpu_suite.py
  measures it faster than the eager path on CUDA. A backend name instead of True (e.g.
  "aot_eager") traces the same graphs without code generation (CPU tests).

This module is the engine behind `leangrpo.ops.logprobs.api.chunked_logprobs`: api.py
validates the inputs into a `_Spec` and is its only importer; nothing here is public API.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class _Spec:
    """Validated options shared by the forward and the backward."""

    temperature: float
    top_k: int  # 0 = off (also when top_k >= V)
    min_p: float  # 0.0 = off
    with_entropy: bool
    row_tile: int
    vocab_tile: int
    compute: torch.dtype  # the lm_head matmul's dtype
    compile: str | None = None  # torch.compile backend of the row-tile loops; None = eager

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.min_p > 0.0


_AUTOCAST_DEVICES = ("cpu", "cuda")


def _matmul_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """Autocast's dtype when it is on for this device (as nn.Linear would), else the inputs'."""
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    kind = hidden.device.type
    if dtype != torch.float64 and kind in _AUTOCAST_DEVICES and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return dtype


def _no_autocast(device: torch.device):
    """Forward and backward then run in spec.compute exactly, whatever autocast is doing."""
    if device.type in _AUTOCAST_DEVICES:
        return torch.autocast(device.type, enabled=False)
    return nullcontext()


def _dtypes(spec: _Spec) -> tuple[torch.dtype, torch.dtype]:
    """(matmul dtype, accumulation dtype): fp32 accumulation, float64 kept as float64."""
    return spec.compute, torch.promote_types(spec.compute, torch.float32)


def _tile_logits(
    h: Tensor, weight: Tensor, bias: Tensor | None, v0: int, v1: int, spec: _Spec, acc: torch.dtype
) -> Tensor:
    """z (n, v1 - v0) in the accumulation dtype: (h @ W[v0:v1].T + b[v0:v1]) / temperature."""
    w = weight[v0:v1].to(h.dtype)
    if bias is None:
        logits = h @ w.T
    else:
        logits = torch.addmm(bias[v0:v1].to(h.dtype), h, w.T)
    z = logits.to(acc)
    if spec.temperature != 1.0:
        z.div_(spec.temperature)
    return z


def _vocab_ranges(vocab: int, tile: int) -> list[tuple[int, int]]:
    return [(v0, min(v0 + tile, vocab)) for v0 in range(0, vocab, tile)]


def _row_thresholds(
    h: Tensor, weight: Tensor, bias: Tensor | None, spec: _Spec, acc: torch.dtype
) -> Tensor:
    """Per-row filter threshold (n,): keep z >= thr. One pass: running top-k values or max."""
    n = h.shape[0]
    best = None  # (n, <= k) running top-k values of the row
    row_max = torch.full((n,), -math.inf, dtype=acc, device=h.device)
    for v0, v1 in _vocab_ranges(weight.shape[0], spec.vocab_tile):
        z = _tile_logits(h, weight, bias, v0, v1, spec, acc)
        if spec.top_k:
            cand = z if best is None else torch.cat([best, z], dim=1)
            best = cand.topk(min(spec.top_k, cand.shape[1]), dim=1, sorted=False).values
        else:
            torch.maximum(row_max, z.amax(dim=1), out=row_max)
    thr = torch.full((n,), -math.inf, dtype=acc, device=h.device)
    if spec.top_k:
        thr = best.amin(dim=1)  # the k-th largest: ties with it stay in
        row_max = best.amax(dim=1)
    if spec.min_p > 0.0:
        thr = torch.maximum(thr, row_max + math.log(spec.min_p))
    return thr


_COMPILED: dict[tuple[str, str], Callable] = {}


def _rows_fn(fn: Callable, spec: _Spec) -> Callable:
    """`fn` itself, or its torch.compile'd version (one per backend, shapes dynamic on reuse)."""
    if spec.compile is None:
        return fn
    key = (fn.__name__, spec.compile)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, backend=spec.compile)
    return _COMPILED[key]


def _target_slots(targets: Tensor, v0: int, v1: int) -> tuple[Tensor, Tensor]:
    """(rows whose target lies in [v0, v1), its column in the tile (clamped where not))."""
    return (targets >= v0) & (targets < v1), (targets - v0).clamp_(0, v1 - v0 - 1)


def _forward_rows(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    thr: Tensor | None,
    spec: _Spec,
    acc: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One row tile: (target z, log Z, entropy or None), each (n,), by online log-sum-exp."""
    n, dev = h.shape[0], h.device
    m = torch.full((n,), -math.inf, dtype=acc, device=dev)  # running max
    s = torch.zeros(n, dtype=acc, device=dev)  # sum exp(z - m)
    t = torch.zeros(n, dtype=acc, device=dev) if spec.with_entropy else None  # sum exp(z - m) * z
    z_target = torch.full((n,), -math.inf, dtype=acc, device=dev)
    for v0, v1 in _vocab_ranges(weight.shape[0], spec.vocab_tile):
        z = _tile_logits(h, weight, bias, v0, v1, spec, acc)
        dropped = None if thr is None else z < thr[:, None]
        if dropped is not None:
            z.masked_fill_(dropped, -math.inf)
        in_tile, local = _target_slots(targets, v0, v1)
        z_target = torch.where(in_tile, z.gather(1, local[:, None]).squeeze(1), z_target)
        # clamp: a row whose tiles so far were all filtered keeps m = -inf; avoid -inf - -inf
        m_new = torch.maximum(m, z.amax(dim=1)).clamp_(min=torch.finfo(acc).min)
        scale = torch.exp(m - m_new)
        # without entropy z is not needed again: exponentiate in place (one tile less)
        e = (z.sub_(m_new[:, None]) if t is None else z - m_new[:, None]).exp_()
        s.mul_(scale).add_(e.sum(dim=1))
        if t is not None:
            if dropped is not None:
                z.masked_fill_(dropped, 0.0)  # e is 0 there; avoid 0 * -inf
            t.mul_(scale).add_((e * z).sum(dim=1))
        m = m_new
    log_z = m + s.log()
    entropy = None if t is None else log_z - t / s
    return z_target, log_z, entropy


def _forward(
    hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, spec: _Spec
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """(logprobs, log Z, threshold or None, entropy or None), each (N,) in the acc dtype."""
    compute, acc = _dtypes(spec)
    n_rows, dev = hidden.shape[0], hidden.device
    logprobs = torch.empty(n_rows, dtype=acc, device=dev)
    log_z = torch.empty(n_rows, dtype=acc, device=dev)
    thr = torch.empty(n_rows, dtype=acc, device=dev) if spec.filtered else None
    entropy = torch.empty(n_rows, dtype=acc, device=dev) if spec.with_entropy else None
    for r0 in range(0, n_rows, spec.row_tile):
        r1 = min(r0 + spec.row_tile, n_rows)
        h = hidden[r0:r1].to(compute)
        if thr is not None:
            thr[r0:r1] = _row_thresholds(h, weight, bias, spec, acc)
        rows_thr = None if thr is None else thr[r0:r1]
        rows = _rows_fn(_forward_rows, spec)
        z_t, lz, ent = rows(h, weight, bias, targets[r0:r1], rows_thr, spec, acc)
        logprobs[r0:r1] = z_t - lz
        log_z[r0:r1] = lz
        if entropy is not None:
            entropy[r0:r1] = ent
    return logprobs, log_z, thr, entropy


@dataclass
class _Grads:
    """Accumulators of one backward: fp32 (or float64) unless the dtype already is."""

    hidden: Tensor | None  # (N, H) in hidden's dtype, filled row tile by row tile
    weight: Tensor | None  # (V, H) acc dtype
    bias: Tensor | None  # (V,) acc dtype


def _accumulate_mm(out: Tensor, a: Tensor, b: Tensor) -> None:
    """out += a @ b, with the matmul in a's dtype and the sum in out's dtype."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    else:
        out.add_(a @ b)


def _tile_grad_z(
    z: Tensor,
    tile_targets: tuple[Tensor, Tensor],
    log_z: Tensor,
    thr: Tensor | None,
    entropy: Tensor | None,
    g_lp: Tensor,
    g_ent: Tensor | None,
) -> Tensor:
    """d loss / d z for one tile, in place over z: g_lp*(onehot - p) + g_ent*p*(logZ - H - z)."""
    in_tile, local = tile_targets
    kept = None if thr is None else z >= thr[:, None]
    target_kept = in_tile if kept is None else in_tile & kept.gather(1, local[:, None]).squeeze(1)
    # without the entropy term z is not needed again: exponentiate in place (one tile less)
    p = (z.sub_(log_z[:, None]) if g_ent is None else z - log_z[:, None]).exp_()
    if kept is not None:
        p.masked_fill_(~kept, 0.0)
    if g_ent is not None:
        gz = z.neg_().add_((log_z - entropy)[:, None]).mul_(g_ent[:, None]).sub_(g_lp[:, None])
        gz.mul_(p)
    else:
        gz = p.mul_(-g_lp[:, None])
    gz.scatter_add_(1, local[:, None], (g_lp * target_kept)[:, None])
    return gz


def _backward_rows(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    saved: tuple[Tensor, Tensor | None, Tensor | None],
    g_lp: Tensor,
    g_ent: Tensor | None,
    spec: _Spec,
    grads: _Grads,
    acc: torch.dtype,
) -> Tensor | None:
    """Recompute the row tile's logits tile by tile; returns grad of h (n, H) in acc dtype."""
    log_z, thr, entropy = saved
    grad_h = torch.zeros(h.shape, dtype=acc, device=h.device) if grads.hidden is not None else None
    for v0, v1 in _vocab_ranges(weight.shape[0], spec.vocab_tile):
        z = _tile_logits(h, weight, bias, v0, v1, spec, acc)
        gz = _tile_grad_z(z, _target_slots(targets, v0, v1), log_z, thr, entropy, g_lp, g_ent)
        if spec.temperature != 1.0:
            gz.div_(spec.temperature)  # z = logits / T
        g = gz.to(h.dtype)
        if grad_h is not None:
            _accumulate_mm(grad_h, g, weight[v0:v1].to(h.dtype))
        if grads.weight is not None:
            _accumulate_mm(grads.weight[v0:v1], g.T, h)
        if grads.bias is not None:
            grads.bias[v0:v1].add_(gz.sum(dim=0))
    return grad_h


def _backward(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    saved: tuple[Tensor, Tensor | None, Tensor | None],
    g_lp: Tensor | None,
    g_ent: Tensor | None,
    spec: _Spec,
    needs: tuple[bool, bool, bool],
    vocab_outer: bool | None = None,  # None: the order with the smaller accumulators
) -> _Grads:
    compute, acc = _dtypes(spec)
    need_h, need_w, need_b = needs
    dev = hidden.device
    if g_lp is None:
        g_lp = torch.zeros(hidden.shape[0], dtype=acc, device=dev)
    if vocab_outer is None:
        vocab_outer = _vocab_outer_is_smaller(hidden, weight, need_w, acc)
    if vocab_outer:
        return _backward_vocab_outer(hidden, weight, targets, bias, saved, g_lp, g_ent, spec, needs)
    grads = _Grads(
        hidden=torch.empty_like(hidden) if need_h else None,
        weight=torch.zeros(weight.shape, dtype=acc, device=dev) if need_w else None,
        bias=torch.zeros(weight.shape[0], dtype=acc, device=dev) if need_b else None,
    )
    for r0 in range(0, hidden.shape[0], spec.row_tile):
        r1 = min(r0 + spec.row_tile, hidden.shape[0])
        rows_saved, g_lp_rows, g_ent_rows = _rows(saved, g_lp, g_ent, r0, r1, acc)
        grad_h = _rows_fn(_backward_rows, spec)(
            hidden[r0:r1].to(compute),
            weight,
            bias,
            targets[r0:r1],
            rows_saved,
            g_lp_rows,
            g_ent_rows,
            spec,
            grads,
            acc,
        )
        if grad_h is not None:
            grads.hidden[r0:r1] = grad_h
    return grads


def _rows(saved, g_lp: Tensor, g_ent: Tensor | None, r0: int, r1: int, acc: torch.dtype):
    """The saved values and upstream gradients of rows [r0, r1), in the accumulation dtype."""
    log_z, thr, entropy = saved
    rows_saved = (
        log_z[r0:r1],
        None if thr is None else thr[r0:r1],
        None if entropy is None else entropy[r0:r1],
    )
    return rows_saved, g_lp[r0:r1].to(acc), None if g_ent is None else g_ent[r0:r1].to(acc)


def _vocab_outer_is_smaller(hidden: Tensor, weight: Tensor, need_w: bool, acc) -> bool:
    """Rows outer needs a (V, H) fp32 weight-gradient buffer when the weight is bf16/fp16;
    vocabulary outer needs a (N, H) fp32 hidden-gradient buffer when hidden is. Pick the
    smaller (N < V in practice: a sharded or low-precision trained lm_head never gets a
    full fp32 copy of its gradient)."""
    if not need_w or weight.dtype == acc:
        return False
    return hidden.dtype == acc or hidden.shape[0] < weight.shape[0]


def _backward_vocab_outer(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    saved: tuple[Tensor, Tensor | None, Tensor | None],
    g_lp: Tensor,
    g_ent: Tensor | None,
    spec: _Spec,
    needs: tuple[bool, bool, bool],
) -> _Grads:
    """Vocabulary tiles outer: each weight-gradient tile is summed over all rows in fp32 and
    written once into a gradient of the weight's dtype; the same sums in the same order as
    the rows-outer loop, so the results are identical."""
    compute, acc = _dtypes(spec)
    need_h, _, need_b = needs
    dev = hidden.device
    grad_h = torch.zeros(hidden.shape, dtype=acc, device=dev) if need_h else None
    grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=dev)
    grad_b = torch.zeros(weight.shape[0], dtype=acc, device=dev) if need_b else None
    for v0, v1 in _vocab_ranges(weight.shape[0], spec.vocab_tile):
        w_tile = torch.zeros((v1 - v0, weight.shape[1]), dtype=acc, device=dev)
        for r0 in range(0, hidden.shape[0], spec.row_tile):
            r1 = min(r0 + spec.row_tile, hidden.shape[0])
            rows_saved, g_lp_rows, g_ent_rows = _rows(saved, g_lp, g_ent, r0, r1, acc)
            h = hidden[r0:r1].to(compute)
            z = _tile_logits(h, weight, bias, v0, v1, spec, acc)
            slots = _target_slots(targets[r0:r1], v0, v1)
            gz = _tile_grad_z(z, slots, *rows_saved, g_lp_rows, g_ent_rows)
            if spec.temperature != 1.0:
                gz.div_(spec.temperature)
            g = gz.to(h.dtype)
            if grad_h is not None:
                _accumulate_mm(grad_h[r0:r1], g, weight[v0:v1].to(h.dtype))
            _accumulate_mm(w_tile, g.T, h)
            if grad_b is not None:
                grad_b[v0:v1].add_(gz.sum(dim=0))
        grad_w[v0:v1] = w_tile
    hidden_grad = None if grad_h is None else grad_h.to(hidden.dtype)
    return _Grads(hidden=hidden_grad, weight=grad_w, bias=grad_b)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, spec):
        with _no_autocast(hidden.device):
            logprobs, log_z, thr, entropy = _forward(hidden, weight, targets, bias, spec)
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, targets, bias, log_z, thr, entropy)
        if entropy is None:
            entropy = logprobs.new_empty(0)
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, bias, log_z, thr, entropy = ctx.saved_tensors
        if entropy is None:
            g_ent = None
        needs = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            bias is not None and ctx.needs_input_grad[3],
        )
        if (g_lp is None and g_ent is None) or not any(needs):
            return None, None, None, None, None
        with _no_autocast(hidden.device):
            saved = (log_z, thr, entropy)
            grads = _backward(hidden, weight, targets, bias, saved, g_lp, g_ent, ctx.spec, needs)
        grad_w = None if grads.weight is None else grads.weight.to(weight.dtype)
        grad_b = None if grads.bias is None else grads.bias.to(bias.dtype)
        return grads.hidden, grad_w, None, grad_b, None
