"""The environment workers, trainer side: sessions pinned to workers, calls with limits.

`EnvironmentPool(cfg.environment)` starts `environment.num_workers` worker processes
(worker.py, in the sandbox `environment.sandbox` asks for: sandbox/process.py, levels.py;
one log line says which) and waits until each has imported the environment
(`environment.startup_timeout_s`); a failure there is one `EnvironmentSpecError` line.
`tools`, `replies`, `reward_terms` and `max_tool_calls` are what the first worker
reported: the tools' schemas (for the chat template), the roles of the replies, the reward
terms the environment can give (None: it does not say), and the environment class's calls
per turn.

A trajectory is a session (`new_sessions`), pinned to worker `session % W`, where its
environment lives from `reset` to `finish`. `reset`, `step` and `finish` take one item
per session, send every worker its items as one task, and return one `Outcome` per item
in order: the worker answers each item when it is done; a worker that sends nothing for
an item's budget (its calls' limits, with the environment's own max_tool_calls, plus a
grace period: stuck in C code) has its whole tree killed and is replaced, and its items fail; so do those of a worker that exits or
sends anything off the schema (wire.py). A failed item is the end of its trajectory,
never an exception in the trainer. One operation runs at a time (the producer thread and
evaluation share a pool); `close()` kills every worker at once.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import wait
from typing import Any

from leangrpo.environments.registry import EnvironmentSpecError, spec_of
from leangrpo.environments.wire import InitError, Item, Ready, checked, parse_env_reply
from leangrpo.sandbox.frames import ProtocolError
from leangrpo.sandbox.levels import plan_for
from leangrpo.sandbox.process import OutputBudget, WorkerGone, WorkerProcess

log = logging.getLogger("leangrpo.environments")


class PoolClosed(RuntimeError):
    """The pool was closed while (or before) an operation ran."""


@dataclass
class Outcome:
    ok: dict[str, Any] | None  # the item's checked payload (wire.py)
    error: str | None = None


@dataclass
class _Task:
    id: int
    op: str
    indices: list[int]  # positions in the operation's items, in the order sent
    done: int = 0
    since: float = 0.0


class EnvironmentPool:
    def __init__(self, env_cfg: Any, mode: str = "serve"):
        self.spec = spec_of(env_cfg)
        self.cfg = env_cfg
        self.num_workers = int(env_cfg.num_workers) if mode == "serve" else 1
        self.plan = plan_for(env_cfg, "environment")
        self._init = {
            "entry": "leangrpo.environments.worker",
            "mode": mode,
            "sys_path": list(sys.path),
            "spec": asdict(self.spec),
            "timeout_s": float(env_cfg.timeout_s),
            "tool_timeout_s": float(env_cfg.tool_timeout_s),
            "cpu_time_limit_s": env_cfg.cpu_time_limit_s,
            "max_tool_result_chars": int(env_cfg.max_tool_result_chars),
        }
        self._lock = threading.Lock()
        self._closed = False
        self._budget = OutputBudget()
        self._tasks = 0
        self._next_session = 0
        self.tools: list[dict] = []
        self.replies: list[str] = []
        self.reward_terms: tuple[str, ...] | None = None
        self.max_tool_calls = 0
        self._workers: list[WorkerProcess] = []
        self._busy: dict[int, _Task] = {}  # worker slot -> its task
        if mode == "serve":
            log.info("%s", self.plan.describe())
        try:
            self._workers = [self._spawn(slot) for slot in range(self.num_workers)]
            self._wait_ready(list(range(self.num_workers)))
        except BaseException:
            self.close()
            raise

    @property
    def item_budget_s(self) -> float:
        """How long a worker may take over one item before it counts as stuck: the parser
        and the step (or reset, finish) under timeout_s each, the turn's tools (as many as
        the environment allows) under tool_timeout_s each, and a grace period."""
        cfg = self.cfg
        grace = max(1.0, 0.25 * cfg.timeout_s)
        return 2 * cfg.timeout_s + self.max_tool_calls * cfg.tool_timeout_s + grace

    # -- start-up -------------------------------------------------------------------------
    def _spawn(self, slot: int) -> WorkerProcess:
        label = f"env worker {slot}"
        return WorkerProcess(self._init, label, self._budget, parse=parse_env_reply, plan=self.plan)

    def _wait_ready(self, slots: list[int]) -> None:
        waiting = set(slots)
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EnvironmentSpecError(
                    f"environment.name = {self.spec.name!r}: the environment worker did not finish importing it within {self.cfg.startup_timeout_s:g} s; raise environment.startup_timeout_s if the import is just slow"
                )
            handles = [h for slot in waiting for h in self._workers[slot].handles()]
            ready = set(wait(handles, left))
            for slot in list(waiting):
                worker = self._workers[slot]
                if worker.out_fd in ready:
                    worker.relay_output()
                if worker.sock not in ready:
                    continue
                for reply in self._receive_at_start(worker):
                    if isinstance(reply, InitError):
                        raise EnvironmentSpecError(reply.msg)
                    if isinstance(reply, Ready):
                        waiting.discard(slot)
                        if not self.replies:  # the first worker's report (they all agree)
                            self.tools, self.replies = reply.tools, reply.replies
                            self.reward_terms = reply.reward_terms
                            self.max_tool_calls = reply.max_tool_calls

    def _receive_at_start(self, worker: WorkerProcess) -> list:
        try:
            return worker.receive()
        except WorkerGone:
            code = worker.exit_code()
            raise EnvironmentSpecError(
                f"environment.name = {self.spec.name!r}: importing it ended the environment worker (exit code {code}); environment code must not exit at import"
            ) from None
        except ProtocolError as e:
            raise EnvironmentSpecError(f"environment.name = {self.spec.name!r}: {e}") from None

    # -- operations -----------------------------------------------------------------------
    def new_sessions(self, count: int) -> list[int]:
        with self._lock:
            first, self._next_session = self._next_session, self._next_session + count
        return list(range(first, first + count))

    def reset(self, items: list[tuple[int, list[dict], dict, int]]) -> list[Outcome]:
        """(session, prompt messages, row, seed) each."""
        return self._run("reset", items)

    def step(self, items: list[tuple[int, str, int]]) -> list[Outcome]:
        """(session, the model turn's text, turn index) each."""
        return self._run("step", items)

    def finish(self, items: list[tuple[int, str]]) -> list[Outcome]:
        """(session, finish reason) each; the sessions are gone afterwards."""
        return self._run("finish", items)

    def _run(self, op: str, items: list[tuple]) -> list[Outcome]:
        if not items:
            return []
        with self._lock:
            if self._closed:
                raise PoolClosed("the environment pool is closed")
            outcomes: list[Outcome | None] = [None] * len(items)
            try:
                self._send_tasks(op, items, outcomes)
                while self._busy:
                    self._wait_and_handle(outcomes)
            finally:
                self._budget.reset()
                for slot in list(self._busy):  # interrupted (closed): whatever it held is lost
                    self._replace(slot)
            return [o if o is not None else Outcome(None, "no reply") for o in outcomes]

    def _send_tasks(self, op: str, items: list[tuple], outcomes: list) -> None:
        by_slot: dict[int, list[int]] = {}
        for i, item in enumerate(items):
            by_slot.setdefault(item[0] % self.num_workers, []).append(i)
        for slot, indices in by_slot.items():
            self._tasks += 1
            task = _Task(self._tasks, op, indices, since=time.monotonic())
            self._busy[slot] = task
            try:
                self._workers[slot].send((task.id, op, [items[i] for i in indices]))
            except WorkerGone as e:
                self._fail(slot, outcomes, f"the environment worker died ({e})")

    def _wait_and_handle(self, outcomes: list) -> None:
        deadline = min(t.since + self.item_budget_s for t in self._busy.values())
        handles = [h for slot in self._busy for h in self._workers[slot].handles()]
        ready = set(wait(handles, max(0.0, deadline - time.monotonic())))
        if self._closed:
            raise PoolClosed("the environment pool was closed during an operation")
        now = time.monotonic()
        for slot in list(self._busy):
            worker, task = self._workers[slot], self._busy[slot]
            if worker.out_fd in ready:
                worker.relay_output()
            if worker.sock in ready:
                self._read(slot, worker, task, outcomes)
            elif now >= task.since + self.item_budget_s:
                self._fail(slot, outcomes, f"the environment did not answer within {self.item_budget_s:g} s (its worker was killed)")  # fmt: skip

    def _read(self, slot: int, worker: WorkerProcess, task: _Task, outcomes: list) -> None:
        try:
            replies = worker.receive()
        except WorkerGone:
            code = worker.exit_code()
            self._fail(slot, outcomes, f"the environment worker died (exit code {code})")
            return
        except ProtocolError as e:
            self._fail(slot, outcomes, str(e))
            return
        for reply in replies:
            if not isinstance(reply, Item) or reply.task != task.id or reply.index != task.done:
                self._fail(slot, outcomes, "the environment worker sent a reply that fits no item")
                return
            index = task.indices[reply.index]
            if reply.ok is None:
                outcomes[index] = Outcome(None, reply.error)
            else:
                try:
                    outcomes[index] = Outcome(checked(task.op, reply.ok))
                except ProtocolError as e:
                    self._fail(slot, outcomes, str(e))
                    return
            task.done += 1
            task.since = time.monotonic()
            if task.done == len(task.indices):
                del self._busy[slot]
                if reply.retire:
                    self._replace(slot)
                return

    def _fail(self, slot: int, outcomes: list, why: str) -> None:
        """The worker broke: the items it still owed fail, and it is replaced (its other
        sessions are gone with it: their next step fails too)."""
        task = self._busy.pop(slot, None)
        if task is not None:
            for index in task.indices[task.done :]:
                outcomes[index] = Outcome(None, why)
        log.warning("environment worker %d replaced: %s", slot, why)
        self._replace(slot)

    def _replace(self, slot: int) -> None:
        self._busy.pop(slot, None)
        self._workers[slot].kill()
        if self._closed:
            return
        self._workers[slot] = self._spawn(slot)
        self._wait_ready([slot])

    def close(self) -> None:
        """Kill every worker's tree now; an operation in another thread raises PoolClosed."""
        self._closed = True
        for worker in self._workers:
            worker.terminate()
        if self._lock.acquire(timeout=5.0):
            try:
                for worker in self._workers:
                    worker.release()
            finally:
                self._lock.release()

    def __enter__(self) -> EnvironmentPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if not self._closed:
                self.close()

