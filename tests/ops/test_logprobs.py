"""Chunked lm_head log-probs against the full-logits reference in float64."""

from __future__ import annotations

import math

import pytest
import torch

from leangrpo.ops.logprobs.api import chunked_logprobs, naive_logprobs, token_logprobs

F64 = torch.float64


def make_inputs(n, h, v, *, bias=True, seed=0, dtype=F64, scale=1.0):
    """Hidden (n, h), weight (v, h), bias (v,) with logits of std ~ 2 * scale."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=F64)
    weight = torch.randn(v, h, generator=g, dtype=F64) * (2.0 * scale / math.sqrt(h))
    b = torch.randn(v, generator=g, dtype=F64) if bias else None
    cast = [t.to(dtype).requires_grad_() if t is not None else None for t in (hidden, weight, b)]
    return (*cast, g)


def kept_targets(hidden, weight, bias, g, **filters):
    """One target per row drawn among the tokens that survive the filters (never -inf)."""
    with torch.no_grad():
        z = torch.nn.functional.linear(
            hidden.double(), weight.double(), None if bias is None else bias.double()
        )
        t = filters.get("temperature", 1.0)
        logp = naive_full_logp(z / t, filters.get("top_k", 0), filters.get("min_p", 0.0))
    return torch.multinomial(logp.exp(), 1, generator=g).squeeze(1)


def naive_full_logp(z, top_k, min_p):
    thr = torch.full_like(z[:, 0], -math.inf)
    if 0 < top_k < z.shape[1]:
        thr = z.topk(top_k, dim=1).values[:, -1]
    if min_p > 0:
        thr = torch.maximum(thr, z.amax(1) + math.log(min_p))
    return z.masked_fill(z < thr[:, None], -math.inf).log_softmax(1)


def value_and_grads(fn, hidden, weight, bias, targets, **kw):
    """Values and grads of a loss mixing log-probs and entropy with fixed random weights."""
    lp, ent = fn(hidden, weight, targets, bias, **kw)
    n = hidden.shape[0]
    w_lp = torch.linspace(-1.0, 2.0, n, dtype=lp.dtype, device=lp.device)
    loss = (lp * w_lp).sum()
    if ent is not None:
        loss = loss + (ent * torch.linspace(1.0, -0.5, n, dtype=ent.dtype, device=ent.device)).sum()
    params = [p for p in (hidden, weight, bias) if p is not None and p.requires_grad]
    grads = torch.autograd.grad(loss, params)
    return lp, ent, grads


def assert_close_to_reference(
    n, h, v, row_tile, vocab_tile, dtype, rtol, atol, *, bias=True, with_entropy=True, **filters
):
    hidden, weight, b, g = make_inputs(n, h, v, bias=bias, dtype=dtype)
    targets = kept_targets(hidden, weight, b, g, **filters)
    ref = [
        t.detach().double().requires_grad_() if t is not None else None for t in (hidden, weight, b)
    ]
    lp_ref, ent_ref, grads_ref = value_and_grads(
        naive_logprobs, *ref, targets, with_entropy=with_entropy, **filters
    )
    lp, ent, grads = value_and_grads(
        chunked_logprobs,
        hidden,
        weight,
        b,
        targets,
        with_entropy=with_entropy,
        row_tile=row_tile,
        vocab_tile=vocab_tile,
        **filters,
    )
    assert lp.dtype == (F64 if dtype == F64 else torch.float32)
    assert torch.isfinite(lp).all()
    torch.testing.assert_close(lp.double(), lp_ref, rtol=rtol, atol=atol)
    if with_entropy:
        torch.testing.assert_close(ent.double(), ent_ref, rtol=rtol, atol=atol)
    else:
        assert ent is None
    for got, want in zip(grads, grads_ref):
        assert got.dtype == dtype
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol * max(scale, 1.0))


CASES = [  # n, h, v, row_tile, vocab_tile, filters
    (37, 16, 101, 8, 13, {}),  # neither N nor V divisible by its tile
    (40, 16, 96, 40, 96, {}),  # one tile each way
    (25, 8, 64, 7, 1000, {"temperature": 0.7}),  # vocab tile larger than V
    (33, 16, 211, 5, 50, {"temperature": 1.6, "top_k": 7}),
    (33, 16, 211, 16, 17, {"top_k": 60}),  # k larger than the vocab tile
    (30, 16, 150, 9, 32, {"min_p": 0.05}),
    (30, 16, 150, 9, 32, {"temperature": 0.9, "top_k": 20, "min_p": 0.1}),
    (12, 8, 40, 4, 8, {"top_k": 40}),  # k == V: no filter
]


@pytest.mark.parametrize("n,h,v,row_tile,vocab_tile,filters", CASES)
def test_float64_matches_reference(n, h, v, row_tile, vocab_tile, filters):
    assert_close_to_reference(n, h, v, row_tile, vocab_tile, F64, 1e-9, 1e-10, **filters)


@pytest.mark.parametrize("n,h,v,row_tile,vocab_tile,filters", CASES[::2])
def test_float32_matches_reference(n, h, v, row_tile, vocab_tile, filters):
    assert_close_to_reference(n, h, v, row_tile, vocab_tile, torch.float32, 1e-4, 1e-5, **filters)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_tolerance(dtype):
    assert_close_to_reference(64, 32, 300, 16, 64, dtype, 3e-2, 3e-2, top_k=50)


def test_half_precision_matches_naive_in_same_dtype():
    """Same bf16 matmul, fp32 log-sum-exp: chunked and naive agree far below bf16 resolution."""
    hidden, weight, b, g = make_inputs(50, 32, 257, dtype=torch.bfloat16)
    targets = torch.randint(0, 257, (50,), generator=g)
    lp_ref, ent_ref = naive_logprobs(hidden, weight, targets, b, with_entropy=True)
    lp, ent = chunked_logprobs(
        hidden, weight, targets, b, with_entropy=True, row_tile=50, vocab_tile=64
    )
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=1e-5)


def test_without_bias_and_without_entropy():
    assert_close_to_reference(
        21, 8, 77, 6, 20, F64, 1e-9, 1e-10, bias=False, with_entropy=False, top_k=9
    )


def test_gradcheck_float64():
    hidden, weight, b, g = make_inputs(6, 4, 23, dtype=F64)
    targets = torch.randint(0, 23, (6,), generator=g)

    def fn(hd, w, bb):
        return chunked_logprobs(
            hd, w, targets, bb, temperature=0.8, with_entropy=True, row_tile=4, vocab_tile=5
        )

    assert torch.autograd.gradcheck(fn, (hidden, weight, b))


def test_tied_weights_accumulate_both_paths():
    """lm_head tied to the input embedding: its grad sums the embedding and the head path."""
    v, h, n = 90, 16, 29
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, v, (n,), generator=gen)
    targets = torch.randint(0, v, (n,), generator=gen)
    init = torch.randn(v, h, generator=gen, dtype=F64)
    proj = torch.randn(h, h, generator=gen, dtype=F64) / 4
    grads = []
    for fn, kw in [(naive_logprobs, {}), (chunked_logprobs, {"row_tile": 8, "vocab_tile": 16})]:
        emb = torch.nn.Embedding(v, h, dtype=F64)
        emb.weight.data.copy_(init)
        hidden = torch.tanh(emb(ids) @ proj)
        lp, _ = fn(hidden, emb.weight, targets, temperature=1.2, **kw)
        lp.sum().backward()
        grads.append(emb.weight.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-9, atol=1e-12)
    assert grads[1][ids].abs().sum() > 0


def test_frozen_weight_gives_only_hidden_grad():
    hidden, weight, b, g = make_inputs(20, 8, 50, dtype=F64)
    weight.requires_grad_(False)
    b.requires_grad_(False)
    targets = torch.randint(0, 50, (20,), generator=g)
    lp_ref, _ = naive_logprobs(hidden, weight, targets, b)
    (g_ref,) = torch.autograd.grad(lp_ref.sum(), hidden)
    lp, _ = chunked_logprobs(hidden, weight, targets, b, row_tile=6, vocab_tile=7)
    lp.sum().backward()
    torch.testing.assert_close(hidden.grad, g_ref, rtol=1e-9, atol=1e-12)
    assert weight.grad is None and b.grad is None


def test_filtered_target_is_minus_inf_and_gets_no_onehot_grad():
    hidden, weight, b, g = make_inputs(10, 8, 60, dtype=F64, scale=3.0)
    with torch.no_grad():
        z = torch.nn.functional.linear(hidden, weight, b)
    targets = z.argmin(1)  # the least likely token: always outside the top 5
    lp, _ = chunked_logprobs(hidden, weight, targets, b, top_k=5, row_tile=4, vocab_tile=16)
    lp_ref, _ = naive_logprobs(hidden, weight, targets, b, top_k=5)
    assert torch.isneginf(lp).all() and torch.isneginf(lp_ref).all()
    upstream = torch.linspace(0.5, 1.5, 10, dtype=F64)
    (gh,) = torch.autograd.grad(lp, hidden, upstream)
    (gh_ref,) = torch.autograd.grad(lp_ref, hidden, upstream)
    assert torch.isfinite(gh).all()
    torch.testing.assert_close(gh, gh_ref, rtol=1e-9, atol=1e-12)


def test_top_k_keeps_ties_across_tiles():
    """Tied logits at the k-th value (common in bf16) stay in, even split over vocab tiles."""
    hidden, weight, _, g = make_inputs(8, 8, 40, bias=False, dtype=F64)
    with torch.no_grad():
        weight[20:24] = weight[3]  # tokens 3, 20..23 share a logit in every row
        top = naive_full_logp(hidden @ weight.T, 0, 0.0).argsort(1, descending=True)
    targets = top[:, 0]
    for k in (1, 2, 3, 5, 6):
        lp, _ = chunked_logprobs(hidden, weight, targets, top_k=k, row_tile=3, vocab_tile=7)
        lp_ref, _ = naive_logprobs(hidden, weight, targets, top_k=k)
        torch.testing.assert_close(lp, lp_ref, rtol=1e-12, atol=1e-12)


def saved_extra_bytes(n, v, h=16, **kw):
    """Bytes saved for backward that are not the inputs themselves."""
    hidden, weight, b, g = make_inputs(n, h, v, dtype=torch.float32)
    targets = torch.randint(0, v, (n,), generator=g)
    inputs = {t.data_ptr() for t in (hidden, weight, b, targets)}
    extra = []

    def pack(t):
        if t.data_ptr() not in inputs:
            extra.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = chunked_logprobs(hidden, weight, targets, b, row_tile=40, vocab_tile=300, **kw)
    loss = lp.sum() + (ent.sum() if ent is not None else 0)
    loss.backward()  # the graph is usable
    return sum(extra)


@pytest.mark.parametrize(
    "kw,floats_per_row",
    [
        ({}, 1),  # log-normaliser
        ({"with_entropy": True}, 2),  # + entropy
        ({"top_k": 5, "min_p": 0.1}, 2),  # + threshold
        ({"top_k": 5, "with_entropy": True}, 3),
    ],
)
def test_saved_bytes_are_per_row_not_per_logit(kw, floats_per_row):
    n = 100
    small = saved_extra_bytes(n, 600, **kw)
    large = saved_extra_bytes(n, 2000, **kw)
    assert small == large == n * 4 * floats_per_row


def test_no_grad_saves_nothing_and_matches():
    hidden, weight, b, g = make_inputs(30, 8, 70, dtype=F64)
    targets = torch.randint(0, 70, (30,), generator=g)
    packed = []
    with (
        torch.no_grad(),
        torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t),
    ):
        lp, ent = chunked_logprobs(
            hidden, weight, targets, b, with_entropy=True, row_tile=7, vocab_tile=9, min_p=0.01
        )
    assert packed == [] and lp.grad_fn is None and ent.grad_fn is None
    lp_ref, ent_ref = naive_logprobs(hidden, weight, targets, b, with_entropy=True, min_p=0.01)
    torch.testing.assert_close(lp, lp_ref.detach())
    torch.testing.assert_close(ent, ent_ref.detach())


def test_token_logprobs_dispatch():
    hidden, weight, b, g = make_inputs(9, 8, 30, dtype=F64)
    targets = torch.randint(0, 30, (9,), generator=g)
    a, _ = token_logprobs(hidden, weight, targets, b, chunked=True, vocab_tile=4, temperature=2.0)
    c, _ = token_logprobs(hidden, weight, targets, b, chunked=False, temperature=2.0)
    torch.testing.assert_close(a, c)


def test_empty_batch():
    hidden, weight, b, _ = make_inputs(0, 8, 30, dtype=torch.float32)
    lp, ent = chunked_logprobs(
        hidden, weight, torch.zeros(0, dtype=torch.long), b, with_entropy=True
    )
    assert lp.shape == ent.shape == (0,)
    lp.sum().backward()
    assert hidden.grad.shape == (0, 8) and weight.grad.abs().sum() == 0


@pytest.mark.parametrize(
    "change,message",
    [
        ({"hidden": torch.zeros(2, 3, 8)}, "hidden must be"),
        ({"weight": torch.zeros(30, 7)}, "hidden must be"),
        ({"hidden": torch.zeros(4, 8, dtype=torch.long)}, "floating point"),
        ({"targets": torch.zeros(3, dtype=torch.long)}, "targets must be"),
        ({"targets": torch.full((4,), 30)}, r"token ids in \[0, 30\)"),
        ({"targets": torch.full((4,), -100)}, "ignore ids"),
        ({"bias": torch.zeros(29)}, "bias must"),
        ({"temperature": 0.0}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.0}, "min_p"),
        ({"vocab_tile": 0}, "vocab_tile"),
    ],
)
@pytest.mark.parametrize("fn", [chunked_logprobs, naive_logprobs])
def test_bad_input_is_one_clear_error(fn, change, message):
    args = {
        "hidden": torch.zeros(4, 8),
        "weight": torch.zeros(30, 8),
        "targets": torch.zeros(4, dtype=torch.long),
        "bias": None,
    }
    options = dict(change)  # the parametrised dict is shared between both fns
    args.update({k: options.pop(k) for k in list(options) if k in args})
    with pytest.raises((ValueError, TypeError), match=message):
        fn(args["hidden"], args["weight"], args["targets"], args["bias"], **options)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_matches_reference(dtype):
    # top-k only in fp32: bf16 logits from differently shaped matmuls may differ by an ulp,
    # which can move a token across the threshold (a tie-break, not an error)
    filters = {"top_k": 100} if dtype == torch.float32 else {}
    hidden, weight, b, g = make_inputs(300, 64, 5000, dtype=dtype)
    targets = kept_targets(hidden, weight, b, g, **filters).cuda()
    cuda = [t.detach().cuda().requires_grad_() for t in (hidden, weight, b)]
    ref = value_and_grads(naive_logprobs, *cuda, targets, with_entropy=True, **filters)
    got = value_and_grads(
        chunked_logprobs,
        *cuda,
        targets,
        with_entropy=True,
        row_tile=128,
        vocab_tile=1024,
        **filters,
    )
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got[0], ref[0], rtol=tol, atol=tol)
    torch.testing.assert_close(got[1], ref[1], rtol=tol, atol=tol)
    for g_got, g_ref in zip(got[2], ref[2]):
        scale = g_ref.abs().max().item()
        torch.testing.assert_close(g_got.float(), g_ref.float(), rtol=tol, atol=tol * scale)


def test_default_tiles_span_several_tiles():
    """No tile sizes given: the device defaults (CPU: 4096 x 2048) still give exact values."""
    hidden, weight, b, g = make_inputs(4100, 4, 2100, dtype=F64)
    targets = torch.randint(0, 2100, (4100,), generator=g)
    with torch.no_grad():
        lp, ent = chunked_logprobs(hidden, weight, targets, b, with_entropy=True)
        lp_ref, ent_ref = naive_logprobs(hidden, weight, targets, b, with_entropy=True)
    torch.testing.assert_close(lp, lp_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-10, atol=1e-10)


def test_autocast_matmul_in_autocast_dtype_forward_and_backward():
    """Under autocast the lm_head matmul runs in bf16 in both passes, like nn.Linear would."""
    hidden, weight, b, g = make_inputs(40, 32, 300, dtype=torch.float32)
    targets = torch.randint(0, 300, (40,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent, grads = value_and_grads(
            chunked_logprobs,
            hidden,
            weight,
            b,
            targets,
            with_entropy=True,
            row_tile=16,
            vocab_tile=64,
        )
    cast = [t.detach().bfloat16().requires_grad_() for t in (hidden, weight, b)]
    lp_bf16, ent_bf16, _ = value_and_grads(naive_logprobs, *cast, targets, with_entropy=True)
    torch.testing.assert_close(lp, lp_bf16, rtol=1e-5, atol=1e-5)  # same bf16 logits
    torch.testing.assert_close(ent, ent_bf16, rtol=1e-5, atol=1e-5)
    ref = [t.detach().double().requires_grad_() for t in (hidden, weight, b)]
    _, _, grads_ref = value_and_grads(naive_logprobs, *ref, targets, with_entropy=True)
    for got, want in zip(grads, grads_ref):
        assert got.dtype == torch.float32
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2 * scale)


def _backward_both_orders(dtype_h, dtype_w, **kw):
    """Gradients of one chunked backward with rows outer and with the vocabulary outer."""
    from leangrpo.ops.logprobs.api import _validate
    from leangrpo.ops.logprobs.tiles import _backward, _forward

    hidden, weight, bias, g = make_inputs(37, 16, 90, seed=3)
    hidden, weight = hidden.detach().to(dtype_h), weight.detach().to(dtype_w)
    bias = bias.detach().to(dtype_w)
    targets = torch.randint(0, 90, (37,), generator=g)
    spec = _validate(hidden, weight, targets, bias, 0.8, kw.get("top_k", 0), 0.0, True, 8, 32)
    _, log_z, thr, entropy = _forward(hidden, weight, targets, bias, spec)
    g_lp = torch.randn(37, generator=g)
    g_ent = torch.randn(37, generator=g)
    args = (hidden, weight, targets, bias, (log_z, thr, entropy), g_lp, g_ent, spec)
    rows = _backward(*args, (True, True, True), vocab_outer=False)
    vocab = _backward(*args, (True, True, True), vocab_outer=True)
    return rows, vocab


@pytest.mark.parametrize("top_k", [0, 5])
def test_vocab_outer_backward_equals_rows_outer(top_k):
    rows, vocab = _backward_both_orders(torch.float32, torch.bfloat16, top_k=top_k)
    assert vocab.weight.dtype == torch.bfloat16  # written straight into the weight's dtype
    torch.testing.assert_close(vocab.weight, rows.weight.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(vocab.hidden, rows.hidden, rtol=0, atol=0)
    torch.testing.assert_close(vocab.bias, rows.bias, rtol=0, atol=0)


def _large_fp32_allocations(fn, limit: int) -> list[tuple]:
    """(shape, dtype) of every fp32 tensor of >= limit elements that fn's ops produce."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() >= limit:
                    seen.append((tuple(t.shape), t.dtype))
            return out

    with Record():
        fn()
    return seen


def test_trained_bf16_head_gets_no_full_fp32_gradient_copy(monkeypatch):
    """A bf16 lm_head that requires grad (as FSDP gathers it under mixed precision) never
    gets a (V, H) fp32 gradient buffer; forcing the other loop order shows the check bites."""
    from leangrpo.ops.logprobs import tiles as lp_mod

    v, h, n = 512, 16, 24
    hidden, weight, _, g = make_inputs(n, h, v, bias=False, dtype=torch.bfloat16)
    targets = torch.randint(0, v, (n,), generator=g)

    def run():
        lp, _ = chunked_logprobs(hidden, weight, targets, row_tile=8, vocab_tile=64)
        lp.sum().backward()

    assert _large_fp32_allocations(run, v * h) == []
    assert weight.grad.dtype == torch.bfloat16
    monkeypatch.setattr(lp_mod, "_vocab_outer_is_smaller", lambda *a: False)
    assert (v, h) in [s for s, _ in _large_fp32_allocations(run, v * h)]
