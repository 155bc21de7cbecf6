"""The vLLM tests' model: a tiny Qwen2 with a character tokenizer, and the checks on what
vLLM served with it (tests/rollout/test_vllm.py, test_vllm_servers.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from support.models import make_tiny_model
from support.references import teacher_forced_logprobs

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 +-*/=.,?"
EOS = 0


def build_char_model(
    path: Path, seed: int = 0, tied: bool = False, arch: str = "qwen2", layers: int = 2
):
    """A tiny Qwen2 (head_dim 64, which vLLM's CPU kernels support) + character tokenizer;
    `arch` "qwen3_moe": a tiny Qwen3-MoE (4 experts, top-2) of the same head size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": EOS} | {c: i + 1 for i, c in enumerate(CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    extra = {"head_dim": 64, "initializer_range": 0.1} if arch == "qwen3_moe" else {}
    model = make_tiny_model(
        arch, vocab_size=len(vocab), hidden_size=256, num_layers=layers, seed=seed, **extra
    )
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = cfg.bos_token_id = cfg.pad_token_id = EOS
    if tied:  # lm_head reads embed_tokens: the case vLLM's layerwise reload leaves stale on CPU
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer


def mean_abs_logprob_gap(model, prompts, groups, params) -> float:
    gaps = [
        (
            teacher_forced_logprobs(model, p.ids, c.ids, params).double()
            - torch.tensor(c.logprobs, dtype=torch.float64)
        ).abs()
        for p, group in zip(prompts, groups)
        for c in group
    ]
    return float(torch.cat(gaps).mean())


def perturb(model, scale: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
