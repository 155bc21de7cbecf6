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
environment lives from `reset` to `finish`. Calls are items: `submit(op, item)` queues
one behind its worker's earlier items and returns a ticket; `poll(timeout)` returns the
items answered so far, `(ticket, Outcome)`. A worker runs one task at a time (the items
of one operation queued for it, in order) and answers each item when it is done; the
workers run concurrently, so a slow call holds up only the sessions of its own worker
(`environment.num_workers` is the concurrency). A worker that sends nothing for an
item's budget (its calls' limits, with the environment's own max_tool_calls, plus a grace
period: stuck in C code) has its whole tree killed and is replaced, and its items fail;
so do those of a worker that exits or sends anything off the schema (wire.py); an item
whose reward terms the environment did not declare fails (the trainer checks it too). A failed
item is the end of its trajectory, never an exception in the trainer. One caller holds
the pool at a time (`exclusive`: the producer thread and evaluation share a pool; the
multi-turn rollout holds it for a generation call); `reset`, `step` and `finish` are all
of their items at once, answered in order. `close()` kills every worker at once.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from multiprocessing.connection import wait
from typing import Any

from leangrpo.environments.registry import EnvironmentSpecError, spec_of
from leangrpo.environments.wire import (
    InitError,
    Item,
    Ready,
    checked,
    parse_env_reply,
    undeclared_term,
)
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
    tickets: list[int]  # the items' tickets, in the order sent
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
        self._lock = threading.RLock()
        self._closed = False
        self._budget = OutputBudget()
        self._tasks = 0
        self._tickets = 0
        self._queued: dict[int, deque[tuple[int, str, tuple]]] = {}  # slot -> items to send
        self._ready: list[tuple[int, Outcome]] = []  # answered, not yet polled
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
        the environment allows; none for one that offers no tool) under tool_timeout_s
        each, and a grace period."""
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
        """All the items at once; their outcomes in order."""
        if not items:
            return []
        with self.exclusive():
            tickets = [self.submit(op, item) for item in items]
            got: dict[int, Outcome] = {}
            while len(got) < len(tickets):
                got.update(self.poll(None))
            return [got[t] for t in tickets]

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the pool for one caller (the producer thread and evaluation share it): a
        generation call submits and polls inside. Leaving it with items still in flight
        (an error, a stop) replaces the workers that held them: whatever they held is lost."""
        with self._lock:
            if self._closed:
                raise PoolClosed("the environment pool is closed")
            try:
                yield
            finally:
                self._budget.reset()
                for slot in list(self._busy):
                    self._replace(slot)
                self._queued.clear()
                self._ready.clear()

    def submit(self, op: str, item: tuple) -> int:
        """Queue one item on its session's worker (`item[0] % W`, in order behind that
        worker's earlier items); returns its ticket for `poll`. Call inside `exclusive`."""
        if self._closed:  # closed (another thread) while a call holds it
            raise PoolClosed("the environment pool was closed during an operation")
        self._tickets += 1
        slot = item[0] % self.num_workers
        self._queued.setdefault(slot, deque()).append((self._tickets, op, item))
        if slot not in self._busy:
            self._send_next(slot)
        return self._tickets

    def in_flight(self) -> int:
        """Items submitted and not yet returned by `poll`."""
        busy = sum(len(t.tickets) - t.done for t in self._busy.values())
        return busy + sum(len(q) for q in self._queued.values()) + len(self._ready)

    def poll(self, timeout_s: float | None) -> list[tuple[int, Outcome]]:
        """The items answered (or failed) so far: waits at most `timeout_s` (None: until one
        is) for a worker to answer. A worker silent past an item's budget is killed."""
        if self._closed:
            raise PoolClosed("the environment pool was closed during an operation")
        if self._ready or not self._busy:
            return self._take_ready()
        wait_until = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._ready and self._busy:
            budget_end = min(t.since + self.item_budget_s for t in self._busy.values())
            end = budget_end if wait_until is None else min(budget_end, wait_until)
            self._wait_and_handle(max(0.0, end - time.monotonic()))
            if wait_until is not None and time.monotonic() >= wait_until:
                break
        return self._take_ready()

    def _take_ready(self) -> list[tuple[int, Outcome]]:
        ready, self._ready = self._ready, []
        return ready

    def _send_next(self, slot: int) -> None:
        """The worker's next task: its queued items of one operation, in order."""
        queued = self._queued.get(slot)
        if not queued:
            return
        op = queued[0][1]
        batch = []
        while queued and queued[0][1] == op:
            batch.append(queued.popleft())
        self._tasks += 1
        task = _Task(self._tasks, op, [t for t, _, _ in batch], since=time.monotonic())
        self._busy[slot] = task
        try:
            self._workers[slot].send((task.id, op, [item for _, _, item in batch]))
        except WorkerGone as e:
            self._fail(slot, f"the environment worker died ({e})")

    def _wait_and_handle(self, timeout_s: float) -> None:
        handles = [h for slot in self._busy for h in self._workers[slot].handles()]
        ready = set(wait(handles, timeout_s))
        if self._closed:
            raise PoolClosed("the environment pool was closed during an operation")
        now = time.monotonic()
        for slot in list(self._busy):
            worker, task = self._workers[slot], self._busy[slot]
            if worker.out_fd in ready:
                worker.relay_output()
            if worker.sock in ready:
                self._read(slot, worker, task)
            elif now >= task.since + self.item_budget_s:
                self._fail(slot, f"the environment did not answer within {self.item_budget_s:g} s (its worker was killed)")  # fmt: skip

    def _read(self, slot: int, worker: WorkerProcess, task: _Task) -> None:
        try:
            replies = worker.receive()
        except WorkerGone:
            code = worker.exit_code()
            self._fail(slot, f"the environment worker died (exit code {code})")
            return
        except ProtocolError as e:
            self._fail(slot, str(e))
            return
        for reply in replies:
            if not isinstance(reply, Item) or reply.task != task.id or reply.index != task.done:
                self._fail(slot, "the environment worker sent a reply that fits no item")
                return
            ticket = task.tickets[reply.index]
            if reply.ok is None:
                self._ready.append((ticket, Outcome(None, reply.error)))
            else:
                try:
                    ok = checked(task.op, reply.ok)
                except ProtocolError as e:
                    self._fail(slot, str(e))
                    return
                self._ready.append((ticket, self._declared(ok)))
            task.done += 1
            task.since = time.monotonic()
            if task.done == len(task.tickets):
                del self._busy[slot]
                if reply.retire:
                    self._replace(slot)
                self._send_next(slot)
                return

    def _declared(self, ok: dict[str, Any]) -> Outcome:
        """The item, unless it carries a reward term the environment did not declare (the
        worker checks too; the trainer trusts no worker): then it fails."""
        term = undeclared_term(ok, self.reward_terms)
        if term is None:
            return Outcome(ok)
        terms = tuple(self.reward_terms or ())
        return Outcome(None, f"the environment worker sent the reward term {term!r}, which its reward_terms {terms} do not list")  # fmt: skip

    def _fail(self, slot: int, why: str) -> None:
        """The worker broke: the items it still owed fail, and it is replaced (its other
        sessions are gone with it: their next calls fail too)."""
        task = self._busy.pop(slot, None)
        if task is not None:
            self._ready.extend((ticket, Outcome(None, why)) for ticket in task.tickets[task.done :])
        log.warning("environment worker %d replaced: %s", slot, why)
        self._replace(slot)
        self._send_next(slot)

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
