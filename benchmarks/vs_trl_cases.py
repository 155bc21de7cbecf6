"""Inputs of benchmarks/vs_trl.py's cases, written once per case so both trainers read the same.

`prepare_case` writes `case.json` (model directory, train and eval files) into the work
directory, plus the data files and, for the random-model cases, the model: built from a
fixed seed so every run of every variant starts from the same weights.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

PREFIX_PROBLEMS = 20  # case b: about 20 x 9 = 180 characters (= tokens: one per character)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def with_prefixes(rows: list[dict], pool: list[dict], seed: int) -> list[dict]:
    """Every second prompt gets a long prefix of solved problems, one per line."""
    rng = random.Random(seed)
    out = []
    for i, row in enumerate(rows):
        if i % 2:
            shots = rng.sample(pool, PREFIX_PROBLEMS)
            prefix = "".join(f"{r['prompt']}{r['answer']}\n" for r in shots)
            row = {**row, "prompt": prefix + row["prompt"]}
        out.append(row)
    return out


def random_model(
    out: Path, tokenizer_dir: Path, vocab: int, eos: int, pad: int, bos: int | None
) -> Path:
    """A randomly initialised 4-layer Llama (hidden 128), saved with a copied tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=bos,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


def prepare_case(case, workdir: Path, root: Path) -> dict:
    demo = root / "examples" / "demo"
    train, evals = read_jsonl(demo / "train.jsonl"), read_jsonl(demo / "eval.jsonl")
    paths = {"train": str(workdir / "train.jsonl"), "eval": str(workdir / "eval.jsonl")}
    if case.data == "demo":
        shutil.copy(demo / "train.jsonl", paths["train"])
        shutil.copy(demo / "eval.jsonl", paths["eval"])
    elif case.data == "prefix":
        write_jsonl(Path(paths["train"]), with_prefixes(train, train, seed=0))
        write_jsonl(Path(paths["eval"]), with_prefixes(evals, train, seed=1))
    elif case.data == "short":
        write_jsonl(Path(paths["train"]), train)
        write_jsonl(Path(paths["eval"]), evals)
    elif case.data == "tools_demo":
        tools = root / "examples" / "tools_demo"
        shutil.copy(tools / "train.jsonl", paths["train"])
        shutil.copy(tools / "eval.jsonl", paths["eval"])
    elif case.data == "smollm2":
        shutil.copy(root / "examples" / "smollm2" / "train.jsonl", paths["train"])
        shutil.copy(root / "examples" / "smollm2" / "eval.jsonl", paths["eval"])
    else:
        raise ValueError(f"unknown data {case.data!r}")

    if case.model == "demo":
        paths["model"] = str(demo / "model")
    elif case.model == "tools_demo":
        paths["model"] = str(root / "examples" / "tools_demo" / "model")
    elif case.model == "random_demo_vocab":  # 32 tokens: EOS (id 1) has p ~ 1/32 a step
        paths["model"] = str(
            random_model(workdir / "model", demo / "model", 32, eos=1, pad=0, bos=None)
        )
    elif case.model in ("random_smollm2_vocab", "smollm2"):
        from leangrpo.model.smollm2 import smollm2_dir

        real = smollm2_dir()
        if case.model == "smollm2":
            paths["model"] = str(real)
        else:  # 49,152 tokens: a random model practically never samples EOS
            paths["model"] = str(random_model(workdir / "model", real, 49152, eos=2, pad=2, bos=1))
    else:
        raise ValueError(f"unknown model {case.model!r}")
    (workdir / "case.json").write_text(json.dumps(paths))
    return paths
