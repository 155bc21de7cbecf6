"""Tiny randomly initialised causal LMs built on the spot (no downloads)."""

from __future__ import annotations

import torch


def make_tiny_model(
    arch: str = "qwen2",
    vocab_size: int = 64,
    hidden_size: int = 32,
    num_layers: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config,
):
    """A randomly initialised Qwen2-, Qwen3-, Llama- or Mistral-architecture model, a few
    hundred KB, in eval mode; `config` sets further fields of the architecture's config
    (head_dim, sliding_window, attention_dropout, ...) or overrides the ones below.
    Mixtures of experts: `qwen3_moe` and `olmoe` (4 experts, top-2: see MOE_FIELDS)."""
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        MistralConfig,
        OlmoeConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    config_cls = {
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "llama": LlamaConfig,
        "mistral": MistralConfig,
        "qwen3_moe": Qwen3MoeConfig,
        "olmoe": OlmoeConfig,
    }[arch]
    fields = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        **MOE_FIELDS.get(arch, {}),
    }
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_cls(**(fields | config)), dtype=dtype)
    return model.eval()


MOE_ARCHS = ("qwen3_moe", "olmoe")  # the mixture-of-experts families the tests build

# a few experts, top-2: small enough for CPU tests, routed enough that routes can differ
MOE_FIELDS = {
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "norm_topk_prob": True,
        "head_dim": 8,
    },
    # OLMoE's defaults name token ids of its 50k vocabulary
    "olmoe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
    },
}


def save_demo_teacher(out, seed: int = 7, scale: float = 0.05):
    """The bundled demo model's files in `out` with its weights moved by seeded noise: a
    distillation teacher of the same tokenizer (what tests/distill and the torchrun
    distillation worker use)."""
    import shutil
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    demo = Path(__file__).resolve().parents[2] / "examples" / "demo" / "model"
    shutil.copytree(demo, out, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(demo, dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    model.save_pretrained(out)
    return out
