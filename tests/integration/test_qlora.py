"""QLoRA on the real SmolLM2-135M-Instruct: an nf4 base loaded by leangrpo's own
`load_policy` (bitsandbytes, CPU), LoRA adapters on top.

The exact reference of a quantized model is the same model with its weights dequantized
into plain linears (bitsandbytes dequantizes, then multiplies: bitwise the same result)
and cast to fp64. Tolerances are those of tests/integration/test_real_model.py: leangrpo's
fp32 result may be at most twice as far from fp64 as the plain fp32 computation
(per-sequence transformers on the quantized model) is.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from support.real_model import (
    attention,
    chat_ids,
    dequantized,
    real_samples,
)
from support.references import per_sequence_logprobs

from leangrpo.model.smollm2 import missing_reason

if missing_reason() is not None:
    pytest.skip(missing_reason(), allow_module_level=True)
pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes: pip install 'leangrpo[qlora]'")

from leangrpo.config import config_from_dict
from leangrpo.contracts import Prompt, RolloutSample, SamplingParams
from leangrpo.model.policy import load_policy, load_tokenizer
from leangrpo.model.scoring import completion_hidden, reference_logprobs, score
from leangrpo.model.smollm2 import smollm2_dir
from leangrpo.ops.logprobs.api import chunked_logprobs, naive_logprobs
from leangrpo.rollout.hf.engine import HFEngine
from leangrpo.train.packing import pack_samples

TOL = 2e-4
CHUNKS = SimpleNamespace(chunked=True, row_tile=16, vocab_tile=8192)
CPU = torch.device("cpu")


def qlora_config(**model):
    return config_from_dict(
        {
            "run": {"device": "cpu"},
            "model": {"name_or_path": str(smollm2_dir()), "dtype": "float32", **model},
            "data": {"path": "unused.jsonl"},
            "rewards": {"functions": ["length"]},
            "lora": {"enabled": True, "r": 16, "alpha": 32},
        }
    )


@pytest.fixture(scope="module")
def qlora():
    """The nf4 policy as the trainer loads it, its adapters' B made non-zero (at init B is
    0, and the adapters would not take part in what is compared)."""
    import bitsandbytes as bnb

    cfg = qlora_config(quantization="nf4")
    tokenizer = load_tokenizer(cfg.model)
    torch.manual_seed(0)  # peft draws lora_A from the global RNG
    policy = load_policy(cfg, tokenizer, CPU)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    linears = [m for m in policy.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linears) == 30 * 7  # q, k, v, o, gate, up, down of each layer
    return SimpleNamespace(cfg=cfg, policy=policy, tokenizer=tokenizer, samples=real_samples(tokenizer))


@pytest.fixture(scope="module")
def per_sequence(qlora):
    """Per-sequence transformers log-probs at T=0.8 on the quantized policy (fp32), and on
    its dequantized fp64 copy (the exact reference)."""
    model = qlora.policy.model
    with torch.no_grad(), attention(model, "sdpa"):
        model.eval()
        fp32 = per_sequence_logprobs(model, qlora.samples, temperature=0.8)
        model.train()
        model64 = dequantized(model).double().eval()
        fp64 = per_sequence_logprobs(model64, qlora.samples, temperature=0.8)
    del model64
    return fp32, fp64


def packed(model):
    """leangrpo's packed attention (a test with plain transformers attention switched it off)."""
    return attention(model, "sdpa_segments")


def reorder(values: torch.Tensor, samples, batch) -> torch.Tensor:
    """Per-sample rows in the packed row's order (the shared-prefix row regroups them)."""
    rows = torch.split(values, [len(s.completion.ids) for s in samples])
    return torch.cat([rows[i] for i in batch.sample_index.tolist()])


@pytest.mark.parametrize("shared_prefix", [False, True], ids=["packed", "shared_prefix"])
def test_packed_score_equals_per_sequence_transformers_on_the_nf4_model(
    qlora, per_sequence, shared_prefix
):
    """Also the regression test of bitsandbytes' CPU bf16 repack: with it left on, the
    packed-attention probe at load repacks every 4-bit weight and scoring moves by 0.1-0.4."""
    want32, want64 = per_sequence
    model = qlora.policy.model
    with torch.no_grad(), attention(model, "sdpa_segments"):
        batch = pack_samples(qlora.samples, shared_prefix=shared_prefix)
        got, _ = score(model, batch, SamplingParams(temperature=0.8), CHUNKS)
    want32, want64 = reorder(want32, qlora.samples, batch), reorder(want64, qlora.samples, batch)
    floor = (want32.double() - want64).abs().max().item()
    error = (got.double() - want64).abs().max().item()
    assert error <= max(2 * floor, 5e-5), (error, floor)
    torch.testing.assert_close(got, want32, atol=TOL, rtol=0)
    assert want64.min() < -1.0


def test_dequantized_reference_is_the_quantized_model(qlora, per_sequence):
    """The reference is exact: the dequantized fp32 copy computes bitwise what bnb does."""
    model = qlora.policy.model
    with torch.no_grad(), attention(model, "sdpa"):
        copy32 = dequantized(model).eval()
        got = per_sequence_logprobs(copy32, qlora.samples[:2], temperature=0.8)
    n = sum(len(s.completion.ids) for s in qlora.samples[:2])
    assert torch.equal(got, per_sequence[0][:n])


def test_chunked_logprobs_equal_full_logits_on_nf4_hidden_states(qlora):
    """The head stays the unquantized tied fp32 embedding: chunked == full logits (fp64
    reference, the full-logits fp32 error as the floor), values and gradients."""
    model = qlora.policy.model
    batch = pack_samples(qlora.samples)
    with torch.no_grad(), attention(model, "sdpa_segments"):
        hidden = completion_hidden(model, batch)
    weight = model.get_output_embeddings().weight.detach()
    assert weight.dtype == torch.float32 and weight.shape == (49152, 576)
    out = {}
    for name, fn, dtype, tiles in [
        ("fp64", naive_logprobs, torch.float64, {}),
        ("full", naive_logprobs, torch.float32, {}),
        ("chunked", chunked_logprobs, torch.float32, {"row_tile": 8, "vocab_tile": 4096}),
    ]:
        h = hidden.to(dtype).clone().requires_grad_()
        logp, _ = fn(h, weight.to(dtype), batch.targets, temperature=1.0, **tiles)
        g = torch.randn(logp.shape, generator=torch.Generator().manual_seed(0), dtype=dtype)
        (logp * g).sum().backward()
        out[name] = (logp.detach().double(), h.grad.double())
    for i, what in enumerate(["logprobs", "grad hidden"]):
        ref, full, chunked = out["fp64"][i], out["full"][i], out["chunked"][i]
        floor = (full - ref).abs().max().item()
        error = (chunked - ref).abs().max().item()
        assert error <= max(2 * floor, 1e-6 * ref.abs().max().item()), (what, error, floor)


def lora_params(model) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if p.requires_grad and "lora_" in n]


def test_lora_gradients_packed_equal_per_sequence_on_the_nf4_model(qlora):
    """d(sum logp * g)/d(adapters): one packed row (leangrpo's scoring) against plain
    transformers one sequence at a time, both against the fp64 dequantized model."""
    model, samples = qlora.policy.model, qlora.samples
    sampling = SamplingParams(temperature=0.8)
    n = sum(len(s.completion.ids) for s in samples)
    g = torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    params = lora_params(model)
    assert len(params) == 2 * 30 * 7
    with attention(model, "sdpa_segments"):
        batch = pack_samples(samples)
        logp, _ = score(model, batch, sampling, CHUNKS)
        packed = torch.autograd.grad((logp * reorder(g, samples, batch).float()).sum(), params)
    model64 = dequantized(model).double()
    with attention(model, "sdpa"), attention(model64, "sdpa"):
        per_seq = torch.autograd.grad(
            (per_sequence_logprobs(model, samples, 0.8) * g.float()).sum(), params
        )
        want = torch.autograd.grad(
            (per_sequence_logprobs(model64, samples, 0.8) * g).sum(), lora_params(model64)
        )
    del model64
    floor = max((a.double() - w).abs().max().item() for a, w in zip(per_seq, want))
    error = max((a.double() - w).abs().max().item() for a, w in zip(packed, want))
    scale = max(w.abs().max().item() for w in want)
    assert scale > 1.0  # real gradients, through the 4-bit base layers
    assert error <= max(2 * floor, 1e-6 * scale), (error, floor, scale)
    assert error <= 1e-4 * scale, (error, scale)  # the floor itself is small (~1e-5 x scale)


def test_the_quantized_policy_generates_and_its_logprobs_are_the_trainers(qlora):
    """The hf engine on the nf4 policy (eval mode, no grad: the mode that triggered the
    repack) answers, its behaviour log-probs equal the trainer's re-score, and the 4-bit
    weights are still in their training layout afterwards."""
    policy, tokenizer = qlora.policy, qlora.tokenizer
    prompt = Prompt(0, "", chat_ids(tokenizer, "What is the capital of France?"))
    engine = HFEngine(policy.model, tokenizer, share_weights=True)
    with torch.no_grad(), policy.model.disable_adapter():  # the base model's own answer
        greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
        (answer,) = engine.generate([prompt], greedy, n=1, version=0)[0]
    assert "Paris" in answer.text
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    completions = engine.generate([prompt], params, n=3, version=0)[0]
    samples = [RolloutSample(0, prompt, c, advantage=1.0) for c in completions]
    batch = pack_samples(samples)
    with torch.no_grad(), packed(policy.model):
        got, _ = score(policy.model, batch, params, CHUNKS)
    behaviour = torch.cat([torch.tensor(c.logprobs) for c in completions])
    torch.testing.assert_close(reorder(got, samples, batch), behaviour, atol=TOL, rtol=0)
    weights = [m.weight for m in policy.model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    assert weights and not any(
        getattr(w.quant_state, "packing_format_for_cpu", False) for w in weights
    )


def test_reference_is_the_quantized_base_with_adapters_off(qlora):
    """Reference log-probs (adapters disabled) equal the policy's with every lora_B zeroed."""
    policy = qlora.policy
    batch = pack_samples(qlora.samples)
    sampling = SamplingParams(temperature=0.8)
    with packed(policy.model):
        ref = reference_logprobs(policy, batch, sampling, CHUNKS)
    saved = {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora_B" in n}
    try:
        with torch.no_grad(), packed(policy.model):
            for n, p in policy.model.named_parameters():
                if n in saved:
                    p.zero_()
            zeroed, _ = score(policy.model, batch, sampling, CHUNKS)
    finally:
        with torch.no_grad():
            for n, p in policy.model.named_parameters():
                if n in saved:
                    p.copy_(saved[n])
    assert torch.equal(ref, zeroed)
    with torch.no_grad(), packed(policy.model):
        adapted, _ = score(policy.model, batch, sampling, CHUNKS)
    assert (adapted - ref).abs().max() > 0.1  # the adapters do matter here


def test_requantizing_the_checkpoint_is_deterministic_and_the_adapter_reloads(qlora, tmp_path):
    """A resume loads the base again and re-quantizes it: the same bytes. The final adapter
    (saved as the trainer saves it) with its quantization note reloads onto such a base
    to the same log-probs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from leangrpo.checkpoint.local import save_final_model
    from leangrpo.model.policy import own_aligned_memory

    policy = qlora.policy
    final = save_final_model(tmp_path, policy.model, qlora.tokenizer)
    note = json.loads((final / "quantization_config.json").read_text())
    assert note["bnb_4bit_quant_type"] == "nf4" and note["bnb_4bit_use_double_quant"]
    base = AutoModelForCausalLM.from_pretrained(
        smollm2_dir(),
        dtype=torch.float32,
        quantization_config=BitsAndBytesConfig.from_dict(note),
        device_map={"": "cpu"},
    )
    for module in base.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    own_aligned_memory(base)  # laid out as the trainer's policy: same bytes, same kernels
    mine = {k: v for k, v in policy.model.state_dict().items() if "lora_" not in k}
    theirs = PeftModel.from_pretrained(base, final).eval()
    other = {k: v for k, v in theirs.state_dict().items() if "lora_" not in k}
    assert sorted(mine) == sorted(other)
    assert all(torch.equal(mine[k], other[k]) for k in mine)  # bytes, scales, constants
    batch = pack_samples(qlora.samples)
    with torch.no_grad(), attention(theirs, "sdpa_segments"), packed(policy.model):
        got, _ = score(theirs, batch, SamplingParams(), CHUNKS)
        want, _ = score(policy.model, batch, SamplingParams(), CHUNKS)
    assert torch.equal(got, want)
