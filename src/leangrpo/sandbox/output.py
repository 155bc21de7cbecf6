"""What a box and the processes it starts print (worker side): counted, capped, passed on.

For a box that serves several calls (a trajectory: its tool calls each have the output
limit); a reward call's box has none, its supervisor counts what it prints (box.py). The
box's descriptors 1 and 2 become the write end of a pipe that one thread of the box
drains, so everything printed (by user code in the box, or by any process it starts,
which inherits 1 and 2) passes through it:

- bytes printed during a call are counted; past `max_output_bytes` the call is stopped
  (`on_exceeded(OUTPUT)`, calls.py), so a tool that floods its output fails with a message
  instead of occupying the trainer;
- at most FORWARD_BYTES per call, and per stretch between calls, are passed on to the
  trainer's pipe (which the trainer relays to its log line by line); the rest is dropped.

Both ends live on high, close-on-exec descriptors, closed in a child forked from Python
(os.register_at_fork): the processes user code starts hold only 0, 1 and 2. The box's own
process (and a child forked from C, which runs no fork handler) can still find the
descriptor to the trainer's pipe and write past the count; the supervisor passes on at
most FORWARD_BYTES per request of it, and reads a bounded amount per wake-up (box.py
`relay`), so that costs neither the log nor the call's deadline. A thread rather than a
per-call pipe: nothing is paid per call.
"""

from __future__ import annotations

import _thread
import contextlib
import fcntl
import os
import sys
import termios
import time
from collections.abc import Callable

from leangrpo.sandbox.calls import OUTPUT
from leangrpo.sandbox.frames import CHANNEL_FD_MIN

FORWARD_BYTES = 64 << 10
SETTLE_S = 0.2  # at a call's end, how long its output may take to reach the trainer's pipe


class OutputMeter:
    def __init__(self, max_output_bytes: int):
        self.max_bytes = max_output_bytes
        self.on_exceeded: Callable[[str], None] | None = None
        self.counted = 0  # bytes of the call running now
        self.forwarded = 0  # bytes passed on in this stretch (a call, or between calls)
        self.in_call = False
        self._passing = False  # the drain thread holds bytes it has read but not passed on
        self._to_trainer = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, CHANNEL_FD_MIN)
        read, write = os.pipe()
        os.dup2(write, 1)
        os.dup2(write, 2)
        os.close(write)
        self._read = fcntl.fcntl(read, fcntl.F_DUPFD_CLOEXEC, CHANNEL_FD_MIN)
        os.close(read)
        os.register_at_fork(after_in_child=self._forget)
        _thread.start_new_thread(self._drain, ())  # (no Thread object: see calls._Watchdog)

    def _forget(self) -> None:
        """In a forked child: close both ends the meter holds, so what the child prints
        passes the meter's count (its 1 and 2) and nothing else reaches the trainer's pipe."""
        for fd in (self._to_trainer, self._read):
            with contextlib.suppress(OSError):
                os.close(fd)

    def start_call(self) -> None:
        self.counted = self.forwarded = 0
        self.in_call = True

    def end_call(self) -> None:
        self.settle()
        self.in_call = False
        self.forwarded = 0

    def settle(self) -> None:
        """What was printed so far is passed on before the next reply leaves (so the log
        shows it even if the worker is killed next); a process still printing gets
        SETTLE_S."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # user code may have closed or replaced it
                stream.flush()
        deadline = time.monotonic() + SETTLE_S
        while (self._passing or self._unread() > 0) and time.monotonic() < deadline:
            time.sleep(0.001)

    def _unread(self) -> int:
        try:
            return int.from_bytes(fcntl.ioctl(self._read, termios.FIONREAD, b"\0" * 4), "little")
        except OSError:
            return 0

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self._read, 1 << 16)
            except InterruptedError:
                continue
            except OSError:
                return
            if not data:  # every writer closed it: user code closed 1 and 2
                return
            self._passing = True
            self._count(len(data))
            self._forward(data)
            self._passing = False

    def _count(self, size: int) -> None:
        if not self.in_call:
            return
        self.counted += size
        if self.counted > self.max_bytes and self.on_exceeded is not None:
            self.on_exceeded(OUTPUT)

    def _forward(self, data: bytes) -> None:
        room = FORWARD_BYTES - self.forwarded
        if room <= 0:
            return
        chunk = data[:room]
        self.forwarded += len(chunk)
        with contextlib.suppress(OSError):  # the trainer closed its end: nothing to show
            view = memoryview(chunk)
            while view:
                view = view[os.write(self._to_trainer, view) :]
