"""Every GPU measurement of leangrpo in one run of at most 8m40s, each case capped.

    PYTHONUNBUFFERED=1 bash benchmarks/gpu_suite.sh          # on a CUDA machine
    python benchmarks/gpu_suite.py --dry-run                  # tiny shapes on CPU (CI)
    python benchmarks/gpu_suite.py --only logprobs,grpo_8b    # rerun some cases

Cases run one after another, cheapest first and the slowest last, each in a child
process forked after the heavy imports (torch, transformers, leangrpo: paid once) with its
own time cap on the device; a case that fails or runs out of time prints one line, keeps
the rows it already produced, and the suite goes on. The parent never touches CUDA: each child
initialises it afresh (`--start spawn` runs children as new interpreters instead, and is
chosen automatically if an import did initialise CUDA).

Budget on one H200 (seconds; with start-up they add up to the 520 s total, a deadline
counted from when gpu_suite.sh started). A case may also use what the cases before it
left unused, never the budgets of the cases after it, so the cases whose time is least
certain (those that compile kernels) come late:
    start-up 20 (wheels, CUDA check, imports) | env 10 | shared_weights 5 | grpo_1.5b 30
    | generation 35 | offload 45 | packing 35 | pytest_gpu 60 | qlora_1.5b 40
    | context_parallel 25 | packing_flex 30 | logprobs 85 | grpo_8b 100
(shared_weights needs vLLM, which the GPU image lacks: it then says so in a second, and
its time flows to the cases after it; with vLLM, run it alone: --only shared_weights.
context_parallel runs C = 1 on one GPU, C = 2 where two are visible.)

A case also fails when a row it produced holds an `error` (one variant's failure is a
row, so a stale import would otherwise pass as "ok"; on the device an out-of-memory row is
a measurement, not a failure), or when no row carries every figure the case exists for
(`CaseSpec.figures`; a case whose every row says why it was skipped is ok). The dry run
exits 1 unless every case is ok; it has no budget (its verdict is what the cases do, never
how fast a loaded CI machine does it): a case is stopped there only as a hang, after
`sc.DRY_HANG_S`.

Output, in $OUT (or --out, default runs/gpu_suite): results.jsonl (every row: the DESIGN.md
benchmark format plus goal/goal_met/note; one `suite` row per case with its status),
summary.md (the tables printed at the end), suite.log (everything the cases printed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # is_available() without cuInit
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "src")]

import suite_cases as sc  # noqa: E402
import torch  # noqa: E402

ROW = "@@ROW "  # the prefix of a result line on a child's stdout
TOTAL_BUDGET_S = 520


@dataclass(frozen=True)
class CaseSpec:
    name: str
    budget_s: float  # cap on the GPU machine (a dry run has none, see the docstring)
    run: object  # Ctx -> iterator of rows
    figures: tuple[str, ...] = ()  # what the case measures: some row carries all of them


STARTUP_S = 20
GRPO = ("time_s", "planned_total", "loss")
CASES = [  # cheapest and surest first; cases that compile kernels late, where slack flows
    CaseSpec("env", 10, sc.env_case, ("torch", "transformers")),
    CaseSpec("shared_weights", 5, sc.shared_weights_case, ("time_s",)),  # no vLLM on it
    CaseSpec(
        "grpo_1.5b", 30, lambda c: sc.grpo_case(c, "qwen2.5-1.5b", "tiny-qwen2", 5, True), GRPO
    ),
    CaseSpec("generation", 35, sc.generation_case, ("tokens_per_s",)),
    CaseSpec("offload", 45, sc.offload_case, ("time_s", "time_ratio", "moved_fraction")),
    CaseSpec("packing", 35, sc.packing_case, ("time_s", "speedup", "logprob_diff_vs_padded")),
    CaseSpec("pytest_gpu", 60, sc.pytest_case, ("exit_code", "passed")),
    CaseSpec(  # bitsandbytes: carried in .whl/
        "qlora_1.5b", 40, sc.qlora_case, ("time_s", "peak_bytes", "weights_bytes", "mem_ratio")
    ),
    CaseSpec(  # C = 2 needs 2 GPUs: one GPU measures C = 1
        "context_parallel", 25, sc.context_parallel_case, ("peak_bytes", "time_s")
    ),
    # flex compiles its kernels: on the device it yields speedup rows, on CPU padded ones
    CaseSpec("packing_flex", 30, lambda c: sc.packing_case(c, ("flex",)), ("time_s",)),
    CaseSpec("logprobs", 85, sc.logprobs_case, ("time_s", "peak_bytes", "mem_ratio")),
    CaseSpec(
        "grpo_8b", 100, lambda c: sc.grpo_case(c, "llama-3.1-8b", "tiny-llama", 40, False), GRPO
    ),
]
assert STARTUP_S + sum(c.budget_s for c in CASES) == TOTAL_BUDGET_S


def heavy_imports() -> None:
    """Import once in the parent what every child needs (never initialises CUDA)."""
    import async_overlap  # noqa: F401
    import context_parallel  # noqa: F401
    import grpo_step  # noqa: F401
    import hf_generation  # noqa: F401
    import logprob_memory  # noqa: F401
    import offload  # noqa: F401
    import packing  # noqa: F401
    import peft.tuners.lora  # noqa: F401
    import pytest  # noqa: F401
    import qlora  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401


# -- the child side -------------------------------------------------------------------------


def run_case_here(spec: CaseSpec, dry: bool) -> int:
    """Run one case in this process, rows on stdout; the exit status says how it ended."""
    if dry:
        torch.set_num_threads(1)  # tiny shapes on shared cores: one thread is fastest
    device = torch.device("cpu" if dry else "cuda")
    ctx = sc.Ctx(dry=dry, device=device)
    try:
        for row in spec.run(ctx):
            row.setdefault("device", "cpu" if dry else torch.cuda.get_device_name())
            print(ROW + json.dumps(row, default=str), flush=True)
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    return 0


def _fork_child(spec: CaseSpec, dry: bool, out_w: int, err_w: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: a timeout kills compile workers too
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        code = run_case_here(spec, dry)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _spawn_child(spec: CaseSpec, dry: bool, out_w: int, err_w: int) -> int:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run-case", spec.name]
    proc = subprocess.Popen(
        cmd + (["--dry-run"] if dry else []),
        stdout=out_w,
        stderr=err_w,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    return proc.pid


# -- the parent side ------------------------------------------------------------------------


@dataclass
class Outcome:
    name: str
    status: str  # ok | failed | timeout | skipped
    wall_s: float
    rows: list[dict]
    message: str = ""


def run_case(spec: CaseSpec, dry: bool, cap_s: float, start: str, log) -> Outcome:
    """Start the child, stream its output into the log, kill it at the cap.

    The child's end is noticed by waitpid, not by end-of-file: workers it started (compile
    pools) may hold the pipes open after it has exited.
    """
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    launch = _fork_child if start == "fork" else _spawn_child
    begin = time.monotonic()
    pid = launch(spec, dry, out_w, err_w)
    os.close(out_w)
    os.close(err_w)
    reader = _Reader(spec.name, out_r, err_r, log)
    status = None
    while status is None:
        left = cap_s - (time.monotonic() - begin)
        if left <= 0:
            break
        reader.poll(min(left, 0.5))
        done, wait_status = os.waitpid(pid, os.WNOHANG)
        if done:
            status = wait_status
            reader.poll(0.2)  # what it wrote just before exiting
    _kill_group(pid)
    if status is None:
        os.waitpid(pid, 0)
    reader.close()
    wall = time.monotonic() - begin
    if status is None:
        return Outcome(
            spec.name, "timeout", wall, reader.rows, f"stopped at its cap of {cap_s:.0f} s"
        )
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        return Outcome(spec.name, "failed", wall, reader.rows, reader.last_err or f"exit {code}")
    problem = rows_problem(reader.rows, spec.figures, dry)
    return Outcome(spec.name, "failed" if problem else "ok", wall, reader.rows, problem)


def rows_problem(rows: list[dict], figures: tuple[str, ...], dry: bool) -> str:
    """Why a case whose child exited cleanly failed all the same ("" if it did not): a row
    holding an error (on the device, an out-of-memory row is a measurement), or no row
    carrying every figure the case exists for (unless every row says it was skipped)."""
    for row in rows:
        error = row.get("error")
        if error and (dry or "out of memory" not in str(error).lower()):
            where = "/".join(str(row.get(k)) for k in ("bench", "case", "variant"))
            return f"row {where} holds an error: {error}"
    if not figures or (rows and all("skipped" in row for row in rows)):
        return ""
    if not any(all(row.get(key) is not None for key in figures) for row in rows):
        return f"no row carries {', '.join(figures)}, the figures this case measures"
    return ""


class _Reader:
    """Splits a child's stdout and stderr into lines: log all, collect rows, keep the last error."""

    def __init__(self, case: str, out_fd: int, err_fd: int, log):
        self.case, self.out_fd, self.log = case, out_fd, log
        self.rows: list[dict] = []
        self.last_err = ""
        self.partial = {out_fd: b"", err_fd: b""}
        self.sel = selectors.DefaultSelector()
        for fd in self.partial:
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ)

    def poll(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout=timeout):
            try:
                chunk = os.read(key.fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:  # end of file
                self.sel.unregister(key.fd)
                self._lines(key.fd, self.partial[key.fd] + b"\n")
                self.partial[key.fd] = b""
                continue
            *complete, self.partial[key.fd] = (self.partial[key.fd] + chunk).split(b"\n")
            self._lines(key.fd, b"\n".join(complete))

    def _lines(self, fd: int, data: bytes) -> None:
        is_err = fd != self.out_fd
        for raw in data.split(b"\n"):
            text = raw.decode(errors="replace").rstrip()
            if not text:
                continue
            self.log.write(f"[{self.case}{' err' if is_err else ''}] {text}\n")
            if is_err:
                self.last_err = text
            elif text.startswith(ROW):
                try:
                    self.rows.append(json.loads(text[len(ROW) :]))
                except json.JSONDecodeError:
                    self.log.write(f"[{self.case}] (unreadable row above)\n")
        self.log.flush()

    def close(self) -> None:
        for fd, rest in self.partial.items():
            if rest:
                self._lines(fd, rest)
            os.close(fd)
        self.sel.close()


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(pid, signal.SIGKILL)


# -- summary ----------------------------------------------------------------------------------


def summary_markdown(outcomes: list[Outcome], dry: bool, budgets: dict) -> str:
    """The results table, then the per-case table last (a reply shows the output's tail)."""
    env = next((r for o in outcomes for r in o.rows if r.get("bench") == "env"), {})
    when = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    head = f"# leangrpo GPU suite{' (dry run, tiny shapes on CPU)' if dry else ''}"
    lines = [head, "", f"{when} UTC, {env.get('note', 'environment unknown')}", ""]
    lines += [
        "| bench | case | variant | time s | peak GB | time ratio | mem ratio | note | goal |"
    ]
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for o in outcomes:
        lines += [_result_line(r) for r in o.rows if r.get("bench") != "env"]
    lines += [
        "",
        "| case | status | budget s | wall s | rows | message |",
        "|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        msg = o.message.replace("|", "/")[:160]
        budget = "-" if budgets[o.name] is None else f"{budgets[o.name]:.0f}"
        lines.append(
            f"| {o.name} | {o.status} | {budget} | {o.wall_s:.1f} | {len(o.rows)} | {msg} |"
        )
    return "\n".join(lines) + "\n"


def _result_line(r: dict) -> str:
    goal = "" if "goal_met" not in r else ("met" if r["goal_met"] else "MISSED")
    if goal:
        goal += f": {r['goal']}"
    if "plan_goal_met" in r:
        goal += f"{'; ' if goal else ''}plan {'met' if r['plan_goal_met'] else 'MISSED'}"
    note = r.get("note") or r.get("skipped") or r.get("error") or ""
    peak = None if r.get("peak_bytes") is None else r["peak_bytes"] / 1e9
    cells = [
        r.get("bench", ""),
        r.get("case", ""),
        r.get("variant", ""),
        _num(r.get("time_s")),
        _num(peak),
        _num(r.get("time_ratio")),
        _num(r.get("mem_ratio")),
        str(note).replace("|", "/"),
        goal,
    ]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _num(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, float)):
        return f"{value:.4g}"
    return str(value)


# -- main -----------------------------------------------------------------------------------


def _out_dir(arg: str | None) -> Path:
    out = Path(arg or os.environ.get("OUT") or HERE.parent / "runs" / "gpu_suite")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (CI)")
    p.add_argument("--out", default=None, help="output folder (default $OUT or runs/gpu_suite)")
    p.add_argument("--only", default=None, help=f"comma list of {[c.name for c in CASES]}")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="total seconds on the device (520); a dry run has none",
    )
    p.add_argument("--start", choices=("fork", "spawn"), default="fork", help="how children start")
    p.add_argument("--run-case", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def case_cap(i: int, selected, budgets: dict, deadline: float | None) -> float:
    """Case i's cap: on the device its budget plus what earlier cases left (a late start-up
    shortens a case, never skips it; under 5 s: skipped); a dry run (no deadline) stops a
    case only as a hang."""
    if deadline is None:
        return sc.DRY_HANG_S
    reserved = sum(budgets[s.name] for s in selected[i + 1 :])
    cap = deadline - time.time() - reserved
    return max(cap, 5.0) if time.time() < deadline else cap


def run_all(selected, budgets: dict, deadline: float | None, dry: bool, start: str, out: Path):
    """Every selected case in turn; rows and one `suite` row per case into results.jsonl."""
    outcomes = []
    with open(out / "suite.log", "w") as log, open(out / "results.jsonl", "w") as results:
        for i, spec in enumerate(selected):
            cap = case_cap(i, selected, budgets, deadline)
            if cap < 5:
                outcome = Outcome(spec.name, "skipped", 0.0, [], "the suite's time budget is spent")
            else:
                outcome = run_case(spec, dry, cap, start, log)
            if spec.name == "env" and outcome.status != "ok" and start == "fork":
                # the first CUDA use: if a forked child cannot initialise CUDA, stop forking
                print(f"[env] {outcome.status} in a forked child ({outcome.message}); spawning")
                start = "spawn"
                outcome = run_case(spec, dry, cap, start, log)
            outcomes.append(outcome)
            suite_row = {
                "bench": "suite",
                "case": spec.name,
                "variant": outcome.status,
                "time_s": round(outcome.wall_s, 2),
                "budget_s": budgets[spec.name],
                "rows": len(outcome.rows),
                "message": outcome.message,
            }
            for row in [*outcome.rows, suite_row]:
                results.write(json.dumps(row) + "\n")
            results.flush()
            extra = f": {outcome.message}" if outcome.message else ""
            print(
                f"[{spec.name}] {outcome.status} in {outcome.wall_s:.1f} s "
                f"(cap {cap:.0f} s), {len(outcome.rows)} rows{extra}",
                flush=True,
            )
    return outcomes


def main() -> int:
    args = _parse()
    specs = {c.name: c for c in CASES}
    if args.run_case:  # a spawned child
        heavy_imports()
        return run_case_here(specs[args.run_case], args.dry_run)
    names = args.only.split(",") if args.only else list(specs)
    unknown = [n for n in names if n not in specs]
    if unknown:
        print(f"gpu_suite: unknown case {unknown}; choose from {list(specs)}")
        return 2
    selected = [specs[n] for n in names]
    budget = None if args.dry_run else (args.budget_s or TOTAL_BUDGET_S)
    t0 = float(os.environ.get("GPU_SUITE_T0") or time.time())
    deadline = None if budget is None else t0 + budget
    start = args.start
    if start == "fork":  # children inherit the imports; spawned ones import for themselves
        heavy_imports()
    if start == "fork" and torch.cuda.is_initialized():  # a fork could not use CUDA then
        print("CUDA was initialised by an import: children start as new interpreters")
        start = "spawn"
    out = _out_dir(args.out)
    budgets = {c.name: (None if args.dry_run else c.budget_s) for c in selected}
    outcomes = run_all(selected, budgets, deadline, args.dry_run, start, out)
    text = summary_markdown(outcomes, args.dry_run, budgets)
    (out / "summary.md").write_text(text)
    print("\n" + text)
    of = "" if budget is None else f" of {budget:.0f}"
    print(f"total {time.time() - t0:.1f} s{of}; files in {out}")
    if args.dry_run and any(o.status != "ok" for o in outcomes):  # CI: a broken benchmark fails
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
