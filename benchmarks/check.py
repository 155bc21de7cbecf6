"""`leangrpo check CONFIG` from a cold process: its wall and CPU time (baseline = the first
check of a model, which loads its tokenizer with transformers and torch).

What a user waits for before a run: a fresh `python -m leangrpo check CONFIG` each run,
from its start to its exit (interpreter, imports, every cheap check, the run directory's
decision, the tokenizer, every prompt rendered and tokenised, for an environment its
workers started, the template checked and a reset probed). Variants:

  cold     no tokenizer record in a fresh $LEANGRPO_CACHE: the tokenizer is loaded with
           transformers (torch imported), as every check did before, and recorded
  record   the record the cold check (or any earlier run) left: read without transformers
           or torch (model/tokenizer.py `recall`), the same checks made with it

Cases: demo (examples/demo.yaml) and tools_demo (examples/tools_demo.yaml: an
environment, its worker processes and the chat template). Figures: the median of the runs;
`time_s` the wall seconds, `cpu_s` the CPU seconds of the check and every process it
started (what a busy machine stretches the wall time of, not the work), `peak_bytes` the
peak RSS of the process tree (sampled every 20 ms); `record` rows carry `time_ratio` and
`mem_ratio` against `cold` measured in the same run. The `device` says the load average:
on a shared machine the wall time is only as good as the load was low. A check that does
not end with its OK line fails the benchmark (non-zero exit).

    python benchmarks/check.py --quick           # one run per variant and case
    python benchmarks/check.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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

BENCH = "check"
VARIANTS = ("cold", "record")  # baseline first
YAML = {"demo": "examples/demo.yaml", "tools_demo": "examples/tools_demo.yaml"}
OK_LINE = "leangrpo check: OK"


def check_once(config: str, cache: Path, timeout: float) -> dict:
    """One `leangrpo check` in a fresh process: wall and CPU seconds, peak RSS."""
    env = {**os.environ, "LEANGRPO_CACHE": str(cache),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    out = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed below)
    before = _children_cpu()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "leangrpo", "check", config], stdout=out, stderr=subprocess.STDOUT,
        cwd=ROOT, env=env,
    )  # fmt: skip
    watched, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        if time.perf_counter() - t0 > timeout:
            proc.kill()
            break
        peak = max(peak, _tree_rss(watched))
        time.sleep(0.02)
    seconds = time.perf_counter() - t0
    proc.wait()
    cpu = _children_cpu() - before  # the check's, and its workers' (it reaps them)
    out.seek(0)
    text = out.read()
    out.close()
    if proc.returncode != 0 or OK_LINE not in text:
        raise RuntimeError(
            f"leangrpo check {config} failed (exit {proc.returncode}): {text[-800:]}"
        )
    return {"time_s": seconds, "cpu_s": cpu, "peak_bytes": peak}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _tree_rss(proc: psutil.Process) -> int:
    """The tree's RSS now (processes that ended between samples are not counted)."""
    total = 0
    try:
        members = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for p in members:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


def run_case(case: str, repeats: int, timeout: float) -> dict[str, list[dict]]:
    """`repeats` cold checks (each in a fresh cache) and as many with the record."""
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="check-bench-") as tmp:
        for i in range(repeats):
            cache = Path(tmp) / f"cache-{i}"  # empty: the first check is cold
            runs["cold"].append(check_once(YAML[case], cache, timeout))
            runs["record"].append(check_once(YAML[case], cache, timeout))
    return runs


def summarise(case: str, variant: str, runs: list[dict], device: str) -> dict:
    return {
        "bench": BENCH, "case": case, "device": device, "variant": variant,
        "time_s": statistics.median(r["time_s"] for r in runs),
        "cpu_s": statistics.median(r["cpu_s"] for r in runs),
        "peak_bytes": int(statistics.median(r["peak_bytes"] for r in runs)),
        "runs": len(runs),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one run per variant and case")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", nargs="+", default=list(YAML), choices=list(YAML))
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    for case in args.cases:
        runs = run_case(case, repeats, args.timeout)
        device = device_name("cpu", threads=1)
        base = summarise(case, "cold", runs["cold"], device)
        print(json.dumps(base), flush=True)
        row = summarise(case, "record", runs["record"], device)
        row["time_ratio"] = row["time_s"] / base["time_s"]
        row["mem_ratio"] = row["peak_bytes"] / base["peak_bytes"]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
