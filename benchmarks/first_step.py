"""Time to the first optimizer step, from a cold start, against TRL (baseline = TRL).

What a user waits for after typing the command: a fresh process each run, from its start
(interpreter, imports, data, model, workers, evaluation if the config asks for one at
step 0) to the end of the first optimizer step. Cases:

  demo        examples/demo.yaml: `leangrpo train` as shipped (its step-0 evaluation
              included) against TRL's GRPOTrainer on the same job (benchmarks/vs_trl.py
              case a: same model, data, reward, batch, lr)
  tools_demo  examples/tools_demo.yaml: the multi-turn tool demo against GRPOTrainer with
              `tools=[add]` (the same calculator, at most 2 calls, the math reward on the
              last turn; TRL's completion budget is the trajectory's 169 tokens after the
              23-token prompt) and a response template for the demo's chat format

leangrpo runs as the CLI; its first step ends when metrics.jsonl gets its step-1 row
(polled every 10 ms). TRL runs in a child whose step callback prints a line at the first
step's end. Either child is then killed. Runs alternate TRL / leangrpo. Figures: the
median of the runs; `time_s` the seconds to the first step's end, `peak_bytes` the peak
RSS of the child and its processes until then (sampled every 50 ms), and for leangrpo
`time_ratio` / `mem_ratio` against TRL measured in the same run.

    python benchmarks/first_step.py --quick          # one run per variant and case
    python benchmarks/first_step.py --repeats 3
    python benchmarks/first_step.py --only leangrpo  # no TRL needed
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_info import device_name  # noqa: E402
from vs_trl import CASES, Case  # noqa: E402

BENCH = "first_step"
VARIANTS = ("trl", "leangrpo")  # baseline first
YAML = {"demo": "examples/demo.yaml", "tools_demo": "examples/tools_demo.yaml"}
TOOLS_CASE = Case(
    name="tools_demo", title="tools_demo", model="tools_demo", data="tools_demo",
    prompts_per_step=16, group=8, max_new_tokens=192 - 23, lr=3e-4, steps=40,
    rewards=({"name": "math", "weight": 1.0, "kwargs": {"answer_column": "answer"}},),
    chat=True,
)  # fmt: skip
TRL_CASES = {"demo": CASES["a"], "tools_demo": TOOLS_CASE}
MARK = "FIRST STEP DONE"


def watch(cmd: list[str], done, timeout: float, cwd: Path) -> tuple[float, int, str]:
    """Run `cmd`; seconds until done(line_or_None) says so, the peak RSS until then (the
    process and its children), and the output's tail on failure."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed below)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env)
    peak, last_sample, seconds = 0, 0.0, None
    try:
        while time.perf_counter() - t0 < timeout:
            now = time.perf_counter()
            if now - last_sample >= 0.05:
                peak, last_sample = max(peak, tree_rss(proc.pid)), now
            log.seek(0)
            if done(log.read()):
                seconds = time.perf_counter() - t0
                break
            if proc.poll() is not None:
                break
            time.sleep(0.01)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
        proc.kill()
        proc.wait()
    log.seek(0)
    tail = log.read()[-600:]
    log.close()
    return (seconds if seconds is not None else float("nan")), peak, tail


def tree_rss(pid: int) -> int:
    total = 0
    with contextlib.suppress(psutil.NoSuchProcess):
        proc = psutil.Process(pid)
        for p in [proc, *proc.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += p.memory_info().rss
    return total


def run_leangrpo(case: str, workdir: Path, timeout: float) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"run-{case}-", dir=workdir))  # a fresh one each run
    metrics = out / "metrics.jsonl"
    cmd = [sys.executable, "-m", "leangrpo", "train", YAML[case], "--set", f"run.output_dir={out}",
           "--set", "run.overwrite=true", "--set", "logging.progress_bar=false"]  # fmt: skip

    def done(_output: str) -> bool:
        if not metrics.is_file():
            return False
        return any('"step": 1,' in line for line in metrics.read_text().splitlines())

    return result(*watch(cmd, done, timeout, ROOT))


def run_trl(case: str, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", case]
    return result(*watch(cmd, lambda output: MARK in output, timeout, ROOT))


def result(seconds: float, peak: int, tail: str) -> dict:
    if seconds != seconds:  # nan: it never got there
        return {"error": tail.strip().splitlines()[-1] if tail.strip() else "no output"}
    return {"time_s": seconds, "peak_bytes": peak}


# ----------------------------------------------------------------------------- TRL child


def trl_child(case_name: str) -> None:
    """Build GRPOTrainer on the case's job and train until the first step ends."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from vs_trl_runs import trl_args, trl_dataset, trl_reward

    torch.set_num_threads(1)
    case = TRL_CASES[case_name]
    folder = ROOT / "examples" / ("demo" if case_name == "demo" else "tools_demo")
    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    model = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32)
    kwargs = {}
    if case_name == "tools_demo":
        sys.path.insert(0, str(folder))
        from calculator import add

        tokenizer.response_template = TOOLS_DEMO_RESPONSE
        kwargs["tools"] = [add]

    class FirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            print(MARK, flush=True)
            os._exit(0)

    args = trl_args(case, Path(tempfile.mkdtemp(prefix="first_step_trl_")), "cpu")
    if case_name == "tools_demo":
        args.max_tool_calling_iterations = 2  # environment.max_turns 3: two calls, an answer
    trainer_cls = __import__("trl").GRPOTrainer
    trainer = trainer_cls(
        model=model,
        reward_funcs=[trl_reward(spec) for spec in case.rewards],
        args=args,
        train_dataset=trl_dataset(str(folder / "train.jsonl"), case),
        processing_class=tokenizer,
        callbacks=[FirstStep()],
        **kwargs,
    )
    trainer.train()


# transformers' response parsing for the tool demo's chat format (TRL knows the formats of
# published templates only): the assistant turn after <|assistant|>, Hermes tool calls,
# the turn's text up to <|end|>
TOOLS_DEMO_RESPONSE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>", "close_pattern": r"</tool_call>", "repeats": True,
            "content": "json", "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|end\|>", "content": "text"},
    },
}  # fmt: skip


# ----------------------------------------------------------------------------- parent


def summarise(case: str, variant: str, runs: list[dict], device: str) -> dict:
    row = {"bench": BENCH, "case": case, "device": device, "variant": variant}
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {**row, "error": runs[0]["error"] if runs else "not run"}
    return {
        **row,
        "time_s": statistics.median(r["time_s"] for r in ok),
        "peak_bytes": int(statistics.median(r["peak_bytes"] for r in ok)),
        "runs": len(ok),
        "per_run_time_s": [round(r["time_s"], 2) for r in ok],
    }


def run_case(case: str, variants: list[str], repeats: int, timeout: float) -> list[dict]:
    device = device_name("cpu", threads=1)
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="first_step_") as tmp:
        for _ in range(repeats):
            for variant in variants:
                one = run_trl(case, timeout) if variant == "trl" else run_leangrpo(case, Path(tmp), timeout)
                runs[variant].append(one)
    rows = [summarise(case, v, runs[v], device) for v in variants]
    base = next((r for r in rows if r["variant"] == "trl" and "error" not in r), None)
    for row in rows:
        if row["variant"] != "trl" and base is not None and "error" not in row:
            row["time_ratio"] = row["time_s"] / base["time_s"]
            row["mem_ratio"] = row["peak_bytes"] / base["peak_bytes"]
            pairs = zip(runs["leangrpo"], runs["trl"])
            row["paired_time_ratios"] = [
                round(a["time_s"] / b["time_s"], 3) for a, b in pairs
                if "error" not in a and "error" not in b
            ]  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--case", choices=sorted(YAML), action="append", help="run only these cases")
    p.add_argument("--quick", action="store_true", help="one run per variant and case")
    p.add_argument("--repeats", type=int, default=3, help="alternating runs per variant")
    p.add_argument("--only", choices=VARIANTS, default=None, help="run one side only")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--child", choices=sorted(TRL_CASES), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        trl_child(args.child)
        return
    variants = [v for v in VARIANTS if args.only in (None, v)]
    if "trl" in variants and importlib.util.find_spec("trl") is None:
        if args.only == "trl":
            print(json.dumps({"bench": BENCH, "skipped": "TRL is not installed (make setup-bench)"}))
            return
        print(json.dumps({"bench": BENCH, "note": "TRL is not installed (make setup-bench): leangrpo alone"}))
        variants = ["leangrpo"]
    repeats = 1 if args.quick else args.repeats
    for case in args.case or sorted(YAML):
        for row in run_case(case, variants, repeats, args.timeout):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
