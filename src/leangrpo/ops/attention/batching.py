"""Batched SDPA for the packed kernels: many short segments run as a few padded calls.

`sdpa_segments` / `sdpa_prefix` must attend within a sequence only. One SDPA call per
segment is exact but pays a fixed cost per call, which dominates when a micro-batch holds
hundreds of sequences of a few dozen tokens (GRPO on short answers: one call per completion
and layer). So segments are grouped into *buckets*, each run as one call on a right-padded batch:

* causal bucket: R segments padded to width W, (R, H, W, D), `is_causal=True`. Right
  padding needs no mask: a real query at offset i attends keys 0..i, all real; outputs of
  padded queries are dropped (their gradient is exactly zero).
* prefix bucket (shared-prefix completions): queries = R completions padded to Cw; keys =
  [own group's prompt padded to Pw ; own completion padded to Cw] with a bool mask
  (R, 1, Cw, Pw + Cw) = prompt column real, or completion column causal. Every query row
  sees at least one prompt key, so no row is fully masked (no NaN).

Tokens move into a bucket with one `index_select` from the row plus a zero row (the
padding), and back with one `index_select`; a final `index_select` restores row order
when buckets reorder tokens. Buckets of one causal segment run on a view of the row (no
copy), like the per-segment kernel.

Cost model (`plan_*`, greedy, O(S log S)): a call costs `overhead + area x H x D`, area =
padded query rows x keys. Items are taken longest first; an item joins the open bucket
when the area it adds (its own plus the padding it causes) is at most its own area plus
one call's overhead expressed as area (`overhead / (unit x H x D)`), else it opens a new
bucket. Equal lengths therefore always share a call; a long sequence among short ones
keeps a call of its own. The two constants (`CALL_COST_GRAD`, `CALL_COST_NO_GRAD`: fixed
cost per call / cost per unit of area x H x D, with and without gradients) are fitted by
`benchmarks/attention_layout.py` on CPU; the fit is in benchmarks/RESULTS.md ("Layout
rules measured"). Buckets are also capped at `MAX_BUCKET_AREA` (the prefix mask and the
padded buffers stay small).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# call overhead in units of (area x H x D); fitted by benchmarks/attention_layout.py
CALL_COST_GRAD = 2.0e6
CALL_COST_NO_GRAD = 5.0e5
MAX_BUCKET_AREA = 1 << 24  # padded query rows x keys per call (16 M mask entries)


@dataclass(frozen=True)
class Bucket:
    """One padded SDPA call: `rows` sequences, queries padded to `width`."""

    rows: int
    width: int  # padded query length
    prompt_width: int  # padded prompt keys before the completion keys (0: causal bucket)
    src: Tensor  # (n,) row positions of the bucket's real query tokens (host), bucket order
    q_index: Tensor  # (rows * width,) row position per padded query slot; N = zero row
    kv_index: Tensor | None  # (rows * (prompt_width + width),) prefix buckets only
    mask: Tensor | None  # (rows, 1, width, prompt_width + width) bool, prefix buckets only
    keep: Tensor  # (n,) padded slots of the real queries, in `src` order


@dataclass(frozen=True)
class BatchedPlan:
    """How a packed row runs: padded buckets, and causal segments (a, b) run on views."""

    calls: tuple[Bucket | tuple[int, int], ...]
    restore: Tensor | None  # (N,) order of the concatenated outputs; None: already row order


def call_cost(head_dim_total: int, grad: bool) -> float:
    """One call's fixed cost as attention area (query rows x keys) for H x D = head_dim_total."""
    return (CALL_COST_GRAD if grad else CALL_COST_NO_GRAD) / max(1, head_dim_total)


# ------------------------------------------------------------------------------ planning


def group_causal(lengths: list[int], per_call: float) -> list[list[int]]:
    """Segment indices per call, longest first (greedy; see the module docstring)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    calls: list[list[int]] = []
    width = 0
    for i in order:
        n = lengths[i]
        if calls and _joins(
            len(calls[-1]) * width * width, (len(calls[-1]) + 1) * width * width, n * n, per_call
        ):
            calls[-1].append(i)
        else:
            calls.append([i])
            width = n
    return calls


def group_prefix(items: list[tuple[int, int]], per_call: float) -> list[list[int]]:
    """Completion indices per call; items are (prompt_len, completion_len)."""
    order = sorted(range(len(items)), key=lambda i: (-(items[i][0] + items[i][1]), -items[i][1], i))
    calls: list[list[int]] = []
    pw = cw = 0
    for i in order:
        p, n = items[i]
        if calls:
            rows = len(calls[-1])
            npw, ncw = max(pw, p), max(cw, n)
            if _joins(rows * cw * (pw + cw), (rows + 1) * ncw * (npw + ncw), n * (p + n), per_call):
                calls[-1].append(i)
                pw, cw = npw, ncw
                continue
        calls.append([i])
        pw, cw = p, n
    return calls


def _joins(area: int, new_area: int, own: int, per_call: float) -> bool:
    return new_area <= MAX_BUCKET_AREA and new_area - area <= own + per_call


def plan_causal(bounds: list[int], per_call: float, device) -> BatchedPlan:
    """Plan for causal segments [bounds[i], bounds[i+1]) of a row of bounds[-1] tokens."""
    starts, lengths = bounds[:-1], [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    return _finish(_causal_calls(starts, lengths, per_call, bounds[-1]), bounds[-1], device)


def plan_prefix(layout, per_call: float, device) -> BatchedPlan:
    """Plan for a shared-prefix row: prompts as causal segments, completions over [prompt; own]."""
    starts = [g.prompt_start for g in layout.groups]
    prompt_lens = [g.prompt_len for g in layout.groups]
    items, where = [], []  # (prompt_len, completion_len), (prompt_start, completion_start)
    for g in layout.groups:
        for c0, n in zip(g.completion_starts, g.completion_lens):
            items.append((g.prompt_len, n))
            where.append((g.prompt_start, c0))
    calls = _causal_calls(starts, prompt_lens, per_call, layout.num_tokens)
    for call in group_prefix(items, per_call):
        picked = [items[i] for i in call], [where[i] for i in call]
        calls.append(_prefix_bucket(*picked, layout.num_tokens))
    return _finish(calls, layout.num_tokens, device)


def _causal_calls(starts: list[int], lengths: list[int], per_call: float, n_tokens: int) -> list:
    """Buckets for groups of causal segments; a group of one runs on a view of the row."""
    calls: list[Bucket | tuple[int, int]] = []
    for call in group_causal(lengths, per_call):
        if len(call) == 1:
            calls.append((starts[call[0]], starts[call[0]] + lengths[call[0]]))
        else:
            picked = [starts[i] for i in call], [lengths[i] for i in call]
            calls.append(_causal_bucket(*picked, n_tokens))
    return calls


def _offsets(lens: list[int]) -> Tensor:
    """(sum lens,) 0..len-1 within each length."""
    lens_t = torch.tensor(lens)
    return torch.arange(sum(lens)) - torch.repeat_interleave(
        torch.cumsum(lens_t, 0) - lens_t, lens_t
    )


def _causal_bucket(starts: list[int], lens: list[int], n_tokens: int) -> Bucket:
    rows, width = len(lens), max(lens)
    lens_t = torch.tensor(lens)
    offsets = _offsets(lens)
    src = torch.repeat_interleave(torch.tensor(starts), lens_t) + offsets
    keep = torch.repeat_interleave(torch.arange(rows) * width, lens_t) + offsets
    q_index = torch.full((rows * width,), n_tokens, dtype=torch.int64)
    q_index[keep] = src
    return Bucket(rows, width, 0, src, q_index, None, None, keep)


def _prefix_bucket(
    items: list[tuple[int, int]], where: list[tuple[int, int]], n_tokens: int
) -> Bucket:
    rows = len(items)
    pw, cw = max(p for p, _ in items), max(n for _, n in items)
    p_lens = torch.tensor([p for p, _ in items])
    c_lens = torch.tensor([n for _, n in items])
    c_off, p_off = _offsets([n for _, n in items]), _offsets([p for p, _ in items])
    src = torch.repeat_interleave(torch.tensor([c0 for _, c0 in where]), c_lens) + c_off
    keep = torch.repeat_interleave(torch.arange(rows) * cw, c_lens) + c_off
    q_index = torch.full((rows * cw,), n_tokens, dtype=torch.int64)
    q_index[keep] = src
    span = pw + cw
    kv_index = torch.full((rows * span,), n_tokens, dtype=torch.int64)
    prompt_src = torch.repeat_interleave(torch.tensor([p0 for p0, _ in where]), p_lens) + p_off
    kv_index[torch.repeat_interleave(torch.arange(rows) * span, p_lens) + p_off] = prompt_src
    kv_index[torch.repeat_interleave(torch.arange(rows) * span + pw, c_lens) + c_off] = src
    row = torch.arange(cw)[None, :, None]
    col = torch.arange(span)[None, None, :]
    mask = (col < p_lens[:, None, None]) | ((col >= pw) & (col - pw <= row))
    return Bucket(rows, cw, pw, src, q_index, kv_index, mask[:, None], keep)


def _finish(calls: list, n_tokens: int, device) -> BatchedPlan:
    order = torch.cat([c.src if isinstance(c, Bucket) else torch.arange(*c) for c in calls])
    restore = None
    if not torch.equal(order, torch.arange(n_tokens)):
        restore = torch.empty_like(order)
        restore[order] = torch.arange(n_tokens)
        restore = restore.to(device)
    return BatchedPlan(tuple(_to(c, device) for c in calls), restore)


def _to(call, device):
    if not isinstance(call, Bucket):
        return call
    return Bucket(
        call.rows,
        call.width,
        call.prompt_width,
        call.src,
        call.q_index.to(device),
        None if call.kv_index is None else call.kv_index.to(device),
        None if call.mask is None else call.mask.to(device),
        call.keep.to(device),
    )


# ------------------------------------------------------------------------------- running


def run_plan(
    q: Tensor, k: Tensor, v: Tensor, plan: BatchedPlan, scale: float, dropout: float
) -> Tensor:
    """(1, N, H, D): every call of `plan`, outputs back in row order."""
    gqa = q.shape[1] != k.shape[1]
    padded_rows = None  # (N + 1, heads, D) each, built for the first bucket
    outs = []
    for call in plan.calls:
        if isinstance(call, Bucket):
            if padded_rows is None:
                padded_rows = [_with_zero_row(t[0].transpose(0, 1)) for t in (q, k, v)]
            outs.append(_run_bucket(*padded_rows, call, scale, dropout, gqa))
            continue
        a, b = call
        out = F.scaled_dot_product_attention(
            q[:, :, a:b],
            k[:, :, a:b],
            v[:, :, a:b],
            is_causal=True,
            scale=scale,
            dropout_p=dropout,
            enable_gqa=gqa,
        )
        outs.append(out[0].transpose(0, 1))  # (L, H, D)
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    if plan.restore is not None:
        out = out.index_select(0, plan.restore)
    return out.unsqueeze(0)


def _with_zero_row(t3: Tensor) -> Tensor:
    """(N, heads, D) -> (N + 1, heads, D): row N is the padding."""
    return torch.cat([t3, t3.new_zeros(1, *t3.shape[1:])])


def _run_bucket(q_ext, k_ext, v_ext, bucket: Bucket, scale, dropout, gqa) -> Tensor:
    """(n, H, D) outputs of the bucket's real queries, in `bucket.src` order."""
    rows, width = bucket.rows, bucket.width

    def padded(t_ext: Tensor, index: Tensor, length: int) -> Tensor:  # (rows, heads, length, D)
        return t_ext.index_select(0, index).view(rows, length, *t_ext.shape[1:]).transpose(1, 2)

    q = padded(q_ext, bucket.q_index, width)
    if bucket.kv_index is None:
        k, v = padded(k_ext, bucket.q_index, width), padded(v_ext, bucket.q_index, width)
    else:
        span = bucket.prompt_width + width
        k, v = padded(k_ext, bucket.kv_index, span), padded(v_ext, bucket.kv_index, span)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=bucket.mask,
        is_causal=bucket.mask is None,
        scale=scale,
        dropout_p=dropout,
        enable_gqa=gqa,
    )  # (rows, H, width, D)
    heads, dim = out.shape[1], out.shape[3]
    return out.transpose(1, 2).reshape(rows * width, heads, dim).index_select(0, bucket.keep)
