"""The trainer's side of one worker process: start it in its sandbox, talk to it, relay
its output, kill it.

- Started with `subprocess.Popen` (thread-safe, unlike a preexec_fn): a fresh interpreter
  running the launcher (launch.py, which confines it and then runs the worker's code: no
  re-import of the trainer's `__main__`, so torch is never loaded there) in its own
  session (`start_new_session`), every descriptor closed but the channel, stdin =
  /dev/null, stdout and stderr into one pipe, with the plan's environment (levels.py:
  allow-listed, HOME and TMPDIR at the worker's scratch directory). A scratch directory and,
  for a root trainer, its cgroups (memory, pids: the worker makes one per box inside) are
  made per worker and removed when it is released
  (those of a trainer that was killed, by the next trainer's first worker).
- Replies are read without blocking into a FrameReader and parsed only when whole, so a
  worker cannot stall the trainer with half a message; `parse` checks each against its
  worker's schema (rewards/protocol.py, environments/wire.py).
- Output is relayed line by line to the `leangrpo.rewards` logger as `[<label>] line`,
  sanitised and truncated, at most `OutputBudget.lines` lines per operation; one read per
  wake-up, so a worker that prints without pause cannot keep the pool from its deadlines
  (the worker's own meter, output.py, already caps what it passes on).
- `terminate` kills the worker's whole tree (proctree.kill_tree) and reaps it; it only
  signals processes, so another thread may call it while the owner is waiting on the
  worker's descriptors. `release` closes those descriptors (the owner only).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from leangrpo.sandbox.cgroups import make_group, remove_groups
from leangrpo.sandbox.confine import SCRATCH_PREFIX
from leangrpo.sandbox.files import remove_tree
from leangrpo.sandbox.frames import FrameReader, pickle_frame
from leangrpo.sandbox.launch import LAUNCH_CODE
from leangrpo.sandbox.levels import SandboxPlan, protect_trainer
from leangrpo.sandbox.proctree import kill_tree, process_exists

log = logging.getLogger("leangrpo.rewards")

SEND_TIMEOUT_S = 30.0  # a worker that does not read its task for this long is broken
EXIT_REPORT_S = 1.0  # how long a worker that closed its channel may take to exit
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
    """One worker process, its socket and its output pipe. `init` is its start-up message
    (`init["entry"]` names the module whose `serve` runs: rewards/worker.py or
    environments/worker.py), `parse` how its replies are read, `plan` its sandbox."""

    def __init__(
        self,
        init: dict,
        label: str,
        budget: OutputBudget,
        *,
        parse: Callable[[bytes], Any],
        plan: SandboxPlan,
    ):
        self.label = label
        self.budget = budget
        self.parse = parse
        if plan.level == "process":
            protect_trainer()
        self.scratch = scratch_directory()
        self.cgroups = make_group() if plan.uses_cgroups() else []
        parent, child = socket.socketpair()
        out_read, out_write = os.pipe()
        spec = json.dumps(plan.worker_spec(self.scratch, [g.as_dict() for g in self.cgroups]))
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", LAUNCH_CODE, str(child.fileno()), spec],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=out_write,
                stderr=out_write,
                env=plan.environment(self.scratch),
                start_new_session=True,
            )
        except BaseException:
            parent.close()
            os.close(out_read)
            self._remove_files()
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
        self.calls: dict[int, Any] = {}  # a reward worker's calls out, by id
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

    def receive(self) -> list[Any]:
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
        """Log the complete lines of one read of what the worker printed (one read: the
        caller's loop comes back to its deadlines however fast the worker prints)."""
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

    def exit_code(self) -> int | None:
        """The exit code of a worker whose channel closed (it exited): a namespace worker's
        launcher reports it once the kernel has ended the namespace, so it gets a moment
        (EXIT_REPORT_S) before the tree is killed. Then as `terminate`."""
        with self._kill_lock:
            if self.proc.returncode is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=EXIT_REPORT_S)
            if self.proc.returncode is None:
                kill_tree(self.proc.pid)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=5.0)
            return self.proc.returncode

    def release(self) -> None:
        """Relay the last output, close the descriptors and, once the worker is gone,
        remove its scratch directory and cgroup (the owner only; idempotent)."""
        if self._released:
            return
        self._released = True
        self.relay_output()
        if self._line:
            self._show(self._line)
        self.sock.close()
        os.close(self.out_fd)
        if self.proc.returncode is not None:
            self._remove_files()

    def _remove_files(self) -> None:
        remove_groups(self.cgroups)
        remove_tree(self.scratch)

    def kill(self) -> None:
        self.terminate()
        self.release()


_cleaned: list[bool] = []  # stale scratch directories removed, once per process
SCRATCH_BASE = "/var/tmp"


def scratch_base() -> str:
    """Where workers' scratch directories are made: /var/tmp where this user may write
    there, else the temporary directory. Not /tmp first: a `process`-level box can neither
    list nor create entries directly in the directories on the way to its scratch
    (confine.py `filesystem_grants`), and /tmp is where code writes most."""
    if os.access(SCRATCH_BASE, os.W_OK | os.X_OK):
        return SCRATCH_BASE
    return tempfile.gettempdir()


def scratch_directory() -> str:
    """A fresh scratch directory named after this trainer's pid; the first call also
    removes those of trainers no longer running (killed before they could)."""
    base = scratch_base()
    if not _cleaned:
        _cleaned.append(True)
        for path in Path(base).glob(f"{SCRATCH_PREFIX}*-*"):
            owner = path.name[len(SCRATCH_PREFIX) :].partition("-")[0]
            if owner.isdigit() and int(owner) != os.getpid() and not process_exists(int(owner)):
                remove_tree(path)
    return tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=base)
