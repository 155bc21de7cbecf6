"""Failures across torchrun ranks: heartbeats, failure records and the one line that names
the rank that failed. Internal to context.py, whose `DistContext.phase` drives it.

- Each rank publishes a heartbeat (a counter and its current phase) in the rendezvous store
  from a daemon thread. When an exception leaves `ctx.phase(...)`, the rank either is the
  origin (it records "rank R failed during P: error" in the store and re-raises its own
  error) or it is a victim of a collective that failed (told by the exception's type and
  where it was raised, never by its words: `looks_like_comm_error`): it then raises `DistributedError`
  with one line naming the rank that failed and its phase, read from the store: a recorded
  failure, a rank whose heartbeat stopped (killed, or stuck outside Python), or the ranks
  still in another phase when a collective timed out.
- Backstop: the heartbeat thread also watches the others. If a peer recorded a failure or
  its heartbeat has not moved for timeout_s / 2, and this process is still alive a grace
  period later (its main thread stuck in a collective that will not return), the thread
  prints the one line and exits the process with status 1. A failure leaving
  `ctx.phase` is fatal the same way: the process exits within the grace period even if
  the interpreter's own exit blocks on a collective still pending (which it does until
  the peer goes away).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time

import torch.distributed as dist

from leangrpo.errors import is_user_error

DONE = "done"  # the heartbeat's phase once a rank has shut down
# torch.distributed modules whose calls are the communication itself: an error raised there
# (the innermost torch.distributed frame of its traceback) is a collective that failed
_COLLECTIVE_MODULES = ("distributed_c10d", "_functional_collectives", "_fsdp_collectives")
_TORCH_DISTRIBUTED = os.path.dirname(os.path.abspath(dist.__file__))


class PeerStopped(Exception):  # noqa: N818 (what happened, not an error of this rank)
    """Raised by code that learnt that another rank stopped or failed: never this rank's
    own failure (e.g. pipeline.ProductionAborted)."""


class DistributedError(RuntimeError):
    """Another rank failed or stopped answering; str() is the one line to print."""


def _first_line(exc: BaseException, limit: int = 200) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def looks_like_comm_error(exc: BaseException) -> bool:
    """A collective that failed (peer gone, timeout), as opposed to this rank's own error.

    Told by type and origin, never by words in the message (a rank's own error may well
    say "timeout"): leangrpo's user errors are always this rank's own; a failed
    collective is a `torch.distributed.DistError`, a `PeerStopped`, or a RuntimeError /
    OSError raised inside torch.distributed's communication calls (gloo raises plain
    RuntimeErrors), itself or as the explicit cause (`raise ... from`) of the error seen.
    """
    if is_user_error(exc):
        return False
    chain: list[BaseException] = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__
    return any(_is_collective_failure(e) for e in chain)


def _is_collective_failure(exc: BaseException) -> bool:
    if isinstance(exc, dist.DistError | PeerStopped):
        return True
    return isinstance(exc, RuntimeError | OSError) and _raised_in_collective(exc)


def _raised_in_collective(exc: BaseException) -> bool:
    """The innermost torch.distributed frame of the traceback is a communication call."""
    innermost = None
    tb = exc.__traceback__
    while tb is not None:
        filename = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if filename.startswith(_TORCH_DISTRIBUTED + os.sep):
            innermost = filename
        tb = tb.tb_next
    if innermost is None:
        return False
    return os.path.splitext(os.path.basename(innermost))[0] in _COLLECTIVE_MODULES


def _cause(records: list[dict]) -> str:
    """The first failure other ranks recorded: an origin's error, else a victim's line."""
    first = next((r for r in records if r["origin"]), records[0])
    if first["origin"]:
        return f"rank {first['rank']} failed during {first['phase']}: {first['error']}"
    return first["error"]


class _Watch:
    """Heartbeats and failure records in the rendezvous store, under namespace `prefix`.

    Keys: `beat/<rank>` = "<counter> <phase>", rewritten every `interval` seconds by a
    daemon thread, and "<counter> done" once the rank shut down; `failures` = JSON lines
    appended by failing ranks ({"rank", "phase", "error", "origin"}).
    """

    def __init__(self, rank: int, world_size: int, timeout_s: float, store: dist.Store):
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
        self.prefix = f"leangrpo/{run}/{attempt}/"
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.interval = min(max(timeout_s / 20, 0.2), 2.0)
        self.stall_s = max(timeout_s / 2, 3 * self.interval)
        self.grace_s = max(min(timeout_s / 4, 30.0), 2 * self.interval)
        self.phase, self._count = "setup", 0
        self._store, self._lock = store, threading.Lock()
        self._stop = threading.Event()
        self._seen: dict[int, tuple[str, float]] = {}  # peer -> (last beat, when it changed)
        # backstop: exit at this monotonic time, printing the line unless already shown
        self._exit_at: float | None = None
        self._exit_line: str | None = None
        self._beat()
        self._thread = threading.Thread(target=self._run, name="leangrpo-heartbeat", daemon=True)
        self._thread.start()

    # -- main thread ---------------------------------------------------------------------

    def enter(self, phase: str) -> str:
        outer, self.phase = self.phase, phase
        return outer

    def leave(self, outer: str) -> None:
        self.phase = outer

    def failure(self, phase: str, exc: Exception) -> DistributedError | None:
        """The error a victim raises, or None when this rank is the origin (re-raise exc).

        Either way the failure is fatal: the process exits within `grace_s` even if the
        exception is caught, or the interpreter's exit blocks on a pending collective.
        """
        self._schedule_exit(None)
        self._exit_line = None  # the main thread shows the error (a traceback, or the line)
        try:
            others = [r for r in self._failures() if r["rank"] != self.rank]
            if not others and not looks_like_comm_error(exc):
                self._record(phase, _first_line(exc), origin=True)
                line = f"leangrpo: rank {self.rank} failed during {phase}: {_first_line(exc)}"
                print(line, file=sys.stderr, flush=True)
                return None
            line = self._explain(phase, exc, others)
            self._record(phase, line, origin=False)
            return DistributedError(line)
        except Exception:  # the store itself is gone: its host (rank 0 or the agent) died
            return DistributedError(
                f"rank {self.rank} stops during {phase}: lost the rendezvous store (rank 0 "
                f"or torchrun's agent is gone); {_first_line(exc)}"
            )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.interval)
        self.phase = DONE
        with contextlib.suppress(Exception):
            self._beat()

    # -- explaining a failure ------------------------------------------------------------

    def _explain(self, phase: str, exc: Exception, others: list[dict]) -> str:
        me = f"rank {self.rank} stops during {phase}"
        if others:
            return f"{me}: {_cause(others)}"
        dead = self._stalled_peers(wait_s=2.5 * self.interval)
        if dead:
            who = ", ".join(f"rank {r} (in {p})" for r, p in dead)
            return f"{me}: {who} stopped answering (killed, or stuck outside Python); {_first_line(exc)}"
        elsewhere = [(r, p) for r, p in self._peer_phases() if p != phase]
        if elsewhere:
            who = ", ".join(f"rank {r} in {p}" for r, p in elsewhere)
            return (
                f"{me}: a collective gave up after distributed.timeout_s={self.timeout_s:g} s "
                f"waiting for {who}; {_first_line(exc)}"
            )
        return f"{me}: a collective failed and no rank reported why; {_first_line(exc)}"

    def _failures(self) -> list[dict]:
        key = f"{self.prefix}failures"
        with self._lock:
            if not self._store.check([key]):
                return []
            text = self._store.get(key).decode()
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def _record(self, phase: str, error: str, origin: bool) -> None:
        line = json.dumps({"rank": self.rank, "phase": phase, "error": error, "origin": origin})
        with self._lock:
            self._store.append(f"{self.prefix}failures", line + "\n")

    def _beats(self) -> dict[int, tuple[str, bool]]:
        """peer -> (beat value "<counter> <phase>", whether it has shut down)."""
        peers = [r for r in range(self.world_size) if r != self.rank]
        with self._lock:
            values = self._store.multi_get([f"{self.prefix}beat/{r}" for r in peers])
        beats = [v.decode() for v in values]
        return {r: (v, v.endswith(" " + DONE)) for r, v in zip(peers, beats)}

    def _peer_phases(self) -> list[tuple[int, str]]:
        return [(r, v.split(" ", 1)[1]) for r, (v, done) in self._beats().items() if not done]

    def _stalled_peers(self, wait_s: float) -> list[tuple[int, str]]:
        before = self._beats()
        time.sleep(wait_s)
        after = self._beats()
        return [
            (r, after[r][0].split(" ", 1)[1])
            for r in before
            if before[r][0] == after[r][0] and not after[r][1]
        ]

    # -- the heartbeat thread ------------------------------------------------------------

    def _beat(self) -> None:
        self._count += 1
        with self._lock:
            self._store.set(f"{self.prefix}beat/{self.rank}", f"{self._count} {self.phase}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                if self._exit_at is None:
                    self._watch_peers()
            except Exception as exc:  # the store is gone: its host died
                self._schedule_exit(
                    f"rank {self.rank} stops during {self.phase}: lost the rendezvous store "
                    f"(rank 0 or torchrun's agent is gone): {_first_line(exc)}"
                )
            if self._exit_at is not None and time.monotonic() > self._exit_at:
                if self._stop.is_set():
                    return
                if self._exit_line is not None:
                    print(f"leangrpo: error: {self._exit_line}", file=sys.stderr, flush=True)
                os._exit(1)

    def _watch_peers(self) -> None:
        now = time.monotonic()
        others = [r for r in self._failures() if r["rank"] != self.rank]
        if others:
            self._schedule_exit(f"rank {self.rank} stops during {self.phase}: {_cause(others)}")
        for peer, (value, done) in self._beats().items():
            last = self._seen.get(peer)
            if last is None or last[0] != value:
                self._seen[peer] = (value, now)
            elif not done and now - last[1] > self.stall_s:
                self._schedule_exit(
                    f"rank {self.rank} stops during {self.phase}: rank {peer} (in "
                    f"{value.split(' ', 1)[1]}) has not answered for {now - last[1]:.0f} s "
                    "(killed, or stuck outside Python)"
                )

    def _schedule_exit(self, line: str | None) -> None:
        """Exit `grace_s` from now (the first call wins); print `line` then, if given."""
        if self._exit_at is None:
            self._exit_line = line
            self._exit_at = time.monotonic() + self.grace_s
