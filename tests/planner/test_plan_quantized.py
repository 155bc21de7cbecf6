"""`leangrpo plan` for a quantized base (model.quantization), against the model that
leangrpo's own `load_policy` builds with bitsandbytes on CPU.

- weights: the plan's term equals, byte for byte, the distinct storages the loaded policy
  holds: parameters, buffers and every quantization constant bitsandbytes keeps on its
  modules (absmax, codes, offsets, int8 row scales), plus the fp32 adapters;
- the training pass: its live peak (tests/support/memory_probe.LiveBytes) lies within the
  tolerance test_plan_measured.py holds fp32 LoRA to, with and without checkpointing (4-bit
  layers save nothing; int8 layers keep their inputs, LoRA or not).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from types import SimpleNamespace

import pytest
import torch
from support.memory_probe import LiveBytes, group, step_config, train_pass

from leangrpo.model.policy import load_policy
from leangrpo.planner.plan import (
    TRAINING_PASS,
    dims_from_json,
    plan_memory,
    quantized_linear_bytes,
)
from leangrpo.train.packing import pack_samples

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None,
    reason="QLoRA needs bitsandbytes: pip install 'leangrpo[qlora]'",
)
VOCAB, PROMPT, COMPLETION, GENERATIONS = 384, 40, 24, 4
PEAK_TOLERANCE = (-0.05, 0.11)  # as tests/planner/test_plan_measured.py
CPU = torch.device("cpu")


def held_bytes(model) -> int:
    """Distinct storages of the parameters, buffers and bitsandbytes' quantization state."""
    import bitsandbytes as bnb

    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            q = module.weight.quant_state
            tensors += [q.absmax, q.code]
            if q.nested:
                tensors += [q.offset, q.state2.absmax, q.state2.code]
        elif isinstance(module, bnb.nn.Linear8bitLt):  # the row scales move to the state
            tensors += [module.weight.SCB, module.state.SCB]  # at the first forward
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None
    }
    return sum(storages.values())


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A 3-layer Llama with GQA and head_dim 24 (not hidden / heads), saved to disk."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=24, max_position_embeddings=512)  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def quantized(path, quant, double_quant=True, ckpt=False, lora=None, **over):
    cfg = step_config(
        model={"name_or_path": str(path), "quantization": quant,
               "quantization_double_quant": double_quant, "gradient_checkpointing": ckpt},
        lora={"enabled": True, **(lora or {})},
        rollout={"max_new_tokens": COMPLETION, "num_generations": GENERATIONS},
        data={"max_prompt_tokens": PROMPT},
        **over,
    )  # fmt: skip
    torch.manual_seed(0)
    return cfg, load_policy(cfg, None, CPU)


@pytest.mark.parametrize(
    "quant,double_quant", [("nf4", True), ("nf4", False), ("fp4", True), ("int8", True)]
)
def test_the_weights_term_is_what_the_quantized_policy_holds(tiny_dir, quant, double_quant):
    cfg, policy = quantized(tiny_dir, quant, double_quant)
    d = dims_from_json(policy.model.config.to_dict())
    assert plan_memory(cfg, dims=d, prompt_tokens=PROMPT)["weights"] == held_bytes(policy.model)


@pytest.mark.parametrize(
    "dtype,compute",
    [("float32", "bfloat16"), ("bfloat16", "float32"), ("float32", "auto"), ("bfloat16", "auto")],
)
def test_the_weights_term_holds_4_bit_biases_in_the_compute_dtype(dtype, compute):
    """a4_plan_weights.py: bitsandbytes' 4-bit forward casts a linear's bias to the compute
    dtype for good; on the demo model (Qwen2: q, k, v biases) the plan counted them in the
    model dtype, 768 bytes off. Held bytes after the load (whose probe runs a forward) and
    after a training forward and backward."""
    import bitsandbytes as bnb
    from support.configs import DEMO_MODEL

    from leangrpo.contracts import SamplingParams
    from leangrpo.model.scoring import score

    model = {"name_or_path": str(DEMO_MODEL), "quantization": "nf4", "dtype": dtype,
             "quantization_compute_dtype": compute}  # fmt: skip
    cfg = step_config(model=model, lora={"enabled": True},
                      rollout={"max_new_tokens": 6, "num_generations": 4},
                      data={"max_prompt_tokens": 8})  # fmt: skip
    torch.manual_seed(0)
    policy = load_policy(cfg, None, CPU)
    d = dims_from_json(policy.model.config.to_dict())
    assert d.qkv_bias
    planned = plan_memory(cfg, dims=d, prompt_tokens=8)["weights"]
    assert planned == held_bytes(policy.model)
    chunks = SimpleNamespace(chunked=True, row_tile=None, vocab_tile=None, compile=False)
    logp, _ = score(policy.model, pack_samples(group(32, 4, 8, 6)), SamplingParams(), chunks)
    logp.sum().backward()
    assert planned == held_bytes(policy.model)
    want = getattr(torch, dtype if compute == "auto" else compute)
    layers = [m for m in policy.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    biases = [m.bias for m in layers if m.bias is not None]
    assert len(biases) == 3 * 3 and all(b.dtype == want for b in biases)  # q, k, v


def test_the_4_bit_layout_of_smollm2_is_counted_exactly():
    """SmolLM2's 210 decoder linears in nf4 with double quantization, as measured."""
    from leangrpo.model.smollm2 import missing_reason, smollm2_dir

    if missing_reason() is not None:
        pytest.skip(missing_reason())
    d = dims_from_json(__import__("json").loads((smollm2_dir() / "config.json").read_text()))
    parts = [quantized_linear_bytes(i, o, "nf4", True) for i, o, _ in d.linears().values()]
    assert d.layers * sum(w for w, _ in parts) == 53_084_160
    assert d.layers * sum(c for _, c in parts) == 1_914_360
    cfg, policy = quantized(smollm2_dir(), "nf4")
    assert plan_memory(cfg, dims=d, prompt_tokens=PROMPT)["weights"] == held_bytes(policy.model)


@pytest.mark.parametrize(
    "quant,ckpt,lora",
    [
        ("nf4", False, None),
        ("nf4", True, None),
        ("fp4", True, None),
        ("int8", False, None),
        ("int8", False, {"target_modules": ["q_proj", "v_proj"]}),  # inputs kept unadapted
    ],
    ids=["nf4", "nf4_ckpt", "fp4_ckpt", "int8", "int8_two_adapted"],
)
def test_train_pass_peak_on_a_quantized_base_is_within_the_tolerance(tiny_dir, quant, ckpt, lora):
    over = {"logprobs": {"row_tile": 32, "vocab_tile": 128}}
    cfg, policy = quantized(tiny_dir, quant, ckpt=ckpt, lora=lora, **over)
    d = dims_from_json(policy.model.config.to_dict())
    samples = [  # two prompt groups, one packed row
        dataclasses.replace(sample, group_id=g)
        for g in range(2)
        for sample in group(VOCAB, GENERATIONS, PROMPT, COMPLETION, seed=g)
    ]
    batch = pack_samples(samples)
    forward = train_pass(policy, batch, cfg)
    measured = LiveBytes().peak_of(lambda: forward().backward())
    plan = plan_memory(cfg, tokens=batch.input_ids.numel(), dims=d, prompt_tokens=PROMPT)
    planned = plan[TRAINING_PASS]
    error = (planned - measured) / measured
    assert PEAK_TOLERANCE[0] <= error <= PEAK_TOLERANCE[1], (planned, measured, error)
