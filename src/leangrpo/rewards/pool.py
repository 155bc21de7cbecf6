"""Score rollout samples with the configured reward functions in worker processes.

Generated text is untrusted and user reward code may hang, crash or leak, so nothing runs in
the trainer's process. The pool is its own small process manager rather than a
`ProcessPoolExecutor`, because an executor cannot stop a running task:

- Each worker is a fresh interpreter (`python -c ...`, like the "spawn" start method but
  without re-importing the trainer's `__main__`, so it never loads torch) talking over a
  socket pair. It resolves every function by name (registry.ResolvedReward) once at start-up and
  reports ready; time limits start only then, so imports never count against them.
- `score` splits the samples, per function, into chunks of at most `chunk_size`, hands
  them to idle workers and waits on all pipes at once. A chunk that raises, returns a bad
  value, kills its worker or runs past `timeout_s` is retried one sample per call, so a
  sample's reward is None (and counted as a failure) only when it fails on its own.
- Two time limits: at `timeout_s` the worker interrupts the call itself (a signal raised in
  its main thread: enough for Python code and sleeps, and the worker lives on); a worker
  still silent `grace_s` later (stuck in C code) is killed and replaced.
- `timeout_s` therefore bounds one call on one chunk; keep it above what a healthy chunk
  needs, or lower `chunk_size`.
- Workers ignore Ctrl-C (the trainer decides when they stop), exit on EOF when the pool
  closes, and exit by themselves if the trainer dies; `close()` runs at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import numbers
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection, Pipe, wait
from pathlib import Path
from typing import Any

from leangrpo.contracts import RolloutSample
from leangrpo.rewards.registry import (
    BUILTIN_NAMES,
    ResolvedReward,
    RewardError,
    RewardSpecError,
    check_rewards,
    resolve,
)

STARTUP_TIMEOUT_S = 120.0
_WORKER_CODE = (
    "import sys; from leangrpo.rewards.pool import worker_main; worker_main(int(sys.argv[1]))"
)


@dataclass
class _Task:
    fn_index: int
    indices: list[int]  # sample positions in the score() call


class _Worker:
    """One worker process and its end of the socket pair."""

    def __init__(self, specs: list[ResolvedReward], timeout_s: float):
        self.conn, child = Pipe(duplex=True)
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[2])  # the dir holding the leangrpo package
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CODE, str(child.fileno())],
            pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
        )
        child.close()
        self.conn.send(("init", list(sys.path), [asdict(s) for s in specs], timeout_s))
        self.started = time.monotonic()
        self.ready = False
        self.task: _Task | None = None
        self.task_id = -1
        self.sent_at = 0.0
        self.deadline = math.inf

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.conn.close()


class RewardPool:
    """`RewardPool(cfg.rewards).score(samples)` sets `sample.rewards` and `sample.reward`."""

    def __init__(self, rewards_cfg: Any, chunk_size: int = 16):
        self.specs = check_rewards(rewards_cfg)
        self.timeout_s = float(rewards_cfg.timeout_s)
        self.fail_fast = bool(rewards_cfg.fail_fast)
        self.num_workers = int(rewards_cfg.num_workers)
        if self.timeout_s <= 0 or self.num_workers < 1:
            raise RewardSpecError(
                f"rewards.timeout_s = {self.timeout_s} and rewards.num_workers = "
                f"{self.num_workers} must both be positive"
            )
        if chunk_size < 1:
            raise ValueError(f"chunk_size = {chunk_size} must be >= 1")
        self.chunk_size = chunk_size
        self.grace_s = max(1.0, 0.25 * self.timeout_s)  # soft limit in the worker, then kill
        self._lock = threading.Lock()
        self._task_ids = 0
        self._seconds_per_sample: list[float | None] = [None] * len(self.specs)
        self._workers = [_Worker(self.specs, self.timeout_s) for _ in range(self.num_workers)]
        _LIVE_POOLS.add(self)

    @property
    def keys(self) -> list[str]:
        return [s.key for s in self.specs]

    def score(self, samples: list[RolloutSample]) -> dict[str, float]:
        """Score in place; returns reward metrics for this call."""
        if not samples:
            return {}
        with self._lock:
            if not self._workers:
                raise RewardError("this RewardPool is closed")
            values, failures = self._run_all(samples)
        return _apply_and_summarise(samples, self.specs, values, failures)

    def _run_all(self, samples: list[RolloutSample]) -> tuple[list[list], list[int]]:
        self._restart_busy_workers()  # left over from a call that was interrupted
        n = len(samples)
        payload = _payload(samples)
        values: list[list] = [[None] * n for _ in self.specs]
        failures = [0] * len(self.specs)
        queue = deque(
            _Task(f, list(range(start, min(start + size, n))))
            for f, size in enumerate(self._chunk_sizes(n))
            for start in range(0, n, size)
        )
        while queue or any(w.task for w in self._workers):
            self._dispatch(queue, payload)
            for task, outcome in self._wait_for_events():
                if outcome[0] == "ok":
                    for i, v in zip(task.indices, outcome[1]):
                        values[task.fn_index][i] = v
                    self._record_time(task, outcome[2])
                elif len(task.indices) > 1:  # find the samples that fail on their own
                    queue.extend(_Task(task.fn_index, [i]) for i in task.indices)
                elif self.fail_fast:
                    self._restart_busy_workers()
                    key, i = self.specs[task.fn_index].key, task.indices[0]
                    raise RewardError(f"reward '{key}' failed on sample {i}: {outcome[1]}")
                else:
                    failures[task.fn_index] += 1
        return values, failures

    def _chunk_sizes(self, n: int) -> list[int]:
        """Per function: spread over the workers, at most chunk_size, and small enough that
        a chunk takes about a quarter of timeout_s at the function's measured speed."""
        even = min(self.chunk_size, -(-n // self.num_workers))
        return [
            even
            if per_sample is None
            else max(1, min(even, int(0.25 * self.timeout_s / per_sample)))
            for per_sample in self._seconds_per_sample
        ]

    def _record_time(self, task: _Task, elapsed: float) -> None:
        per_sample = elapsed / len(task.indices)
        old = self._seconds_per_sample[task.fn_index]
        self._seconds_per_sample[task.fn_index] = (
            per_sample if old is None else 0.5 * (old + per_sample)
        )

    def _dispatch(self, queue: deque, payload: tuple) -> None:
        for worker in self._workers:
            if not queue:
                return
            if worker.ready and worker.task is None:
                task = queue.popleft()
                prompts, completions, columns = payload
                pick = task.indices
                self._task_ids += 1
                worker.task, worker.task_id = task, self._task_ids
                worker.conn.send(
                    (
                        worker.task_id,
                        task.fn_index,
                        [prompts[i] for i in pick],
                        [completions[i] for i in pick],
                        {name: [col[i] for i in pick] for name, col in columns.items()},
                    )
                )
                worker.sent_at = time.monotonic()
                worker.deadline = worker.sent_at + self.timeout_s + self.grace_s

    def _wait_for_events(self) -> list[tuple[_Task, tuple]]:
        """Block until a worker answers, dies, becomes ready or passes its deadline;
        returns the settled tasks as (task, ("ok" | "error", values | message, seconds))."""
        deadline = min(w.deadline for w in self._workers)
        timeout = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
        if not any(w.ready for w in self._workers):
            timeout = 1.0 if timeout is None else min(timeout, 1.0)  # poll the start-up limit
        readable = set(wait([w.conn for w in self._workers], timeout))
        events = []
        for slot, worker in enumerate(list(self._workers)):
            if worker.conn in readable:
                outcome = self._receive(slot, worker)
            elif worker.task is not None and time.monotonic() >= worker.deadline:
                outcome = ("error", f"timed out after {self.timeout_s:g} s", self.timeout_s)
                self._replace(slot)
            else:
                self._check_startup(worker)
                continue
            if outcome is not None and worker.task is not None:
                events.append((worker.task, outcome))
                worker.task, worker.deadline = None, math.inf
        return events

    def _receive(self, slot: int, worker: _Worker) -> tuple | None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            code = worker.proc.wait()
            if not worker.ready:
                self.close()
                raise RewardError(
                    f"a reward worker exited during start-up (exit code {code}); its error is above"
                ) from None
            self._replace(slot)
            died = f"the worker process died (exit code {code})"
            return ("error", died, 0.0) if worker.task else None
        kind = message[0]
        if kind == "ready":
            worker.ready = True
            return None
        if kind == "init_error":
            self.close()
            raise RewardError(f"a reward worker could not resolve its functions: {message[1]}")
        _, task_id, result = message
        if task_id != worker.task_id:
            return None  # stale; cannot happen while timed-out workers are replaced
        return (kind, result, time.monotonic() - worker.sent_at)

    def _check_startup(self, worker: _Worker) -> None:
        if not worker.ready and time.monotonic() - worker.started > STARTUP_TIMEOUT_S:
            self.close()
            raise RewardError(f"a reward worker did not start within {STARTUP_TIMEOUT_S:g} s")

    def _replace(self, slot: int) -> None:
        old = self._workers[slot]
        old.kill()
        self._workers[slot] = _Worker(self.specs, self.timeout_s)  # the caller settles old.task

    def _restart_busy_workers(self) -> None:
        for slot, worker in enumerate(self._workers):
            if worker.task is not None:
                self._replace(slot)

    def close(self) -> None:
        """Stop every worker (EOF first, then kill what is still running)."""
        workers, self._workers = getattr(self, "_workers", []), []
        for worker in workers:
            worker.conn.close()
        for worker in workers:
            try:
                worker.proc.wait(timeout=0.5 if worker.task is None else 0.0)
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                worker.proc.wait()
        _LIVE_POOLS.discard(self)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


_LIVE_POOLS: weakref.WeakSet[RewardPool] = weakref.WeakSet()


@atexit.register
def _close_live_pools() -> None:
    for pool in list(_LIVE_POOLS):
        pool.close()


def _payload(samples: list[RolloutSample]) -> tuple[list[str], list[str], dict[str, list]]:
    """Prompts, completions and every data column as aligned lists (missing -> None)."""
    names = dict.fromkeys(name for s in samples for name in s.prompt.columns)
    columns = {name: [s.prompt.columns.get(name) for s in samples] for name in names}
    return [s.prompt.text for s in samples], [s.completion.text for s in samples], columns


def _apply_and_summarise(
    samples: list[RolloutSample],
    specs: list[ResolvedReward],
    values: list[list],
    failures: list[int],
) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for spec, fn_values, fn_failures in zip(specs, values, failures):
        scored = [v for v in fn_values if v is not None]
        if scored:
            metrics[f"reward/{spec.key}/mean"] = sum(scored) / len(scored)
        metrics[f"reward/{spec.key}/failures"] = float(fn_failures)
    for i, sample in enumerate(samples):
        sample.rewards = {spec.key: values[f][i] for f, spec in enumerate(specs)}
        weighted = [(spec.weight, sample.rewards[spec.key]) for spec in specs if spec.weight != 0]
        unscored = any(v is None for _, v in weighted)
        sample.reward = None if unscored else float(sum(w * v for w, v in weighted))
    totals = [s.reward for s in samples if s.reward is not None]
    if totals:
        mean = sum(totals) / len(totals)
        metrics["reward/mean"] = mean
        metrics["reward/std"] = math.sqrt(sum((r - mean) ** 2 for r in totals) / len(totals))
    metrics["reward/failures"] = float(sum(failures))
    metrics["reward/unscored"] = float(len(samples) - len(totals))
    return metrics


# ---- the worker process -------------------------------------------------------------------


def worker_main(fd: int) -> None:
    """Entry point of a worker: resolve the functions, then score chunks until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    conn = Connection(fd)
    with contextlib.suppress(EOFError, BrokenPipeError, ConnectionResetError):  # pool closed
        _serve(conn)


def _serve(conn: Connection) -> None:
    _, sys_path, spec_dicts, timeout_s = conn.recv()
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    specs = [ResolvedReward(**d) for d in spec_dicts]
    try:
        functions = [resolve(s.name, s.file) for s in specs]
        for name in {s.name for s in specs} & set(BUILTIN_NAMES):
            from leangrpo.rewards import builtin

            builtin.warm_up(name)
    except Exception as e:
        conn.send(("init_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready",))
    call = _InterruptibleCall(timeout_s)
    while True:
        task_id, fn_index, prompts, completions, columns = conn.recv()
        spec = specs[fn_index]
        try:
            raw = call(functions[fn_index], prompts, completions, **{**columns, **spec.kwargs})
            conn.send(("ok", task_id, _validated(raw, len(completions), spec.key)))
        except _SoftTimeout:
            conn.send(("error", task_id, f"timed out after {timeout_s:g} s"))
        except (Exception, SystemExit) as e:
            conn.send(("error", task_id, f"{type(e).__name__}: {e}"))


class _SoftTimeout(BaseException):
    """Raised inside a reward call at its time limit (BaseException: user code that catches
    Exception must not swallow it)."""


class _InterruptibleCall:
    """Run a call with a soft time limit: a timer thread sends SIGUSR1 to the main thread and
    the handler raises _SoftTimeout in the main thread, which interrupts Python code and
    sleeps. Not SIGALRM: math-verify uses alarm() for its own limits. Code stuck in C that
    never returns to the interpreter is left to the parent's hard limit (kill)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.active = False
        signal.signal(signal.SIGUSR1, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.active:  # a late signal after the call returned is ignored
            self.active = False
            raise _SoftTimeout

    def _fire(self) -> None:
        if self.active:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

    def __call__(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        timer = threading.Timer(self.timeout_s, self._fire)
        self.active = True
        timer.start()
        try:
            return fn(*args, **kwargs)
        finally:
            self.active = False
            timer.cancel()


def _validated(raw: Any, n: int, key: str) -> list[float | None]:
    if not isinstance(raw, (list, tuple)) or len(raw) != n:
        got = f"{len(raw)} values" if isinstance(raw, (list, tuple)) else f"a {type(raw).__name__}"
        raise RewardError(f"reward '{key}' returned {got} for {n} samples; return a list of {n}")
    out: list[float | None] = []
    for j, value in enumerate(raw):
        if value is not None and not isinstance(value, numbers.Real):
            raise RewardError(
                f"reward '{key}' returned {value!r} ({type(value).__name__}) for sample {j}; "
                f"return floats or None"
            )
        if value is not None and not math.isfinite(float(value)):
            raise RewardError(
                f"reward '{key}' returned {value} for sample {j}; rewards must be finite"
            )
        out.append(None if value is None else float(value))
    return out


def _exit_with_parent() -> None:
    """Exit even while stuck in user code if the trainer dies (it cannot close the pool)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
