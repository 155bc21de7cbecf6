"""Each packed kernel against a dense float64 masked-softmax reference."""

from __future__ import annotations

import pytest
import torch
from test_packing import make_samples

from leangrpo import attention_kernels as kernels
from leangrpo.packing import pack_samples

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
