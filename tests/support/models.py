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
    (head_dim, sliding_window, attention_dropout, ...) or overrides the ones below."""
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    config_cls = {
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "llama": LlamaConfig,
        "mistral": MistralConfig,
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
    }
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_cls(**(fields | config)), dtype=dtype)
    return model.eval()
