"""Packed attention kernels: (1, H, N, D) q and (1, KVH, N, D) k/v in, (1, N, H, D) out.

Each one attends only within a sequence (causal), or, for the shared-prefix layout, from a
completion to its group's prompt plus its own earlier tokens:

* `sdpa_segments` / `sdpa_prefix`: one causal SDPA call per segment (per completion over
  [prompt; completion] with a (n, P + n) mask); exact, any device, the reference.
* `batched_segments` / `batched_prefix`: the same attention with segments grouped into a
  few right-padded SDPA calls by a measured cost model (`batching.py`); what the
  `sdpa_segments` backend runs. The plan is built once per batch and shared by the layers.
* `flash_varlen`: flash-attn's varlen kernel on cu_seqlens (CUDA, fp16/bf16).
* `torch_varlen`: torch.nn.attention.varlen.varlen_attn (CUDA, fp16/bf16); both the
  torch 2.10/2.11 signature (is_causal) and the 2.12+ one (window_size) are handled.
* `flex_plain` / `flex_prefix`: flex attention with a BlockMask built once per batch
  (compiled on CUDA; eager on CPU, forward only: torch has no CPU flex backward).
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from leangrpo.errors import UserError
from leangrpo.ops.attention import batching
from leangrpo.ops.attention.layout import PrefixLayout


class PackedAttentionError(RuntimeError):
    """A packed forward that the adapter cannot run exactly: called the wrong way (a KV
    cache, an attention mask, a batch of rows), a caller's bug; or `AttentionSetupError`."""


class AttentionSetupError(PackedAttentionError, UserError):
    """A packed forward this configuration cannot run exactly (the attention backend, the
    device, the model's attention, the sequences' lengths): the user's to fix, one
    sentence naming the setting (the CLI prints it without a traceback, exit 2)."""


_HOST_BOUNDS: dict[str, Any] = {}


def host_bounds(cu: Tensor) -> list[int]:
    """cu_seqlens as Python ints, read once per batch (every layer gets the same tensor)."""
    cached = _HOST_BOUNDS.get("cu")
    if cached is None or cached[0]() is not cu:
        cached = _HOST_BOUNDS["cu"] = (weakref.ref(cu), cu.tolist())
    return cached[1]


def _gqa(q: Tensor, k: Tensor) -> bool:
    return q.shape[1] != k.shape[1]


def _sdpa(q, k, v, scale: float, dropout: float, mask: Tensor | None = None) -> Tensor:
    """(1, L, H, D): causal SDPA, or SDPA under `mask` (bool, True = attend)."""
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        dropout_p=dropout,
        enable_gqa=_gqa(q, k),
    )
    return out.transpose(1, 2)


def sdpa_segments(q, k, v, bounds: list[int], scale: float, dropout: float) -> Tensor:
    """Causal SDPA on each [a, b) segment of the row; exact reference for every backend."""
    pairs = zip(bounds[:-1], bounds[1:])
    outs = [_sdpa(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scale, dropout) for a, b in pairs]
    return torch.cat(outs, dim=1)


def sdpa_prefix(q, k, v, layout: PrefixLayout, scale: float, dropout: float) -> Tensor:
    """Per group: the prompt causally, then each completion over [prompt; itself]."""
    outs = []
    for g in layout.groups:
        p0, p1 = g.prompt_start, g.prompt_start + g.prompt_len
        outs.append(_sdpa(q[:, :, p0:p1], k[:, :, p0:p1], v[:, :, p0:p1], scale, dropout))
        for c0, n in zip(g.completion_starts, g.completion_lens):
            keys = torch.cat([k[:, :, p0:p1], k[:, :, c0 : c0 + n]], dim=2)
            values = torch.cat([v[:, :, p0:p1], v[:, :, c0 : c0 + n]], dim=2)
            mask = _prefix_mask(layout, g.prompt_len, n, q.device)
            outs.append(_sdpa(q[:, :, c0 : c0 + n], keys, values, scale, dropout, mask))
    return torch.cat(outs, dim=1)


_BATCHED_PLANS: dict[str, Any] = {}


def batched_segments(q, k, v, cu: Tensor, scale: float, dropout: float) -> Tensor:
    """sdpa_segments' attention, segments batched into padded calls (plan cached per cu)."""
    key = _plan_key(q, k)
    cached = _BATCHED_PLANS.get("cu")
    if cached is None or cached[0]() is not cu or cached[1] != key:
        plan = batching.plan_causal(host_bounds(cu), key[1], q.device)
        cached = _BATCHED_PLANS["cu"] = (weakref.ref(cu), key, plan)
    return batching.run_plan(q, k, v, cached[2], scale, dropout)


def batched_prefix(q, k, v, layout: PrefixLayout, scale: float, dropout: float) -> Tensor:
    """sdpa_prefix's attention, batched into padded calls (plan cached on the layout)."""
    key = ("batched", *_plan_key(q, k))
    plan = layout._device_cache.get(key)
    if plan is None:
        plan = layout._device_cache[key] = batching.plan_prefix(layout, key[2], q.device)
    return batching.run_plan(q, k, v, plan, scale, dropout)


def _plan_key(q: Tensor, k: Tensor) -> tuple[str, float]:
    """What the plan depends on: the device, and one call's cost (H x D, backward or not)."""
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    return (str(q.device), batching.call_cost(q.shape[1] * q.shape[-1], grad))


def _prefix_mask(layout: PrefixLayout, prompt_len: int, n: int, device) -> Tensor:
    """(n, P + n) bool: the whole prompt, then causal over the completion itself."""
    key = ("prefix-mask", prompt_len, n, str(device))
    mask = layout._device_cache.get(key)
    if mask is None:
        rows = torch.arange(n, device=device)[:, None]
        cols = torch.arange(prompt_len + n, device=device)[None, :]
        mask = (cols < prompt_len) | (cols - prompt_len <= rows)
        layout._device_cache[key] = mask
    return mask


def flash_varlen(q, k, v, cu, max_len, scale, dropout) -> Tensor:
    from flash_attn import flash_attn_varlen_func

    q3, k3, v3 = (t[0].transpose(0, 1) for t in (q, k, v))  # (N, heads, D); GQA is native
    out = flash_attn_varlen_func(
        q3, k3, v3, cu, cu, max_len, max_len, dropout_p=dropout, softmax_scale=scale, causal=True
    )
    return out.unsqueeze(0)


def torch_varlen(q, k, v, cu, max_len, scale, dropout) -> Tensor:
    from torch.nn.attention.varlen import varlen_attn

    if dropout > 0:
        raise AttentionSetupError(
            "torch_varlen has no attention dropout; set attention_dropout=0 "
            "or packing.attention_backend=flash_varlen."
        )
    params = inspect.signature(varlen_attn).parameters
    if "enable_gqa" not in params and _gqa(q, k):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    q3, k3, v3 = (t[0].transpose(0, 1) for t in (q, k, v))
    extra: dict[str, Any] = {}
    if "window_size" in params:  # torch >= 2.12: (-1, 0) is causal
        extra["window_size"] = (-1, 0)
    else:
        extra["is_causal"] = True
    if "enable_gqa" in params:
        extra["enable_gqa"] = _gqa(q, k)
    if "scale" in params:
        extra["scale"] = scale
    elif abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        raise AttentionSetupError(
            "this torch's varlen_attn has no scale argument and the model uses "
            "a non-default one; use packing.attention_backend=flex."
        )
    cu = cu.to(torch.int32)
    return varlen_attn(q3, k3, v3, cu, cu, max_len, max_len, **extra).unsqueeze(0)


_FLEX_PLAIN_CACHE: dict[str, Any] = {}


def _flex_call(q, k, v, block_mask, scale, dropout) -> Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    if dropout > 0:
        raise AttentionSetupError(
            "flex attention has no attention dropout; set attention_dropout=0."
        )
    if q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad:
        raise AttentionSetupError(
            "flex attention has no backward on CPU (torch limitation); train on CPU with "
            "packing.attention_backend=sdpa_segments (or auto)."
        )
    fn = flex_attention
    if q.device.type == "cuda":  # fused kernel; on CPU compiling is slow and eager is exact
        if "compiled" not in _FLEX_PLAIN_CACHE:
            _FLEX_PLAIN_CACHE["compiled"] = torch.compile(flex_attention)
        fn = _FLEX_PLAIN_CACHE["compiled"]
    out = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=_gqa(q, k))
    return out.transpose(1, 2)


def _block_mask(mask_mod, n: int, device: torch.device):
    """BlockMask over an (n, n) row; compiled on CUDA (no (n, n) bool tensor in memory)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(
        mask_mod, None, None, n, n, device=device, _compile=device.type == "cuda"
    )


def flex_plain(q, k, v, cu, scale, dropout) -> Tensor:
    """Flex attention with a block-diagonal causal mask, built once per batch (per cu tensor)."""
    cached = _FLEX_PLAIN_CACHE.get("mask")
    if cached is None or cached[0]() is not cu:
        n = q.shape[2]
        doc = torch.searchsorted(
            cu[1:].to(torch.int64),
            torch.arange(n, device=q.device),
            right=True,
        )

        def causal_same_doc(b, h, qi, ki):
            return (doc[qi] == doc[ki]) & (qi >= ki)

        mask = _block_mask(causal_same_doc, n, q.device)
        _FLEX_PLAIN_CACHE["mask"] = cached = (weakref.ref(cu), mask)
    return _flex_call(q, k, v, cached[1], scale, dropout)


def flex_prefix(q, k, v, layout: PrefixLayout, scale, dropout) -> Tensor:
    """Flex attention over the shared-prefix layout; the BlockMask is cached on the layout."""
    key = ("flex-mask", str(q.device))
    mask = layout._device_cache.get(key)
    if mask is None:
        group_of, segment_of, is_prompt = layout.segment_ids(q.device)

        def prompt_or_own(b, h, qi, ki):
            same_seg = segment_of[qi] == segment_of[ki]
            return (group_of[qi] == group_of[ki]) & (qi >= ki) & (is_prompt[ki] | same_seg)

        n = layout.num_tokens
        mask = layout._device_cache[key] = _block_mask(prompt_or_own, n, q.device)
    return _flex_call(q, k, v, mask, scale, dropout)
