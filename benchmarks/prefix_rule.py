"""Where the shared-prefix layout pays on the sdpa_segments backend (`packing.shared_prefix: auto`).

    python benchmarks/prefix_rule.py [--reps 7]

GRPO-shaped batches (16 groups x G=8) of prompt length P and completion lengths R
(uniform in [R/2, 3R/2]) are packed plainly and with each group's prompt shared, then
scored the way a training micro-batch is (`leangrpo.model.scoring.score` with entropy, backward),
variants interleaved, `--reps` times; time = median CPU seconds of the process (one
thread; on a shared machine steadier than wall). Models: the demo model (hidden 64,
3 layers) and a random 4-layer Llama (hidden 128, 4 heads, 2 KV heads, vocab 4096).
One JSON line per (model, P, R): prompt fraction (prompt tokens / plain tokens) and
`prefix_ratio` = shared-prefix time / plain time (< 1: the prefix pays).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent.parent
LOGPROBS = SimpleNamespace(chunked=True, row_tile=None, vocab_tile=None, compile=False)


def batch(p: int, r: int, vocab: int, seed: int, groups: int = 16, g: int = 8):
    from leangrpo.contracts import Completion, Prompt, RolloutSample

    rng = random.Random(seed)
    samples = []
    for gid in range(groups):
        prompt = [rng.randrange(2, vocab) for _ in range(p)]
        for _ in range(g):
            n = rng.randint(max(1, r // 2), max(1, 3 * r // 2))
            ids = [rng.randrange(2, vocab) for _ in range(n)]
            comp = Completion(ids, "", [-1.0] * n, "stop", 0)
            samples.append(RolloutSample(gid, Prompt(gid, "", prompt), comp, advantage=1.0))
    return samples


def models():
    from transformers import AutoModelForCausalLM, LlamaConfig

    yield "demo", AutoModelForCausalLM.from_pretrained(ROOT / "examples/demo/model")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    yield "llama_h128", AutoModelForCausalLM.from_config(config)


def timed(model, packed) -> float:
    from leangrpo.contracts import SamplingParams
    from leangrpo.model.scoring import score

    model.zero_grad(set_to_none=True)
    t0 = time.process_time()
    logprobs, entropy = score(model, packed, SamplingParams(), LOGPROBS, with_entropy=True)
    (logprobs.sum() + entropy.sum()).backward()
    return time.process_time() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--shapes", help="model:P:R,... instead of the default grid")
    args = p.parse_args()
    from leangrpo.ops.attention.adapter import enable_packed_attention
    from leangrpo.train.packing import pack_samples

    torch.set_num_threads(1)
    shapes = {
        "demo": [(6, 3), (6, 8), (16, 4), (3, 12), (2, 20)],
        "llama_h128": [(8, 8), (8, 32), (32, 8), (32, 32), (32, 128), (128, 32), (192, 64)]
        + [(4, 64), (8, 128), (16, 128)],  # prompt fractions 0.06-0.11
    }
    if args.shapes:
        shapes = {"demo": [], "llama_h128": []}
        for item in args.shapes.split(","):
            name, p_len, r = item.split(":")
            shapes[name].append((int(p_len), int(r)))
    for name, model in models():
        if not shapes[name]:
            continue
        model.train()
        enable_packed_attention(model, "sdpa_segments")
        limit = model.config.max_position_embeddings
        for p_len, r in shapes[name]:
            if p_len + 3 * r // 2 > limit:
                continue
            samples = batch(p_len, r, model.config.vocab_size, seed=p_len * 1000 + r)
            plain, prefix = pack_samples(samples), pack_samples(samples, shared_prefix=True)
            times = {"plain": [], "prefix": []}
            for rep in range(args.reps + 1):
                for variant, packed in (("plain", plain), ("prefix", prefix)):
                    t = timed(model, packed)
                    if rep:  # the first round warms up
                        times[variant].append(t)
            med = {k: statistics.median(v) for k, v in times.items()}
            prompt_tokens = sum(len(s.prompt.ids) for s in samples)
            print(
                json.dumps(
                    {
                        "bench": "prefix_rule",
                        "model": name,
                        "prompt_len": p_len,
                        "completion_median": r,
                        "tokens": {"plain": plain.num_tokens, "prefix": prefix.num_tokens},
                        "prompt_fraction": round(prompt_tokens / plain.num_tokens, 3),
                        "plain_cpu_s": round(med["plain"], 4),
                        "prefix_cpu_s": round(med["prefix"], 4),
                        "prefix_ratio": round(med["prefix"] / med["plain"], 3),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
