"""Stopping a run on SIGTERM or Ctrl-C: a checkpoint at the step it reached, then exit.

SLURM, Kubernetes and spot instances send SIGTERM some seconds before they kill a job.
`StopSignals`, installed by `Trainer.train` in the main thread for the length of the loop
(the previous handlers come back after it), turns the first SIGTERM or SIGINT into a
request: the loop checks `requested` at each optimizer-step boundary, saves a checkpoint
at that step (exact, the batch in progress included), closes everything and raises
`RunStopped`, which the CLI prints as one line and turns into the conventional status
128 + signal (143 for SIGTERM, 130 for SIGINT).

- Waits that may last (a sync batch being generated and scored, an async trainer waiting
  for its next batch) run inside `abandonable()`: there the first signal raises
  `StopRequested` at once, so the batch is abandoned. That is safe because a producer's
  checkpointed state is "as of the last batch handed out": the abandoned batch is made
  again, with the same seeds, after the resume. Under torchrun nothing is abandonable
  (a batch's exchange needs every rank); every rank stops at the same boundary, agreed
  by an all-reduce of `requested` there.
- A second signal exits at once (`os._exit(128 + signal)`): the checkpoint being written,
  if any, is left as a `.tmp-*` directory that nothing mistakes for a complete one
  (checkpoint/local.py), so the last complete checkpoint stays the resume point. A repeat
  within `REPEAT_WINDOW_S` of the first is the same request delivered twice (a scheduler
  signals every process of a job, and torchrun forwards its own copy to its workers).
- Before the loop (loading the model) and after it, the previous handlers are in place:
  SIGTERM ends the process, Ctrl-C raises KeyboardInterrupt, and there is nothing to save.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_WINDOW_S = 1.0


class StopRequested(BaseException):
    """Raised inside `abandonable()` by the first signal; not an Exception, so that no
    `except Exception` on the way (a reward pool's error handling) swallows it."""


class RunStopped(Exception):
    """The run stopped on a signal after saving its checkpoint; str() is the one line."""

    def __init__(self, signum: int, step: int, checkpoint: Path, show: bool = True):
        self.signum, self.step, self.checkpoint, self.show = signum, step, checkpoint, show
        super().__init__(
            f"stopped by {signal_name(signum)} at step {step}: checkpoint saved to "
            f"{checkpoint}; run the same command to resume"
        )

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopSignals:
    """First SIGTERM / SIGINT: a stop request (`requested`); a later one: exit at once.

    A context manager; it installs its handlers only in the main thread (signal handlers
    cannot be installed elsewhere), else it requests nothing, ever. `abandon`: whether
    `abandonable()` regions may be cut short (False under torchrun).
    """

    def __init__(self, abandon: bool = True):
        self.abandon = abandon
        self.requested = 0  # the first signal's number; 0: none
        self._first_at = 0.0
        self._abandonable = 0  # depth of abandonable() regions the main thread is in
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        global _active
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._on_signal)
            _active = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _active
        for signum, handler in self._previous.items():  # None: not installed from Python
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._previous = {}
        if _active is self:
            _active = None

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.requested:
            if time.monotonic() - self._first_at < REPEAT_WINDOW_S:
                return  # the same request, delivered twice
            line = (
                f"leangrpo: second {signal_name(signum)}: exiting now; the last complete "
                "checkpoint is intact\n"
            )
            os.write(2, line.encode())
            os._exit(128 + signum)
        self.requested, self._first_at = signum, time.monotonic()
        if self._abandonable and self.abandon:
            raise StopRequested(signum)

    @contextlib.contextmanager
    def abandoning(self) -> Iterator[None]:
        if self.abandon and self.requested:
            raise StopRequested(self.requested)
        self._abandonable += 1
        try:
            yield
        finally:
            self._abandonable -= 1


_active: StopSignals | None = None


@contextlib.contextmanager
def abandonable() -> Iterator[None]:
    """A wait that the first stop signal may cut short (raising StopRequested).

    Wrap only code whose abandonment leaves the caller's checkpointed state as it was
    before the region (a producer's "as of the last batch handed out"). A no-op unless a
    `StopSignals` is active in this process and the caller is its main thread.
    """
    stop = _active
    if stop is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    with stop.abandoning():
        yield
