"""hf-engine generation alone on the demo, padding-heavy and large-vocabulary cases, A/B.

    python benchmarks/hf_decode.py --case padding --baseline-src /tmp/base/src
    python benchmarks/hf_decode.py --case vocab --baseline-src /tmp/base/src
    python benchmarks/hf_decode.py --case padding --compact 0,0.25,0.5,1.01

Each run loads the case's model and prompts (benchmarks/step_overhead.py builds the
padding case; `vocab` is vs_trl's case (c) model: a random 4-layer Llama with SmolLM2's
49,152-token vocabulary and tokenizer, 4 prompts, 64 new tokens), then times `HFEngine.generate(prompts, temperature 1, seed=rep, n=8)`
`--reps` times: wall and process CPU seconds (on a shared machine CPU seconds are the
steadier figure for a one-thread run), completion tokens per second (wall). Runs of the
variants alternate (baseline in a subprocess per repeat). `--compact` sweeps
`rollout.decode.COMPACT_FRACTION` in this checkout (how soon finished rows leave the
batch). One JSON object per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


def case_files(case: str, workdir: Path) -> tuple[Path, Path, int, int]:
    """(model dir, train file, prompts, max new tokens) as step_overhead.py runs them."""
    if case == "demo":
        return ROOT / "examples/demo/model", ROOT / "examples/demo/train.jsonl", 16, 6
    if case == "vocab":
        from vs_trl_cases import random_model

        from leangrpo.model.smollm2 import smollm2_dir

        model = workdir / "vocab" / "model"
        if not (model / "config.json").exists():
            random_model(model, smollm2_dir(), 49152, eos=2, pad=2, bos=1)
        return model, ROOT / "examples/demo/train.jsonl", 4, 64
    from step_overhead import padding_case

    model, train, _ = padding_case(workdir)
    return model, train, 8, 64


def measure(case: str, workdir: Path, reps: int, compact: float | None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from leangrpo.contracts import Prompt, SamplingParams
    from leangrpo.ops.attention.adapter import enable_packed_attention
    from leangrpo.rollout.hf.decode import decode
    from leangrpo.rollout.hf.engine import HFEngine

    torch.set_num_threads(1)
    model_dir, train, n_prompts, new = case_files(case, workdir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    enable_packed_attention(model, "sdpa_segments")  # as the trainer's model
    rows = [json.loads(s) for s in train.read_text().splitlines() if s][:n_prompts]
    prompts = [Prompt(i, r["prompt"], tok(r["prompt"])["input_ids"]) for i, r in enumerate(rows)]
    if compact is not None:
        decode.COMPACT_FRACTION = compact
    engine = HFEngine(model, tok)
    engine.generate(prompts, SamplingParams(max_new_tokens=new, seed=99), 8, 0)  # warm-up
    walls, cpus, tokens = [], [], []
    for rep in range(reps):
        params = SamplingParams(temperature=1.0, max_new_tokens=new, seed=rep)
        w, c = time.perf_counter(), time.process_time()
        groups = engine.generate(prompts, params, 8, 0)
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
        tokens.append(sum(len(c.ids) for g in groups for c in g))
    return {"wall_s": walls, "cpu_s": cpus, "tokens": tokens}


def summary(name: str, case: str, runs: list[dict]) -> dict:
    walls = [w for r in runs for w in r["wall_s"]]
    cpus = [c for r in runs for c in r["cpu_s"]]
    tokens = [t for r in runs for t in r["tokens"]]
    return {
        "bench": "hf_decode",
        "case": case,
        "variant": name,
        "calls": len(walls),
        "wall_s": round(statistics.median(walls), 4),
        "cpu_s": round(statistics.median(cpus), 4),
        "cpu_s_min": round(min(cpus), 4),
        "tokens_per_call": statistics.median(tokens),
        "tokens_per_s": round(statistics.median(t / w for t, w in zip(tokens, walls)), 1),
        "tokens_per_cpu_s": round(statistics.median(t / c for t, c in zip(tokens, cpus)), 1),
        "load_1min": round(os.getloadavg()[0], 1),
    }


def in_subprocess(src: Path, args, workdir: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", "--case", args.case, "--reps", str(args.reps)]
    cmd += ["--workdir", str(workdir)]
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    lines = [s for s in out.stdout.splitlines() if s.startswith("{")]
    if out.returncode or not lines:
        raise SystemExit(f"{src}: exit {out.returncode}\n{out.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--case", default="padding", choices=["demo", "padding", "vocab"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="alternations of the variants")
    p.add_argument("--baseline-src", type=Path)
    p.add_argument("--compact", help="comma-separated COMPACT_FRACTION values to sweep")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/leangrpo_bench"))
    p.add_argument("--child", action="store_true")
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.case, args.workdir, args.reps, None)))
        return
    case_files(args.case, args.workdir)
    compacts = [float(x) for x in args.compact.split(",")] if args.compact else [None]
    variants = {f"this compact={c}" if c is not None else "this": [] for c in compacts}
    base: list[dict] = []
    for _ in range(args.repeats):
        if args.baseline_src:
            base.append(in_subprocess(args.baseline_src.resolve(), args, args.workdir))
        for c, name in zip(compacts, variants):
            variants[name].append(
                in_subprocess(ROOT / "src", args, args.workdir)
                if c is None
                else measure(args.case, args.workdir, args.reps, c)
            )
    rows = [summary(name, args.case, runs) for name, runs in variants.items()]
    if base:
        rows.insert(0, summary("baseline", args.case, base))
        for row in rows[1:]:
            row["cpu_ratio"] = round(row["cpu_s"] / rows[0]["cpu_s"], 3)
            row["wall_ratio"] = round(row["wall_s"] / rows[0]["wall_s"], 3)
    for row in rows:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
