"""The packed-attention adapter against padded references (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from support.models import make_tiny_model
from support.samples import make_samples

from leangrpo.errors import UserError
from leangrpo.ops.attention import batching as attention_batching
from leangrpo.ops.attention.adapter import (
    choose_shared_prefix,
    enable_packed_attention,
    packed_model_kwargs,
    packed_support,
    register_packed_attention,
    resolve_backend,
)
from leangrpo.ops.attention.kernels import PackedAttentionError
from leangrpo.train.packing import pack_samples

TOL = 2e-5
DISTRIBUTIONS = {
    "mixed": [(5, [3, 1, 7]), (9, [2, 4]), (1, [1])],
    "length_one_completions": [(6, [1, 1, 1]), (3, [1])],
    "one_long": [(4, [2, 3]), (40, [150]), (2, [1])],
}


def packed_logprobs(model, batch):
    out = model.model(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        use_cache=False,
        **packed_model_kwargs(batch),
    )
    hidden = out.last_hidden_state[0].index_select(0, batch.completion_index)
    logits = model.lm_head(hidden)
    return torch.log_softmax(logits, -1).gather(-1, batch.targets[:, None])[:, 0]


def padded_logprobs(model, samples, side):
    """Ordinary batch forward: padded rows, attention_mask, position ids from the mask."""
    seqs = [s.prompt.ids + s.completion.ids for s in samples]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, seq in enumerate(seqs):
        sl = slice(width - len(seq), width) if side == "left" else slice(0, len(seq))
        ids[i, sl], mask[i, sl] = torch.tensor(seq), 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False
    ).logits
    out = []
    for i, (s, seq) in enumerate(zip(samples, seqs)):
        start = width - len(seq) if side == "left" else 0
        p, r = len(s.prompt.ids), len(s.completion.ids)
        rows = logits[i, start + p - 1 : start + p + r - 1].log_softmax(-1)
        out.append(rows.gather(-1, torch.tensor(s.completion.ids)[:, None])[:, 0])
    return torch.cat(out)


def grads_of(model, logprobs, weights):
    model.zero_grad()
    (logprobs * weights).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_close_grads(a, b, tol=TOL):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=tol, rtol=1e-4, msg=name)


@pytest.fixture(params=["qwen2", "llama"])
def models(request):
    """(reference with plain sdpa, same weights with the adapter) in train mode (no dropout)."""
    ref = make_tiny_model(request.param).train()
    packed = make_tiny_model(request.param).train()
    enable_packed_attention(packed, "sdpa_segments")
    return ref, packed


@pytest.fixture(params=["measured", "views", "one_call"])
def batching_rule(request, monkeypatch):
    """The sdpa_segments backend's batching: the measured cost model, or forced to its ends
    (one SDPA call per segment except equal lengths; everything in one padded call)."""
    if request.param != "measured":
        cost = 0.0 if request.param == "views" else 1e15
        monkeypatch.setattr(attention_batching, "CALL_COST_GRAD", cost)
        monkeypatch.setattr(attention_batching, "CALL_COST_NO_GRAD", cost)
    return request.param


@pytest.mark.parametrize("dist", list(DISTRIBUTIONS))
def test_packed_equals_padded(models, dist, batching_rule):
    ref, packed = models
    samples = make_samples(DISTRIBUTIONS[dist])
    batch = pack_samples(samples)
    got = packed_logprobs(packed, batch)
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))
    got_grads = grads_of(packed, got, weights)
    for side in ("left", "right"):
        want = padded_logprobs(ref, samples, side)
        torch.testing.assert_close(got, want, atol=TOL, rtol=1e-5)
        assert_close_grads(got_grads, grads_of(ref, want, weights))


@pytest.mark.parametrize("backend", ["sdpa_segments", "flex"])
def test_shared_prefix_equals_plain_packed(backend, batching_rule):
    model = make_tiny_model("qwen2").train()
    samples = make_samples([(7, [3, 1, 5]), (12, [2, 6, 1, 1]), (1, [4])], seed=2)
    enable_packed_attention(model, "sdpa_segments")
    plain = packed_logprobs(model, pack_samples(samples))
    weights = torch.randn(plain.shape, generator=torch.Generator().manual_seed(1))
    want_grads = grads_of(model, plain, weights)
    enable_packed_attention(model, backend)
    shared = pack_samples(samples, shared_prefix=True)
    assert shared.num_tokens < sum(s.num_tokens for s in samples)
    if backend == "flex":  # no flex backward on CPU: forward only
        with torch.no_grad():
            got = packed_logprobs(model, shared)
        torch.testing.assert_close(got, plain.detach(), atol=TOL, rtol=1e-5)
        with pytest.raises(PackedAttentionError, match="no backward on CPU") as err:
            packed_logprobs(model, shared)
        assert isinstance(err.value, UserError)  # a setting to change: one sentence, exit 2
    else:
        got = packed_logprobs(model, shared)
        torch.testing.assert_close(got, plain, atol=TOL, rtol=1e-5)
        assert_close_grads(grads_of(model, got, weights), want_grads)
    enable_packed_attention(model, "sdpa_segments")


def test_flex_plain_equals_segments():
    model = make_tiny_model("llama")
    batch = pack_samples(make_samples(DISTRIBUTIONS["mixed"]))
    enable_packed_attention(model, "sdpa_segments")
    want = packed_logprobs(model, batch)
    enable_packed_attention(model, "flex")
    with torch.no_grad():
        got = packed_logprobs(model, batch)
    torch.testing.assert_close(got, want.detach(), atol=TOL, rtol=1e-5)
    enable_packed_attention(model, "sdpa_segments")


def test_kv_cache_guard():
    """transformers' own SDPA leaks across sequences with a cache; the adapter refuses."""
    samples = make_samples(DISTRIBUTIONS["mixed"])
    batch = pack_samples(samples)
    ref = make_tiny_model("qwen2")
    want = padded_logprobs(ref, samples, "right")

    def builtin(use_cache):
        out = ref(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=use_cache)
        rows = out.logits[0, batch.completion_index].log_softmax(-1)
        return rows.gather(-1, batch.targets[:, None])[:, 0]

    torch.testing.assert_close(builtin(False), want, atol=TOL, rtol=1e-5)
    assert (builtin(True) - want).abs().max() > 1e-2  # the leak the guard exists for

    model = make_tiny_model("qwen2")
    enable_packed_attention(model, "sdpa_segments")
    with pytest.raises(PackedAttentionError, match="use_cache"):
        model.model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            use_cache=True,
            **packed_model_kwargs(batch),
        )
    with pytest.raises(PackedAttentionError, match="use_cache"):  # packed position ids alone
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=True)
    torch.testing.assert_close(packed_logprobs(model, batch), want, atol=TOL, rtol=1e-5)
    # without packed kwargs, restarting position ids get transformers' block mask
    out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
    rows = out.logits[0, batch.completion_index].log_softmax(-1)
    torch.testing.assert_close(
        rows.gather(-1, batch.targets[:, None])[:, 0], want, atol=TOL, rtol=1e-5
    )


def test_generation_delegates_to_sdpa():
    ref = make_tiny_model("qwen2")
    model = make_tiny_model("qwen2")
    enable_packed_attention(model, "sdpa_segments")
    ids = torch.randint(1, 64, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4], mask[1, :1] = 0, 0  # left padding
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    want, got = ref.generate(ids, **kwargs), model.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


class TinyOpaqueLM(torch.nn.Module):
    """A backbone whose attention ignores packed kwargs (outside transformers' interface)."""

    def __init__(self, vocab=32, dim=16):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(64, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, input_ids, position_ids, attention_mask=None, **kwargs):
        from transformers.modeling_outputs import BaseModelOutput

        x = self.embed(input_ids) + self.pos(position_ids)
        q, k, v = self.qkv(x).chunk(3, -1)
        n = x.shape[1]
        allowed = torch.ones(n, n, dtype=torch.bool).tril()[None]
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, None, :].bool()
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return BaseModelOutput(last_hidden_state=out)


def test_padded_view_for_models_outside_the_interface():
    model = TinyOpaqueLM()
    samples = make_samples([(3, [2, 4]), (5, [1])], vocab=32)
    enable_packed_attention(model, "sdpa_segments")
    support = packed_support(model)
    assert support.padded_view and not support.packed_kwargs
    batch = pack_samples(samples)
    got = model(
        input_ids=batch.input_ids, position_ids=batch.position_ids, **packed_model_kwargs(batch)
    ).last_hidden_state
    assert got.shape[:2] == (1, batch.num_tokens)
    bounds = batch.cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        alone = model(input_ids=batch.input_ids[:, a:b], position_ids=batch.position_ids[:, a:b])
        torch.testing.assert_close(got[:, a:b], alone.last_hidden_state, atol=1e-6, rtol=1e-6)
    with pytest.raises(PackedAttentionError, match="shared_prefix=off"):
        model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            **packed_model_kwargs(pack_samples(samples, shared_prefix=True)),
        )


def test_backend_selection_and_errors():
    assert resolve_backend("auto", "cpu") == "sdpa_segments"
    assert register_packed_attention("auto", "cpu") == "leangrpo_packed"
    with pytest.raises(PackedAttentionError, match="needs a CUDA device") as err:
        resolve_backend("flash_varlen", "cpu")
    assert isinstance(err.value, UserError)
    with pytest.raises(PackedAttentionError, match="unknown attention backend"):
        resolve_backend("magic", "cpu")
    assert choose_shared_prefix("off", "flex") is False
    assert choose_shared_prefix("on", "sdpa_segments") is True
    assert choose_shared_prefix("on", "flash_varlen") is False  # falls back to plain packing
    assert choose_shared_prefix("auto", "sdpa_segments", {"prompt_fraction": 0.5, "group_size": 8})
    assert not choose_shared_prefix(
        "auto", "sdpa_segments", {"prompt_fraction": 0.05, "group_size": 8}
    )
    assert not choose_shared_prefix("auto", "flex", {"prompt_fraction": 0.5, "group_size": 8})
    assert not choose_shared_prefix("auto", "sdpa_segments", {"prompt_fraction": 0.5})
    with pytest.raises(ValueError, match="auto, on or off"):
        choose_shared_prefix("yes", "flex")


def test_peft_wrapped_model():
    from peft import LoraConfig, get_peft_model

    samples = make_samples(DISTRIBUTIONS["mixed"])
    ref = make_tiny_model("llama")
    want = padded_logprobs(ref, samples, "left")
    lora = get_peft_model(
        make_tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    enable_packed_attention(lora, "sdpa_segments")
    assert lora.get_base_model().config._attn_implementation == "leangrpo_packed"
    assert packed_support(lora).packed_kwargs
    got = packed_logprobs(lora.get_base_model(), pack_samples(samples))  # LoRA B = 0 at init
    torch.testing.assert_close(got, want, atol=TOL, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash_varlen", "torch_varlen", "flex"])
def test_cuda_backends_match_segments(backend):
    """bf16 on CUDA: each kernel against per-segment SDPA (plain and shared prefix)."""
    from leangrpo.ops.attention.adapter import backend_unavailable_reason

    if backend_unavailable_reason(backend, "cuda") is not None:
        pytest.skip(backend_unavailable_reason(backend, "cuda"))
    model = make_tiny_model("qwen2", hidden_size=64, dtype=torch.bfloat16).cuda()
    samples = make_samples(DISTRIBUTIONS["one_long"])
    plain = pack_samples(samples, device="cuda")
    prefix = pack_samples(samples, shared_prefix=True, device="cuda")
    enable_packed_attention(model, "sdpa_segments")
    with torch.no_grad():
        want = packed_logprobs(model, plain).float()
    enable_packed_attention(model, backend)
    got = packed_logprobs(model.train(), plain)
    torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=5e-2)
    got.sum().backward()  # the kernel has a backward on CUDA
    if backend == "flex":
        with torch.no_grad():
            torch.testing.assert_close(
                packed_logprobs(model, prefix).float(), want, atol=5e-2, rtol=5e-2
            )
    enable_packed_attention(model, "sdpa_segments")


def test_shared_prefix_window_check_counts_prompt_plus_completion():
    """Mistral-style window 8: a completion token attends over its prompt (5) and its own
    completion (up to 5): 10 > 8 must be refused, even though no segment exceeds 8."""
    model = make_tiny_model(
        "mistral", vocab_size=32, num_layers=1, max_position_embeddings=64, sliding_window=8
    )
    enable_packed_attention(model, "sdpa_segments")
    too_long = pack_samples(make_samples([(5, [5, 2])], vocab=32), shared_prefix=True)
    fits = pack_samples(make_samples([(5, [3, 2])], vocab=32), shared_prefix=True)
    with torch.no_grad(), pytest.raises(PackedAttentionError, match=r"\(10 tokens\).*window \(8\)"):
        packed_logprobs(model, too_long)
    with torch.no_grad():
        got = packed_logprobs(model, fits)  # 5 + 3 = 8 tokens: inside the window, exact
    want = padded_logprobs(model, make_samples([(5, [3, 2])], vocab=32), "right")
    torch.testing.assert_close(got, want, atol=TOL, rtol=1e-5)


def test_padded_view_state_is_per_model_copy():
    """The async engine's deep copy and the trainer's model run the padded view at once:
    the trainer's forward finishes while the copy's is in flight (as two threads do); each
    must unpad with its own mask."""
    import copy
    import threading

    model = TinyOpaqueLM()
    enable_packed_attention(model, "sdpa_segments")
    twin = copy.deepcopy(model)
    batch_a = pack_samples(make_samples([(3, [2, 4]), (5, [1])], vocab=32))
    batch_b = pack_samples(make_samples([(2, [6]), (1, [1, 1]), (4, [2])], vocab=32))

    def run(m, batch):
        kw = packed_model_kwargs(batch)
        return m(input_ids=batch.input_ids, position_ids=batch.position_ids, **kw)

    with torch.no_grad():
        want_a, want_b = run(model, batch_a).last_hidden_state, run(twin, batch_b).last_hidden_state
    twin_padded, model_done = threading.Event(), threading.Event()

    def model_waits(*_):
        twin_padded.wait(60)

    def twin_waits(*_):
        twin_padded.set()
        model_done.wait(60)

    hooks = [
        model.qkv.register_forward_hook(model_waits),
        twin.qkv.register_forward_hook(twin_waits),
    ]
    got, errors = {}, []

    def trainer():
        try:
            got["a"] = run(model, batch_a).last_hidden_state
        except Exception as exc:  # reported below
            errors.append(exc)
        finally:
            model_done.set()

    def producer():
        try:
            got["b"] = run(twin, batch_b).last_hidden_state
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=trainer), threading.Thread(target=producer)]
    with torch.no_grad():
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    for h in hooks:
        h.remove()
    assert not errors, errors
    torch.testing.assert_close(got["a"], want_a, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got["b"], want_b, atol=1e-6, rtol=1e-6)
