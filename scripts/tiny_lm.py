"""What the bundled demos' build scripts share (build_demo.py, build_tool_demo.py): the tiny
Qwen2 model, its shape options, and how a built model and its data are written.

Each demo keeps its own tokenizer, problems and pre-training; this module only holds the
parts that must stay the same for both (the files the trainer, transformers and vLLM load).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model's shape and the thread count (1 is fastest at this size)."""
    parser.add_argument("--threads", type=int, default=1, help="1 is fastest for this size")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument(
        "--heads",
        type=int,
        default=2,
        help="attention heads; head size = hidden / heads (vLLM's CPU kernels need >= 32)",
    )
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--inter", type=int, default=256)


def build_model(tokenizer, args: argparse.Namespace, max_positions: int):
    """A Qwen2-architecture causal LM (tied embeddings, no BOS) of the shape in `args`."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.inter,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2),
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def write_jsonl(path: Path, problems) -> None:
    """Problems as the trainer's prompt files: columns `prompt` and `answer`."""
    with path.open("w") as f:
        for p in problems:
            f.write(json.dumps({"prompt": p.prompt, "answer": str(p.answer)}) + "\n")


def save_model(model, tokenizer, out: Path, tokenizer_config: dict | None = None) -> None:
    """Model (safetensors), generation config and tokenizer (with its chat template, if
    any); `tokenizer_config` entries are added to tokenizer_config.json."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # name the class every transformers version (and vLLM's) knows, not v5's alias
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.update(tokenizer_config or {})
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
