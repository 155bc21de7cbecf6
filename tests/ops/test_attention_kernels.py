"""Each packed kernel against a dense float64 masked-softmax reference."""

from __future__ import annotations

import pytest
import torch
from support.samples import make_samples

from leangrpo.ops.attention import batching, kernels
from leangrpo.train.packing import pack_samples

SPEC = [(5, [3, 1, 7]), (9, [2, 4]), (1, [1])]


def dense_reference(q, k, v, allowed, scale):
    """(1, N, H, D) float64: softmax(q k^T * scale) over `allowed` (N, N), GQA by repeat."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def plain_mask(cu, n):
    doc = torch.searchsorted(cu[1:].long(), torch.arange(n), right=True)
    idx = torch.arange(n)
    return (doc[:, None] == doc[None, :]) & (idx[:, None] >= idx[None, :])


def prefix_mask(layout, n):
    """Loops over the spans: prompts causal; a completion sees its prompt and its own past."""
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for g in layout.groups:
        p0, p1 = g.prompt_start, g.prompt_start + g.prompt_len
        allowed[p0:p1, p0:p1] = torch.ones(g.prompt_len, g.prompt_len, dtype=torch.bool).tril()
        for c0, m in zip(g.completion_starts, g.completion_lens):
            allowed[c0 : c0 + m, p0:p1] = True
            allowed[c0 : c0 + m, c0 : c0 + m] = torch.ones(m, m, dtype=torch.bool).tril()
    return allowed


def qkv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, 4, n, 8, generator=g),
        torch.randn(1, 2, n, 8, generator=g),
        torch.randn(1, 2, n, 8, generator=g),
    )


@pytest.mark.parametrize("kernel", ["sdpa_segments", "flex_plain"])
def test_plain_kernels(kernel):
    batch = pack_samples(make_samples(SPEC))
    n, cu = batch.num_tokens, batch.cu_seqlens
    q, k, v = qkv(n)
    want = dense_reference(q, k, v, plain_mask(cu, n), 0.3)
    with torch.no_grad():
        if kernel == "sdpa_segments":
            got = kernels.sdpa_segments(q, k, v, kernels.host_bounds(cu), 0.3, 0.0)
        else:
            got = kernels.flex_plain(q, k, v, cu, 0.3, 0.0)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["sdpa_prefix", "flex_prefix"])
def test_prefix_kernels(kernel):
    batch = pack_samples(make_samples(SPEC), shared_prefix=True)
    layout = batch.prefix
    q, k, v = qkv(layout.num_tokens, seed=1)
    want = dense_reference(q, k, v, prefix_mask(layout, layout.num_tokens), 0.3)
    with torch.no_grad():
        got = getattr(kernels, kernel)(q, k, v, layout, 0.3, 0.0)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------- batched SDPA (attention_batching)

MIXED = [(3, [1, 1, 9, 2]), (17, [4, 4, 4]), (1, [25]), (8, [1]), (30, [2, 6, 6, 1, 3])]


def plan_for(batch, per_call):
    if getattr(batch, "prefix", None) is not None:
        return batching.plan_prefix(batch.prefix, per_call, "cpu")
    return batching.plan_causal(kernels.host_bounds(batch.cu_seqlens), per_call, "cpu")


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("per_call", [0.0, 40.0, 1e12])  # mostly views, mixed, one bucket
def test_batched_layout_equals_reference_values_and_grads(shared, per_call):
    batch = pack_samples(make_samples(MIXED, seed=3), shared_prefix=shared)
    n = batch.num_tokens
    allowed = prefix_mask(batch.prefix, n) if shared else plain_mask(batch.cu_seqlens, n)
    plan = plan_for(batch, per_call)
    kinds = {isinstance(c, batching.Bucket) for c in plan.calls}
    if per_call == 40.0:
        assert kinds == {True, False}  # views and buckets in one plan
    q, k, v = (t.double().requires_grad_() for t in qkv(n, seed=4))
    got = batching.run_plan(q, k, v, plan, 0.3, 0.0)
    want = dense_reference(q, k, v, allowed, 0.3)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    w = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    got_grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * w).sum(), (q, k, v))
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("shared", [False, True])
def test_batched_equals_per_segment_sdpa_fp32(shared):
    """What the sdpa_segments backend runs equals the per-segment loop within fp32 noise."""
    batch = pack_samples(make_samples(MIXED, seed=6), shared_prefix=shared)
    q, k, v = (t.requires_grad_() for t in qkv(batch.num_tokens, seed=7))
    if shared:
        got = kernels.batched_prefix(q, k, v, batch.prefix, 0.3, 0.0)
        want = kernels.sdpa_prefix(q, k, v, batch.prefix, 0.3, 0.0)
    else:
        got = kernels.batched_segments(q, k, v, batch.cu_seqlens, 0.3, 0.0)
        want = kernels.sdpa_segments(q, k, v, kernels.host_bounds(batch.cu_seqlens), 0.3, 0.0)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(8))
    for a, b in zip(
        torch.autograd.grad((got * w).sum(), (q, k, v)),
        torch.autograd.grad((want * w).sum(), (q, k, v)),
    ):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_batching_rule():
    """Equal lengths share a call; a long segment among short ones keeps its own; the cap."""
    assert batching.group_causal([5, 5, 5, 5], per_call=0.0) == [[0, 1, 2, 3]]
    calls = batching.group_causal([4, 300, 5, 3, 4], per_call=100.0)
    assert calls[0] == [1] and sorted(calls[1]) == [0, 2, 3, 4]
    assert len(batching.group_causal([4, 300, 5, 3, 4], per_call=1e9)) == 1
    assert len(batching.group_causal([4096] * 3, per_call=1e12)) == 3  # 3 x 4096^2 > the cap
    # completions of one prompt length share a call; another prompt length of similar area too
    assert batching.group_prefix([(6, 3), (6, 4), (7, 3)], per_call=50.0) == [[1, 2, 0]]
    assert len(batching.group_prefix([(200, 5), (6, 3)], per_call=50.0)) == 2


def test_batched_plan_is_built_once_per_batch():
    batch = pack_samples(make_samples(MIXED))
    q, k, v = qkv(batch.num_tokens)
    with torch.no_grad():
        kernels.batched_segments(q, k, v, batch.cu_seqlens, 0.3, 0.0)
        first = kernels._BATCHED_PLANS["cu"][2]
        kernels.batched_segments(q, k, v, batch.cu_seqlens, 0.3, 0.0)
        assert kernels._BATCHED_PLANS["cu"][2] is first
