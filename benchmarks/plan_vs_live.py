"""`leangrpo plan` against one real training pass of a config's model, on CPU (seconds).

    python benchmarks/plan_vs_live.py [CONFIG] [--groups 4] [--prompt 62] [--completion 8]

Loads the policy as the trainer does (`model.load_policy`), packs `groups` prompt groups of
rollout.num_generations completions of exactly these lengths (random tokens; shared prefix
as the config chooses it), and runs the forward, loss and backward of `step.train_step`
once. Prints one JSON line: the live bytes at the pass's peak (every storage an op
allocates, tests/support/memory_probe.LiveBytes: deterministic), the plan's training pass
(`training_pass`: its peak) for the same tokens and prompt length, their relative error, and the process's
RSS after the imports, after loading and after the pass (RSS - the live bytes = what glibc
keeps after frees, which the plan does not count).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

from support.memory_probe import LiveBytes, group, train_pass  # noqa: E402

from leangrpo.config import load_config  # noqa: E402
from leangrpo.model.policy import load_policy, load_tokenizer  # noqa: E402
from leangrpo.ops.attention.adapter import choose_shared_prefix  # noqa: E402
from leangrpo.planner.plan import TRAINING_PASS, plan_memory  # noqa: E402
from leangrpo.train.packing import pack_samples  # noqa: E402

GIB = 2**30


def rss() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / GIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=str(ROOT / "examples/smollm2_cpu.yaml"))
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=62)
    parser.add_argument("--completion", type=int, default=8)
    args = parser.parse_args()
    cfg = load_config(args.config, [])
    torch.set_num_threads(cfg.run.num_threads or 1)
    row = {"bench": "plan_vs_live", "config": args.config, "rss_imports_gib": rss()}
    policy = load_policy(cfg, load_tokenizer(cfg.model), torch.device("cpu"))
    row["rss_loaded_gib"] = rss()
    vocab = policy.model.get_input_embeddings().num_embeddings
    g = cfg.rollout.num_generations
    samples = [
        dataclasses.replace(s, group_id=k)
        for k in range(args.groups)
        for s in group(vocab, g, args.prompt, args.completion, seed=k)
    ]
    stats = {"prompt_fraction": args.prompt / (args.prompt + args.completion), "group_size": g}
    shared = choose_shared_prefix(cfg.packing.shared_prefix, policy.attention_backend, stats)
    batch = pack_samples(samples, shared_prefix=shared)
    forward = train_pass(policy, batch, cfg)
    live = LiveBytes().peak_of(lambda: forward().backward())
    tokens = batch.input_ids.numel()
    plan = plan_memory(cfg, tokens=tokens, prompt_tokens=args.prompt)
    planned = plan[TRAINING_PASS]
    row.update(
        tokens=tokens,
        shared_prefix=shared,
        live_peak_gib=round(live / GIB, 4),
        planned_gib=round(planned / GIB, 4),
        error=round((planned - live) / live, 4),
        rss_after_pass_gib=round(rss(), 3),
        rss_peak_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
    )
    row["rss_imports_gib"], row["rss_loaded_gib"] = (
        round(row["rss_imports_gib"], 3),
        round(row["rss_loaded_gib"], 3),
    )
    print(json.dumps(row))


if __name__ == "__main__":
    main()
