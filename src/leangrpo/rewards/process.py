"""The trainer's side of one reward worker: start it, talk to it, relay its output, kill it.

- Started with `subprocess.Popen` (thread-safe, unlike a preexec_fn): a fresh interpreter
  (like the "spawn" start method, without re-importing the trainer's `__main__`, so torch is
  never loaded there) in its own session (`start_new_session`), every descriptor closed but
  the channel, stdin = /dev/null, stdout and stderr into one pipe, PYTHONUNBUFFERED so that
  prints arrive as they happen.
- Replies are read without blocking into a FrameReader and parsed only when whole, so a
  worker cannot stall the trainer with half a message; see protocol.py for what is accepted.
- Output is relayed line by line to the `leangrpo.rewards` logger as `[<label>] line`,
  sanitised and truncated, at most `OutputBudget.lines` lines per score() call.
- `terminate` kills the worker's whole tree (proctree.kill_tree) and reaps it; it only
  signals processes, so another thread may call it while the owner is waiting on the
  worker's descriptors. `release` closes those descriptors (the owner only).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from leangrpo.rewards.proctree import kill_tree
from leangrpo.rewards.protocol import FrameReader, Reply, parse_reply, pickle_frame

log = logging.getLogger("leangrpo.rewards")

WORKER_CODE = "import sys; from leangrpo.rewards.worker import main; main()"
SEND_TIMEOUT_S = 30.0  # a worker that does not read its task for this long is broken
_LINE_CHARS = 300


class WorkerGone(Exception):
    """The worker exited, or its channel broke."""


class OutputBudget:
    """Lines of worker output shown per score() call; the rest are counted."""

    def __init__(self, lines: int = 50):
        self.lines = lines
        self.left = lines
        self.suppressed = 0

    def show(self, label: str, line: str) -> None:
        if self.left > 0:
            self.left -= 1
            log.info("[%s] %s", label, line)
        else:
            self.suppressed += 1

    def reset(self) -> None:
        if self.suppressed:
            log.info("[reward workers] %d more lines of output not shown", self.suppressed)
        self.left, self.suppressed = self.lines, 0


class WorkerProcess:
    """One worker process, its socket and its output pipe. `code` is what the fresh
    interpreter runs (a reward worker by default; environments/ starts its own workers),
    `parse` how its replies are read (protocol.parse_reply by default)."""

    def __init__(
        self,
        init: dict,
        label: str,
        budget: OutputBudget,
        *,
        code: str = WORKER_CODE,
        parse: Callable[[bytes], Any] = parse_reply,
    ):
        self.label = label
        self.budget = budget
        self.parse = parse
        parent, child = socket.socketpair()
        out_read, out_write = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code, str(child.fileno())],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=out_write,
                stderr=out_write,
                env=_worker_env(),
                start_new_session=True,
            )
        except BaseException:
            parent.close()
            os.close(out_read)
            raise
        finally:
            child.close()
            os.close(out_write)
        os.set_blocking(out_read, False)
        parent.settimeout(SEND_TIMEOUT_S)  # recv only runs once readable: it never waits
        self.sock = parent
        self.out_fd = out_read
        self.output_open = True  # until EOF: then the pipe is no longer worth waiting on
        self.reader = FrameReader()
        self._line = b""
        self._kill_lock = threading.Lock()
        self._released = False
        self.started = time.monotonic()
        # scheduling state, owned by the pool
        self.ready = False
        self.loading = 0  # the function being imported (names it if start-up fails)
        self.task: Any = None
        self.since = self.started
        self.deadline = math.inf
        with contextlib.suppress(WorkerGone):  # died at once: its EOF is read like any other
            self.send(init)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, obj: object) -> None:
        try:
            self.sock.sendall(pickle_frame(obj))
        except OSError as e:  # includes the send timeout
            raise WorkerGone(f"the worker stopped reading ({type(e).__name__})") from None

    def receive(self) -> list[Reply] | list[Any]:
        """Whole replies received so far (call when the socket is readable).
        WorkerGone at EOF; protocol.ProtocolError for bytes that are not a valid reply."""
        try:
            data = self.sock.recv(1 << 16)
        except OSError as e:
            raise WorkerGone(f"its channel broke ({type(e).__name__})") from None
        if not data:
            raise WorkerGone("the worker process exited")
        return [self.parse(payload) for payload in self.reader.feed(data)]

    def handles(self) -> list:
        """What to wait on: the socket, and the output pipe until its EOF."""
        return [self.sock, self.out_fd] if self.output_open else [self.sock]

    def relay_output(self) -> None:
        """Log the complete lines the worker has printed so far."""
        while True:
            try:
                data = os.read(self.out_fd, 1 << 16)
            except (BlockingIOError, OSError):
                return
            if not data:  # every writer closed it (the worker may live on: it closed fd 1, 2)
                self.output_open = False
                return
            *lines, self._line = (self._line + data).split(b"\n")
            if len(self._line) > _LINE_CHARS:
                lines.append(self._line)
                self._line = b""
            for line in lines:
                self._show(line)

    def _show(self, raw: bytes) -> None:
        text = raw.decode("utf-8", "replace").rstrip("\r")
        text = "".join(c if c.isprintable() else "?" for c in text[:_LINE_CHARS])
        if text.strip():
            self.budget.show(self.label, text)

    def terminate(self) -> int | None:
        """Kill the worker's tree and reap it (any thread; idempotent); its exit code.

        Nothing else reaps the worker: until it is reaped its pid, and so its process-group
        id, cannot be reused, so the kill reaches its group even after it exited."""
        with self._kill_lock:
            if self.proc.returncode is None:
                kill_tree(self.proc.pid)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=5.0)
            return self.proc.returncode

    def release(self) -> None:
        """Relay the last output and close the descriptors (the owner only; idempotent)."""
        if self._released:
            return
        self._released = True
        self.relay_output()
        if self._line:
            self._show(self._line)
        self.sock.close()
        os.close(self.out_fd)

    def kill(self) -> None:
        self.terminate()
        self.release()


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])  # the dir holding the leangrpo package
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env
