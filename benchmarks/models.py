"""Model shapes the benchmarks build with random weights (nothing is downloaded).

The public configs of Qwen2.5-1.5B and Llama-3.1-8B, written out field by field, plus two
tiny stand-ins of the same architectures for CPU dry runs. Rope scaling is left at its
default (it changes neither memory nor time). Random initialisation is right for memory
and speed, never for quality.
"""

from __future__ import annotations

import torch

CONFIGS: dict[str, dict] = {
    "qwen2.5-1.5b": dict(
        arch="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    ),
    "llama-3.1-8b": dict(
        arch="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
    ),
    # benchmarks/context_parallel.py on CPU: long sequences through a small Llama (GQA: 8
    # query heads, 2 key/value heads), about 4M parameters
    "cp-small": dict(
        arch="llama",
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
    ),
    # benchmarks/moe.py on a GPU: a small mixture of experts (Qwen3-MoE layout, 64 experts,
    # top-8, about 1.1B parameters, ~0.25B active) and the dense model of its active size
    "qwen3-moe-1b": dict(
        arch="qwen3_moe",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=2048,
        moe_intermediate_size=256,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    ),
    "qwen3-dense-active-1b": dict(
        arch="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=2048,  # 8 experts x 256: the MoE's active width
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    ),
    # benchmarks/moe.py on CPU: a small mixture of experts (16 experts, top-2) and the dense
    # model of its active size
    "small-moe": dict(
        arch="qwen3_moe",
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=256,
        num_experts=16,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        initializer_range=0.1,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    ),
    "small-dense-active": dict(
        arch="qwen3",
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,  # 2 experts x 256: small-moe's active width
        initializer_range=0.1,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    ),
    # CPU dry-run stand-ins: same architectures, a few hundred KB
    "tiny-qwen2": dict(
        arch="qwen2",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    ),
    "tiny-llama": dict(
        arch="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
    ),
    "tiny-moe": dict(
        arch="qwen3_moe",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        initializer_range=0.2,  # experts that differ enough for a flip to matter
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    ),
    "tiny-dense-active": dict(
        arch="qwen3",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=64,  # 2 experts x 32: tiny-moe's active width
        initializer_range=0.2,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    ),
}


def hf_config(name: str, max_tokens: int):
    """The transformers config of `name`, long enough for `max_tokens` positions."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    fields = dict(CONFIGS[name])
    classes = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config,
               "qwen3_moe": Qwen3MoeConfig}  # fmt: skip
    config_cls = classes[fields.pop("arch")]
    return config_cls(max_position_embeddings=max(max_tokens, 4096), **fields)


def build_model(
    name: str,
    max_tokens: int,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
):
    """A randomly initialised causal LM of shape `name`, created directly on `device`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            hf_config(name, max_tokens), dtype=dtype, attn_implementation="sdpa"
        )
    return model.train()


def planner_dims(name: str):
    """`leangrpo.planner.plan.Dims` of `name`, for `plan_memory(cfg, dims=...)`: read the way
    `leangrpo plan` reads a config.json (Qwen2's q/k/v biases included)."""
    from leangrpo.planner.plan import dims_from_json

    fields = dict(CONFIGS[name])
    return dims_from_json(
        {"model_type": fields.pop("arch"), **fields}, f"benchmarks/models.py {name}"
    )
