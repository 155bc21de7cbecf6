"""What the sandbox costs.  python benchmarks/sandbox.py [--quick] [--src DIR] [--before DIR]

Per sandbox level (sandbox/levels.py), `process` and `namespace`. Cases:

- `start-up`: one reward worker (the `length` built-in) from `RewardPool(...)` until it
  has scored its first call: interpreter, confinement, imports.
- `reward call`: `RewardPool.score` of one prompt's 8 samples with `length` (one call),
  calls back to back (no compute: the per-call cost of the round trip, the call's box
  and its clean-up).
- `reward call (math)`: the same with `math` (math-verify imported: a larger worker to
  fork; the demo's answers are integers, checked without sympy).
- `spaced call`, `spaced call (math)`: the same calls, each 50 ms after the one before
  (as in training, where the trainer generates between scorings: the spare boxes are
  ready and what the last call left is done); `time_s` is the median, the latency a
  scoring waits for; CPU per call counts the gaps.
- `scoring burst`: one `RewardPool.score` of 16 prompts x 8 samples with `math` after
  0.3 s without calls (a step of `make demo`: 16 calls on one worker, in one message
  since issue 36's cost work, while the trainer generated and trained in between); wall
  time per call of the scoring, CPU per call of the scoring and the 0.3 s after it (what
  the burst left: its boxes' ends, the spares forked for the next one).
- `trajectory start`: `EnvironmentPool.reset` of one new trajectory of the tool demo's
  environment (its box started and the environment built).
- `tool call`: `EnvironmentPool.step` of one trajectory calling the tool demo's
  calculator (the `make demo-tools` path: parse, one limited tool call, reply).

One JSON line per case and variant: `time_s` (mean wall time per call), `cpu_s` (CPU
seconds per call of the trainer and every process of the worker, boxes that ended
included: steadier than wall time on a shared machine; start-up: of the trainer only),
`peak_bytes` (proportional set size, PSS, of the worker's processes after the measured
calls; for a trajectory, with its box alive), `time_ratio`, `cpu_ratio` and `mem_ratio`
against the baseline of the same case and level from the same run; for the reward
cases of code with a zygote, `split`: per call, the CPU milliseconds of the trainer, the
supervisor, the zygote and the boxes that ended (from /proc: the zygote's reaped
children), and the minor page faults (copy-on-write copies, mostly) of the zygote and of
those boxes. **Baseline**: with
`--before DIR`, the same case and level measured with the leangrpo in DIR (the code
before a change, e.g. before boxes: `git archive 30e860d src | tar -x -C /tmp/before`,
then `--before /tmp/before/src`), run in a child process just before; without it, the
`process` level of the same code. `--src DIR` measures another checkout's `src`. The
namespace probe (once per trainer process) runs before the timing. CPU only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

GAP_S = 0.05  # between two spaced calls
CALCULATOR = str(ROOT / "examples" / "tools_demo" / "calculator.py") + ":add"
CALL = '<tool_call>{"name": "add", "arguments": {"a": 123, "b": 456}}</tool_call>'
USER = [{"role": "user", "content": "123+456="}]
LEVELS = ("process", "namespace")


def rewards_cfg(level: str, name: str = "length"):
    from leangrpo.config.run import RewardsConfig

    kwargs = {"answer_column": "answer"} if name == "math" else {"target": 1}
    return RewardsConfig(functions=[{"name": name, "kwargs": kwargs}],
                         num_workers=1, sandbox={"level": level})  # fmt: skip


def prompt_samples(prompt: int, n: int) -> list:
    """`n` right answers to prompt `prompt` (its own uid: a call never mixes prompts)."""
    from leangrpo.contracts import Completion, Prompt, RolloutSample

    question = Prompt(prompt, "1+2=", [1], columns={"answer": "3"})
    return [RolloutSample(prompt, question, Completion([1], "3", [0.0], "stop", 0))
            for _ in range(n)]  # fmt: skip


def environment_cfg(level: str):
    from leangrpo.config.environment import EnvironmentConfig

    return EnvironmentConfig(name="tools", tools=[CALCULATOR], num_workers=1,
                             sandbox={"level": level})  # fmt: skip


def tree(pid: int) -> list[psutil.Process]:
    launcher = psutil.Process(pid)
    return [launcher, *launcher.children(recursive=True)]


def cpu_now(pid: int) -> float:
    """CPU seconds so far of this process, the worker's live processes and every child
    they reaped (the boxes that ended: RUSAGE_CHILDREN of the worker's own processes is
    not readable from here, so the worker tree's children_* times are used)."""
    total = time.process_time()
    for proc in tree(pid):
        with contextlib.suppress(psutil.NoSuchProcess):  # a box that ended meanwhile
            times = proc.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
    return total


def worker_roles(pid: int, level: str) -> tuple[int, int] | None:
    """(supervisor, zygote) of the worker launched as `pid`; None for code without a
    zygote (before boxes)."""
    try:
        supervisor = psutil.Process(pid)
        if level == "namespace":  # the launcher waits; its child is the worker
            (supervisor,) = supervisor.children()
        (zygote,) = supervisor.children()
        return supervisor.pid, zygote.pid
    except (ValueError, psutil.Error):
        return None


def process_counters(pid: int) -> tuple[float, int, float, int]:
    """(CPU seconds, minor faults) of `pid` and of its children it reaped, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    tick = os.sysconf("SC_CLK_TCK")
    minflt, cminflt = int(fields[7]), int(fields[8])
    own = (int(fields[11]) + int(fields[12])) / tick
    reaped = (int(fields[13]) + int(fields[14])) / tick
    return own, minflt, reaped, cminflt


class Split:
    """Where a call's CPU goes: the trainer, the supervisor, the zygote, the ended boxes
    (reaped by the zygote: spares forked in the window and still alive are left out), and
    the page faults of the zygote and of those boxes."""

    def __init__(self, pid: int, level: str):
        self.roles = worker_roles(pid, level)
        self.start = self._now()

    def _now(self) -> tuple | None:
        if self.roles is None:
            return None
        supervisor, zygote = self.roles
        return (time.process_time(), process_counters(supervisor), process_counters(zygote))

    def per_call(self, calls: int) -> dict | None:
        end = self._now()
        if self.start is None or end is None:
            return None
        (t0, s0, z0), (t1, s1, z1) = self.start, end
        ms = {"trainer": t1 - t0, "supervisor": s1[0] - s0[0], "zygote": z1[0] - z0[0],
              "boxes": z1[2] - z0[2]}  # fmt: skip
        return {
            "cpu_ms": {k: round(v / calls * 1e3, 2) for k, v in ms.items()},
            "faults": {"zygote": round((z1[1] - z0[1]) / calls),
                       "boxes": round((z1[3] - z0[3]) / calls)},  # fmt: skip
        }


def tree_pss(pid: int) -> int:
    total = 0
    for proc in tree(pid):
        with contextlib.suppress(psutil.NoSuchProcess):  # a box that ended meanwhile
            total += proc.memory_full_info().pss
    return total


def start_up(level: str, repeats: int) -> tuple[float, float, int]:
    from leangrpo.rewards import RewardPool

    times, cpu, pss = [], 0.0, 0
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        with RewardPool(rewards_cfg(level)) as pool:
            pool.score(prompt_samples(0, 1))
            times.append(time.perf_counter() - t0)
            cpu += time.process_time() - c0
            pss = tree_pss(pool._workers[0].pid)
    return sum(times) / len(times), cpu / repeats, pss


def reward_calls(level: str, calls: int, name: str = "length") -> tuple[float, float, int]:
    from leangrpo.rewards import RewardPool

    with RewardPool(rewards_cfg(level, name)) as pool:
        for i in range(3):  # warm: the first calls measure the function's speed
            pool.score(prompt_samples(i, 8))
        pid = pool._workers[0].pid
        c0 = cpu_now(pid)
        split = Split(pid, level)
        t0 = time.perf_counter()
        for i in range(calls):
            batch = prompt_samples(i, 8)
            pool.score(batch)
            assert batch[0].reward == 1.0, batch[0]
        elapsed = (time.perf_counter() - t0) / calls
        where = split.per_call(calls)
        return elapsed, (cpu_now(pid) - c0) / calls, tree_pss(pid), where


def spaced_calls(level: str, calls: int, name: str = "length") -> tuple:
    """As `reward_calls`, each call GAP_S after the one before (the trainer generated in
    between: the spares are ready, what the last call left is done): the median wall time
    of a call, and the CPU of calls and gaps together per call."""
    from leangrpo.rewards import RewardPool

    with RewardPool(rewards_cfg(level, name)) as pool:
        for i in range(3):
            pool.score(prompt_samples(i, 8))
        pid = pool._workers[0].pid
        time.sleep(GAP_S)
        c0 = cpu_now(pid)
        split = Split(pid, level)
        times = []
        for i in range(calls):
            batch = prompt_samples(i, 8)
            t0 = time.perf_counter()
            pool.score(batch)
            times.append(time.perf_counter() - t0)
            assert batch[0].reward == 1.0, batch[0]
            time.sleep(GAP_S)
        where = split.per_call(calls)
        median = sorted(times)[len(times) // 2]
        return median, (cpu_now(pid) - c0) / calls, tree_pss(pid), where


def scoring_bursts(level: str, bursts: int, prompts: int = 16) -> tuple[float, float, int]:
    from leangrpo.rewards import RewardPool

    with RewardPool(rewards_cfg(level, "math")) as pool:
        for _ in range(2):  # warm: speeds measured, spare boxes as many as a burst keeps
            pool.score([s for p in range(prompts) for s in prompt_samples(p, 8)])
        pid = pool._workers[0].pid
        time.sleep(0.3)
        elapsed, cpu, splits = 0.0, 0.0, []
        for _ in range(bursts):
            batch = [s for p in range(prompts) for s in prompt_samples(p, 8)]
            c0 = cpu_now(pid)
            split = Split(pid, level)
            t0 = time.perf_counter()
            pool.score(batch)
            elapsed += time.perf_counter() - t0
            assert all(s.reward == 1.0 for s in batch), batch[0]
            time.sleep(0.3)  # the trainer generates and trains: the next burst's boxes forked
            splits.append(split.per_call(prompts))
            cpu += cpu_now(pid) - c0  # the burst and what it left to do (its boxes' ends,
            # the spares forked for the next one): all a burst's calls cost
        calls = bursts * prompts
        return elapsed / calls, cpu / calls, tree_pss(pid), mean_split(splits)


def mean_split(splits: list[dict | None]) -> dict | None:
    if not splits or None in splits:
        return None
    return {group: {k: round(sum(s[group][k] for s in splits) / len(splits), 2)
                    for k in splits[0][group]} for group in splits[0]}  # fmt: skip


def trajectory_starts(level: str, calls: int) -> tuple[float, float, int]:
    from leangrpo.environments.pool import EnvironmentPool

    with EnvironmentPool(environment_cfg(level)) as pool:
        pid = pool._workers[0].pid
        elapsed, cpu = 0.0, 0.0
        for _ in range(calls):
            (key,) = pool.new_sessions(1)
            t0, c0 = time.perf_counter(), cpu_now(pid)
            (out,) = pool.reset([(key, USER, {}, 0)])
            elapsed += time.perf_counter() - t0
            cpu += cpu_now(pid) - c0
            assert out.error is None, out.error
            pss = tree_pss(pid)  # with one trajectory alive
            pool.finish([(key, "stop")])
        return elapsed / calls, cpu / calls, pss


def tool_calls(level: str, calls: int) -> tuple[float, float, int]:
    from leangrpo.environments.pool import EnvironmentPool

    with EnvironmentPool(environment_cfg(level)) as pool:
        (key,) = pool.new_sessions(1)
        (out,) = pool.reset([(key, USER, {}, 0)])
        assert out.error is None, out.error
        pool.step([(key, CALL, 0)])
        pid = pool._workers[0].pid
        t0, c0 = time.perf_counter(), cpu_now(pid)
        for _ in range(calls):
            (out,) = pool.step([(key, CALL, 0)])
            assert out.ok["reply"][0]["content"] == "579", out
        elapsed = (time.perf_counter() - t0) / calls
        return elapsed, (cpu_now(pid) - c0) / calls, tree_pss(pid)


CASES = ("start-up", "reward call", "reward call (math)", "spaced call", "spaced call (math)",
         "scoring burst", "trajectory start", "tool call")  # fmt: skip


def measure(case: str, level: str, quick: bool) -> tuple[float, float, int, dict | None]:
    """(wall seconds, CPU seconds per call, PSS, where a reward call's CPU goes or None)."""
    repeats, calls = (2, 20) if quick else (5, 100)
    runs = {
        "start-up": lambda: start_up(level, repeats),
        "reward call": lambda: reward_calls(level, calls),
        "reward call (math)": lambda: reward_calls(level, calls, "math"),
        "spaced call": lambda: spaced_calls(level, calls),
        "spaced call (math)": lambda: spaced_calls(level, calls, "math"),
        "scoring burst": lambda: scoring_bursts(level, repeats + 1),
        "trajectory start": lambda: trajectory_starts(level, calls),
        "tool call": lambda: tool_calls(level, calls),
    }
    result = runs[case]()
    return result if len(result) == 4 else (*result, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and calls")
    parser.add_argument("--src", default=str(ROOT / "src"), help="the leangrpo to measure")
    parser.add_argument("--before", help="the leangrpo src to measure as the baseline")
    parser.add_argument("--case", action="append", choices=CASES, help="only these cases")
    parser.add_argument("--level", action="append", choices=LEVELS, help="only these levels")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(args.src).resolve()))
    from device_info import device_name

    from leangrpo.sandbox.levels import namespace_failure

    namespace_failure(False)  # the probe: once per trainer process, not per worker
    source = os.path.relpath(Path(args.src).resolve(), ROOT)
    for case in args.case or CASES:
        base = None
        for level in args.level or LEVELS:
            if args.before:
                base = before(args, case, level)
                print(json.dumps(base), flush=True)
            time_s, cpu_s, peak, split = measure(case, level, args.quick)
            row = {"bench": "sandbox", "case": case, "device": device_name("cpu"),
                   "variant": level, "src": source, "time_s": round(time_s, 5),
                   "cpu_s": round(cpu_s, 5), "peak_bytes": peak}  # fmt: skip
            if split is not None:
                row["split"] = split
            if base is None:
                base = row
            else:
                row["time_ratio"] = round(time_s / base["time_s"], 3)
                row["cpu_ratio"] = round(cpu_s / max(base["cpu_s"], 1e-9), 3)
                row["mem_ratio"] = round(peak / base["peak_bytes"], 3)
            print(json.dumps(row), flush=True)


def before(args: argparse.Namespace, case: str, level: str) -> dict:
    """The baseline row: this case and level measured with `args.before`'s leangrpo, in a
    child process (its own imports), now."""
    argv = [sys.executable, __file__, "--src", args.before, "--case", case, "--level", level]
    done = subprocess.run(argv + (["--quick"] if args.quick else []), capture_output=True,
                          text=True, check=True)  # fmt: skip
    row = json.loads(done.stdout.strip().splitlines()[-1])
    return {**row, "variant": f"{level} (before)"}


if __name__ == "__main__":
    main()
