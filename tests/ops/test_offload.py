"""Activation offload: counts, exact gradients, pool reuse, and the GPU path (streams, pinning).

The reference for every gradient check is the same model without offload (plain
non-reentrant checkpointing) and without checkpointing at all, in fp32.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.models import make_tiny_model

from leangrpo.ops.offload import ActivationOffloader, HostBufferPool, enable_gradient_checkpointing

LAYERS = 4
# tiny models run fastest on one thread, and do not fight other tests for cores
pytestmark = pytest.mark.usefixtures("one_thread")


def _model(layers: int = LAYERS, device: str = "cpu", dtype=torch.float32):
    return make_tiny_model(num_layers=layers, hidden_size=64, dtype=dtype).to(device).train()


def _lora(model):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )  # random B too: every LoRA grad is non-zero
    return get_peft_model(model, config)


def _packed(lengths=(20, 13, 15), seed: int = 1, device: str = "cpu"):
    """One packed row (1, N): sequences end to end, position_ids restarting at 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return ids.to(device), pos.to(device)


def _loss(model, ids, pos):
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])
    return -logp.mean()


def _grads(model, ids, pos, offloader: ActivationOffloader | None = None):
    scope = offloader.step() if offloader is not None else torch.enable_grad()
    with scope:
        _loss(model, ids, pos).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    assert grads and all(g.abs().sum() > 0 for g in grads.values())
    return grads


def _assert_close(a: dict, b: dict, tol: float):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=tol, rtol=0, msg=name)


@pytest.mark.parametrize("keep", [0, 1, 2])
def test_counts_match_checkpointed_layers(keep):
    model = _model()
    off = enable_gradient_checkpointing(
        model, offload="hidden_states", keep_on_device=keep, min_tensor_bytes=0
    )
    assert off.num_layers == LAYERS
    _grads(model, *_packed(), off)
    s = off.stats
    assert (s.marked, s.offloaded, s.kept_on_device, s.restored) == (
        LAYERS,
        LAYERS - keep,
        keep,
        LAYERS - keep,
    )
    # every offloaded input but the first one backward meets is fetched ahead of use
    assert s.prefetched == (LAYERS - keep if keep else LAYERS - 1)
    assert s.offloaded_bytes == (LAYERS - keep) * 48 * 64 * 4  # (1, N, H) fp32 inputs
    assert s.marked_bytes == LAYERS * 48 * 64 * 4
    assert s.skipped == 0 and off.pool.in_use == 0


def test_min_tensor_bytes_keeps_small_inputs():
    model = _model()
    off = enable_gradient_checkpointing(model, offload="hidden_states", min_tensor_bytes=1 << 20)
    _grads(model, *_packed(), off)
    assert off.stats.marked == LAYERS and off.stats.offloaded == 0
    assert off.stats.skipped == LAYERS - 1 and off.pool.size == 0


@pytest.mark.parametrize("lora", [False, True])
def test_gradients_match_plain_checkpointing_and_no_checkpointing(lora):
    base = _lora(_model()) if lora else _model()
    ids, pos = _packed()
    plain, ckpt, offl = (copy.deepcopy(base) for _ in range(3))
    assert enable_gradient_checkpointing(ckpt, offload="none") is None
    off = enable_gradient_checkpointing(offl, offload="hidden_states", min_tensor_bytes=0)
    reference = _grads(plain, ids, pos)
    checkpointed = _grads(ckpt, ids, pos)
    offloaded = _grads(offl, ids, pos, off)
    assert off.stats.offloaded == LAYERS - 1 and off.stats.restored == LAYERS - 1
    _assert_close(offloaded, checkpointed, 1e-6)
    _assert_close(offloaded, reference, 1e-6)


def test_all_mode_gradients_and_no_parameters_moved():
    base = _model()
    ids, pos = _packed()
    reference = _grads(copy.deepcopy(base), ids, pos)
    without_ckpt = copy.deepcopy(base)
    off = ActivationOffloader(without_ckpt, "all", min_tensor_bytes=0)
    _assert_close(_grads(without_ckpt, ids, pos, off), reference, 1e-6)
    assert off.stats.deduplicated > 0  # q/k/v projections save the same normed input
    assert off.stats.restored == off.stats.offloaded and off.pool.in_use == 0

    with_ckpt = copy.deepcopy(base)
    off_ckpt = enable_gradient_checkpointing(with_ckpt, offload="all", min_tensor_bytes=0)
    _assert_close(_grads(with_ckpt, ids, pos, off_ckpt), reference, 1e-6)
    assert 0 < off_ckpt.stats.offloaded < off.stats.offloaded  # inside layers: recomputed


def test_all_mode_never_offloads_parameters_or_buffers():
    lin = torch.nn.Linear(16, 16)
    off = ActivationOffloader(lin, "all", min_tensor_bytes=0)
    x = torch.randn(8, 16, requires_grad=True)
    with off.step():
        h = x * 2  # non-leaf input: saved by the matmul; weight.t() is a parameter view
        lin(h).relu().sum().backward()
    assert off.stats.offloaded == 2  # h and the relu output, never the weight
    expected = torch.relu(lin(x * 2)) > 0
    torch.testing.assert_close(x.grad, 2 * (expected.float() @ lin.weight))


def _trainer_like_grads(model, ids, pos, cu_seqlens, offloader):
    """The trainer's path: packed-attention adapter, backbone, chunked lm_head log-probs."""
    from types import SimpleNamespace

    from leangrpo.ops.attention.adapter import packed_model_kwargs
    from leangrpo.ops.logprobs.api import chunked_logprobs

    row = SimpleNamespace(input_ids=ids, position_ids=pos, cu_seqlens=cu_seqlens, max_seqlen=20)
    lm = model.get_base_model()
    scope = offloader.step() if offloader is not None else torch.enable_grad()
    with scope:
        out = lm.model(input_ids=ids, position_ids=pos, use_cache=False, **packed_model_kwargs(row))
        lp, _ = chunked_logprobs(
            out.last_hidden_state[0, :-1], lm.lm_head.weight, ids[0, 1:], row_tile=16, vocab_tile=32
        )
        (-lp.mean()).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("mode", ["hidden_states", "all"])
def test_lora_packed_attention_and_chunked_logprobs(mode):
    """Offload composes with the adapter and the chunked log-probs' own saved state."""
    attention = pytest.importorskip("leangrpo.ops.attention.adapter")
    pytest.importorskip("leangrpo.ops.logprobs.api")
    ids, pos = _packed()
    cu_seqlens = torch.tensor([0, 20, 33, 48], dtype=torch.int32)
    base = _lora(_model())
    plain, offl = copy.deepcopy(base), copy.deepcopy(base)
    for model in (plain, offl):
        attention.enable_packed_attention(model, "auto")
    off = enable_gradient_checkpointing(offl, offload=mode, min_tensor_bytes=0)
    reference = _trainer_like_grads(plain, ids, pos, cu_seqlens, None)
    _assert_close(_trainer_like_grads(offl, ids, pos, cu_seqlens, off), reference, 1e-6)
    if mode == "hidden_states":  # the log-prob state and everything else passed through
        assert (off.stats.marked, off.stats.offloaded) == (LAYERS, LAYERS - 1)
    assert off.stats.restored == off.stats.offloaded and off.pool.in_use == 0


def test_pool_is_reused_and_every_buffer_returned_over_50_steps():
    layers = 3
    model = _model(layers=layers)
    off = enable_gradient_checkpointing(model, offload="hidden_states", min_tensor_bytes=0)
    ids, pos = _packed((5, 3))
    sizes = []
    for _ in range(50):
        with off.step():
            _loss(model, ids, pos).backward()
        assert off.pool.in_use == 0 and off.stats.offloaded == layers - 1
        sizes.append((off.pool.size, off.pool.bytes))
    assert len(set(sizes)) == 1 and sizes[0][0] == layers - 1  # no growth after warm-up
    assert off.total.offloaded == 50 * (layers - 1) == off.total.restored


def test_pool_follows_varying_packed_lengths():
    model = _model(layers=3)
    off = enable_gradient_checkpointing(model, offload="hidden_states", min_tensor_bytes=0)
    lengths = [(8, 5), (12, 5), (16, 5)] * 2 + [(16, 5)] * 6  # N = 13, 17, 21, then 21 only
    for step, lens in enumerate(lengths):
        with off.step():
            _loss(model, *_packed(lens, seed=step)).backward()
        assert off.pool.in_use == 0 and off.pool.size <= 3 * 2  # one set per distinct size
    assert off.pool.size == 2 and off.pool.bytes == 2 * 21 * 64 * 4  # idle sizes were freed


def test_host_buffer_pool_best_fit_and_trim():
    pool = HostBufferPool(max_idle_steps=2)
    a = pool.acquire(1000, pin=False)
    pool.release(a)
    assert pool.acquire(600, pin=False) is a  # within 2x: reused
    b = pool.acquire(100, pin=False)  # a is taken, and too large for 100 anyway
    c = pool.acquire(400, pin=False)
    assert b is not a and c is not a and pool.size == 3 and pool.in_use == 3
    pool.release(a), pool.release(b), pool.release(c)
    pool.trim()  # all three were used in this step
    pool.acquire(1000, pin=False)  # a, used again: its idle count restarts
    pool.trim()
    assert pool.size == 3 and pool.in_use == 1
    pool.trim()  # b and c now idle for two whole steps: freed
    assert pool.size == 1 and pool.in_use == 1 and pool.bytes == 1000
    with pytest.raises(ValueError, match="not acquired"):
        pool.release(torch.empty(4, dtype=torch.uint8))


def test_bad_arguments_and_misuse_fail_clearly():
    model = _model(layers=2)
    with pytest.raises(ValueError, match="offload mode must be one of"):
        enable_gradient_checkpointing(model, offload="hidden")
    with pytest.raises(ValueError, match="keep_on_device"):
        enable_gradient_checkpointing(model, offload="hidden_states", keep_on_device=-1)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2), offload="hidden_states")
    off = enable_gradient_checkpointing(
        model, offload="hidden_states", keep_on_device=0, min_tensor_bytes=0
    )
    with off.step(), pytest.raises(RuntimeError, match="already active"), off.step():
        pass
    ids, pos = _packed()
    with off.step():
        loss = _loss(model, ids, pos)
    assert off.pool.in_use == 0  # forward without backward: buffers still come back
    with pytest.raises(RuntimeError, match="run backward inside the step context"):
        loss.backward()


def test_no_step_means_plain_checkpointing():
    model = _model()
    off = enable_gradient_checkpointing(model, offload="hidden_states", min_tensor_bytes=0)
    _grads(model, *_packed())
    assert off.stats.marked == 0 and off.total.offloaded == 0


# -- GPU: side stream, events, pinned pool (skipped without CUDA) ---------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("lora", [False, True])
def test_gpu_gradients_match_and_buffers_are_pinned(lora):
    base = _lora(_model(device="cuda")) if lora else _model(device="cuda")
    ids, pos = _packed(device="cuda")
    ckpt, offl = copy.deepcopy(base), copy.deepcopy(base)
    enable_gradient_checkpointing(ckpt, offload="none")
    off = enable_gradient_checkpointing(offl, offload="hidden_states", min_tensor_bytes=0)
    reference = _grads(ckpt, ids, pos)
    for _ in range(3):
        _assert_close(_grads(offl, ids, pos, off), reference, 1e-6)
    assert off.stats.offloaded == LAYERS - 1 and off.pool.in_use == 0
    assert all(b.is_pinned() for b in off.pool._buffers.values())


@pytest.mark.gpu
def test_gpu_backward_under_a_user_stream():
    """The compute stream is looked up at each use, so a caller's stream is respected."""
    base = _model(device="cuda")
    ids, pos = _packed(device="cuda")
    ckpt, offl = copy.deepcopy(base), copy.deepcopy(base)
    enable_gradient_checkpointing(ckpt, offload="none")
    off = enable_gradient_checkpointing(offl, offload="hidden_states", min_tensor_bytes=0)
    reference = _grads(ckpt, ids, pos)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        grads = _grads(offl, ids, pos, off)
    torch.cuda.synchronize()
    _assert_close(grads, reference, 1e-6)


@pytest.mark.gpu
def test_gpu_offload_lowers_peak_memory():
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=256,
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    with torch.device("cuda"):
        base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).train()
    ids = torch.randint(0, 256, (1, 8192), device="cuda")
    pos = torch.arange(8192, device="cuda")[None]
    peaks = {}
    for mode in ("none", "hidden_states"):
        model = copy.deepcopy(base)
        off = enable_gradient_checkpointing(model, offload=mode)
        _grads(model, ids, pos, off)  # warm-up: pool, side stream, allocator
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _grads(model, ids, pos, off)
        peaks[mode] = torch.cuda.max_memory_allocated()
        del model
    layer_input = 8192 * 1024 * 2
    # 7 of 8 inputs leave the device, at most one is prefetched back at a time
    assert peaks["none"] - peaks["hidden_states"] >= 4 * layer_input
