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
):
    """A randomly initialised Qwen2- or Llama-architecture model, a few hundred KB."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
