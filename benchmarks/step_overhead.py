"""Per-phase wall time of leangrpo steps, A/B against another checkout (issue 12).

    python benchmarks/step_overhead.py --case demo --steps 20 --repeats 3 \\
        --baseline-src /tmp/base/src          # interleaved: base, this, base, this, ...

Each run is a subprocess training `--steps` optimizer steps of the case with the trainer
of the given source tree (PYTHONPATH), timing, per step: generation, rewards, score (plan
+ old/reference passes), train (forward, backward, optimizer), weight sync, the rest of
the step ("other": logging, metrics), and separately each evaluation and each
checkpoint. Per run the median over steps (the first step is warm-up and left out); per
variant the median over runs, with min and max (the spread, on a shared machine). Then
`ratio` = this / baseline per phase. One JSON object per line; `--out FILE` appends them.

Cases: `demo` (examples/demo.yaml as shipped, eval every 10 steps, a checkpoint every
10); `tools_demo` (examples/tools_demo.yaml, the multi-turn tool demo, the same
schedule); `padding` (padding-heavy: a random 4-layer Llama on the demo's 32-token vocabulary,
every second prompt carries a ~180-token prefix of solved problems, 64 new tokens whose
lengths vary (EOS has p ~ 1/32 a step), a length reward; 8 prompts x 8).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("generate", "rewards", "score", "train", "sync", "other", "step", "eval", "checkpoint")


# ------------------------------------------------------------------------------- cases


def case_overrides(case: str, workdir: Path, steps: int) -> tuple[str, list[str]]:
    common = [
        f"run.max_steps={steps}",
        "run.resume=never",
        "logging.progress_bar=false",
        "eval.every_steps=10",
        "checkpoint.every_steps=10",
    ]
    if case == "demo":
        return str(ROOT / "examples/demo.yaml"), common
    if case == "tools_demo":  # multi-turn: the calculator in an environment worker
        return str(ROOT / "examples/tools_demo.yaml"), common
    if case == "padding":
        model, train, evals = padding_case(workdir)
        return str(ROOT / "examples/demo.yaml"), [
            *common,
            f"model.name_or_path={model}",
            f"data.path={train}",
            f"data.eval_path={evals}",
            "eval.num_prompts=32",
            "rollout.prompts_per_batch=8",
            "rollout.max_new_tokens=64",
            "train.learning_rate=1e-3",
            'rewards.functions=[{"name": "length", "kwargs": {"target": 24, "tolerance": 4}}]',
        ]
    raise SystemExit(f"unknown case {case!r}: demo, tools_demo or padding")


def padding_case(workdir: Path) -> tuple[Path, Path, Path]:
    """Prefixed demo prompts and a random 4-layer model with 2048 positions (seeded)."""
    demo = ROOT / "examples/demo"
    out = workdir / "padding"
    if (out / "done").exists():
        return out / "model", out / "train.jsonl", out / "eval.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(s) for s in (demo / "train.jsonl").read_text().splitlines() if s]
    evals = [json.loads(s) for s in (demo / "eval.jsonl").read_text().splitlines() if s]
    for name, part, seed in (("train.jsonl", rows, 0), ("eval.jsonl", evals, 1)):
        rng = random.Random(seed)
        lines = []
        for i, row in enumerate(part):
            if i % 2:
                shots = rng.sample(rows, 20)
                row = {
                    **row,
                    "prompt": "".join(f"{r['prompt']}{r['answer']}\n" for r in shots)
                    + row["prompt"],
                }
            lines.append(json.dumps(row))
        (out / name).write_text("\n".join(lines) + "\n")
    from vs_trl_cases import random_model  # the same seeded model vs_trl's case (b) runs

    random_model(out / "model", demo / "model", 32, eos=1, pad=0, bos=None)
    (out / "done").write_text("")
    return out / "model", out / "train.jsonl", out / "eval.jsonl"


# ------------------------------------------------------------------------------- child


def child(args) -> None:
    import torch  # noqa: F401  (imported before timing)

    import leangrpo
    from leangrpo.config import load_config
    from leangrpo.train import Trainer

    config, overrides = case_overrides(args.case, Path(args.workdir), args.steps)
    out_dir = Path(args.workdir) / f"run-{os.getpid()}"
    cfg = load_config(config, [*overrides, f"run.output_dir={out_dir}", *args.overrides])
    ends, per_step, extra = [], [], {"eval": [], "checkpoint": []}

    class Timed(Trainer):
        def on_step_end(self, metrics, batch):
            self._eval_s = self._ckpt_s = 0.0
            super().on_step_end(metrics, batch)
            ends.append(time.perf_counter())
            per_step.append(
                {
                    "generate": metrics.get("time/generate", 0.0),
                    "rewards": metrics.get("time/rewards", 0.0),
                    "score": metrics.get("time/score", 0.0),
                    "train": metrics["time/train"],
                    "sync": metrics.get("time/weight_sync", 0.0),
                    "eval_in_step": self._eval_s,
                    "checkpoint_in_step": self._ckpt_s,
                }
            )

        def save_checkpoint(self):
            t0 = time.perf_counter()
            try:
                return super().save_checkpoint()
            finally:
                self._ckpt_s = getattr(self, "_ckpt_s", 0.0) + time.perf_counter() - t0
                extra["checkpoint"].append(time.perf_counter() - t0)

    t_start = time.perf_counter()
    trainer = Timed(cfg)
    run_eval = trainer.evaluator.run

    def timed_eval(version, step):
        t0 = time.perf_counter()
        try:
            return run_eval(version, step)
        finally:
            trainer._eval_s = getattr(trainer, "_eval_s", 0.0) + time.perf_counter() - t0
            extra["eval"].append(time.perf_counter() - t0)

    trainer.evaluator.run = timed_eval  # an instance attribute: timing only
    t_built = time.perf_counter()
    trainer.train()
    t_end = time.perf_counter()
    steps = []
    for i in range(1, len(ends)):  # step 1 is warm-up
        p = per_step[i]
        wall = ends[i] - ends[i - 1] - p["eval_in_step"] - p["checkpoint_in_step"]
        named = sum(p[k] for k in ("generate", "rewards", "score", "train", "sync"))
        steps.append({**p, "step": wall, "other": wall - named})
    med = {k: statistics.median(s[k] for s in steps) for k in PHASES[:7]}
    med["eval"] = statistics.median(extra["eval"]) if extra["eval"] else float("nan")
    med["checkpoint"] = (
        statistics.median(extra["checkpoint"]) if extra["checkpoint"] else float("nan")
    )
    result = {
        "source": str(Path(leangrpo.__file__).resolve().parent),
        "phases": med,
        "setup_s": t_built - t_start,
        "run_s": t_end - t_start,
        "evals": len(extra["eval"]),
        "checkpoints": len(extra["checkpoint"]),
        "final_eval": trainer_final(out_dir),
    }
    print(json.dumps(result), flush=True)


def trainer_final(out_dir: Path) -> float:
    rows = [json.loads(s) for s in (out_dir / "metrics.jsonl").read_text().splitlines() if s]
    return [r["eval/reward"] for r in rows if "eval/reward" in r][-1]


# ------------------------------------------------------------------------------ parent


def run_child(src: Path, args, workdir: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", "--case", args.case, "--steps", str(args.steps)]
    cmd += ["--workdir", str(workdir)] + [x for o in args.overrides for x in ("--set", o)]
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    lines = [s for s in out.stdout.splitlines() if s.startswith("{")]
    if out.returncode or not lines:
        raise SystemExit(f"{src}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def summarise(name: str, runs: list[dict]) -> dict:
    row = {"variant": name, "runs": len(runs)}
    for k in PHASES:
        values = [r["phases"][k] for r in runs]
        row[k] = {
            "median": round(statistics.median(values), 4),
            "min": round(min(values), 4),
            "max": round(max(values), 4),
        }
    row["run_s"] = round(statistics.median(r["run_s"] for r in runs), 2)
    row["final_eval"] = [r["final_eval"] for r in runs]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--case", default="demo")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline-src", type=Path, help="src/ of the baseline checkout")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--workdir")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", type=Path)
    p.add_argument("--child", action="store_true")
    args = p.parse_args()
    if args.child:
        return child(args)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="step_overhead_"))
    variants = [("this", ROOT / "src")]
    if args.baseline_src:
        variants.insert(0, ("baseline", args.baseline_src.resolve()))
    case_overrides(args.case, workdir, args.steps)  # build the case's files once
    runs: dict[str, list[dict]] = {name: [] for name, _ in variants}
    loads = []
    for _ in range(args.repeats):
        for name, src in variants:
            loads.append(os.getloadavg()[0])
            runs[name].append(run_child(src, args, workdir))
    meta = {
        "bench": "step_overhead",
        "case": args.case,
        "steps": args.steps,
        "device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "load_1min": [round(x, 1) for x in loads],
    }
    rows = [{**meta, **summarise(name, runs[name])} for name, _ in variants]
    if args.baseline_src:
        base, this = rows
        rows.append(
            {
                **meta,
                "variant": "ratio this/baseline",
                **{
                    k: round(this[k]["median"] / base[k]["median"], 3)
                    for k in PHASES
                    if base[k]["median"] > 0
                },
            }
        )
    for row in rows:
        print(json.dumps(row), flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
