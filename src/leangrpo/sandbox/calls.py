"""One call of user code in a worker, under its limits (worker side).

`LimitedCall.invoke(fn, args, kwargs)` runs one call and returns (its value, None) or
(None, an error reply {"t": "error", "kind", "msg"}). The kinds of a limit are
LIMIT_KINDS; any other failure is the exception's name (SystemExit and KeyboardInterrupt
included: user code cannot end the worker by raising them).

- Wall time: at the limit a watchdog thread sets `fired` and sends SIGUSR1 to the main
  thread, whose handler raises `_Interrupted` (user code that catches Exception cannot
  swallow it), and kills the processes started during the call, so a blocking `os.system`
  returns. The handler ignores a SIGUSR1 with no `fired` and a SIGXCPU the kernel did not
  send (it raises the soft RLIMIT_CPU as it does): a process the call starts (the program a reward
  runs) can send either, and would otherwise turn its 0.0 into a failure counted as a
  timeout. Not SIGALRM:
  math-verify uses alarm() for its own limits. A call stuck in C code is left to the
  trainer's hard limit (it kills the worker's tree).
- CPU time (`cpu_time_limit_s`): the soft RLIMIT_CPU is set to the CPU used so far plus
  the limit; SIGXCPU interrupts the call the same way.
- Output: the box's output meter (output.py) counts what the call and its processes
  print; past the limit it interrupts the call like the watchdog. (A reward call's box
  has no meter: its supervisor counts, and ends the box past the limit, box.py.)
- Memory and processes are limits of the whole sandbox (confine.py: RLIMIT_AS, the pids
  limit); a call that hits them fails with MemoryError, or with EAGAIN from fork / "can't
  start new thread", and is reported as that limit.
- Processes a call starts end with it: every descendant started during the call is killed
  when it returns, whatever the outcome (the worker is a child subreaper or the PID
  namespace's init, so daemons that left the process group are found too).
  `keep_processes=True` (an environment's own reset, step and finish) keeps them instead
  and lists them in `started`, for the worker to end with the trajectory.
- A call interrupted while importing modules sets `interrupted_import`: the worker retires
  after the task (a half-imported module cannot be trusted); the pool starts a fresh one.
"""

from __future__ import annotations

import _signal
import _thread
import contextlib
import errno
import os
import resource
import signal
import sys
import threading
import time
from typing import Any

from leangrpo.sandbox.frames import one_line
from leangrpo.sandbox.proctree import children, descendants, has_children, is_live, kill_descendants

TIMEOUT, CPU, MEMORY, OUTPUT, PROCESSES = (
    "timeout",
    "cpu time limit",
    "memory limit",
    "output limit",
    "process limit",
)
LIMIT_KINDS = (TIMEOUT, CPU, MEMORY, OUTPUT, PROCESSES)
_CALL_SIGNALS = (int(signal.SIGUSR1), int(signal.SIGXCPU))


def message(exc: BaseException) -> str:
    """An exception's text on one line (a user exception whose __str__ fails included)."""
    try:
        return one_line(str(exc))
    except Exception:  # a user exception whose __str__ fails
        return f"<unprintable {type(exc).__name__}>"


class _Interrupted(BaseException):
    """Raised inside a call at its time, CPU or output limit."""

    def __init__(self, kind: str):
        super().__init__(kind)
        self.kind = kind


class _Watchdog:
    """One thread for every call (starting a timer thread per call cost more than the
    call of a cheap reward): calls `fire` once the armed deadline passes."""

    def __init__(self, fire: Any):
        self._fire = fire
        self._deadline: float | None = None
        self._cond = threading.Condition()
        # a bare thread, like the output meter's: no Thread object, no wait for it to
        # start (a box pays for every page it writes: these cost it dozens)
        _thread.start_new_thread(self._run, ())

    def arm(self, seconds: float) -> None:
        with self._cond:
            self._deadline = time.monotonic() + seconds
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._deadline = None

    def _run(self) -> None:
        while True:
            with self._cond:
                left = None if self._deadline is None else self._deadline - time.monotonic()
                if left is None or left > 0:
                    self._cond.wait(left)
                    continue
                self._deadline = None
            self._fire(TIMEOUT)


class LimitedCall:
    """Runs calls of user code under the worker's limits; see the module docstring.
    `limits` (the sandbox's, from the start-up message) names memory_limit_mb,
    max_processes and max_output_bytes for the messages; `meter` is the output meter."""

    def __init__(
        self,
        timeout_s: float,
        cpu_time_limit_s: float | None,
        limits: dict | None = None,
        meter: Any = None,
    ):
        self.timeout_s = timeout_s
        self.limit_s = timeout_s  # the time limit of the call running now
        self.cpu_time_limit_s = cpu_time_limit_s
        self.limits = limits or {}
        self.meter = meter
        self.active = False
        self.fired: str | None = None  # the limit that stopped the call running now
        self.interrupted_import = False
        self.started: list[int] = []  # kept processes the last call started
        self._before: frozenset[int] = frozenset()
        self._cpu_soft: int | None = None  # the soft RLIMIT_CPU this call set
        self._lock = threading.Lock()
        self._watchdog = _Watchdog(self.interrupt)
        if meter is not None:
            meter.on_exceeded = self.interrupt

    def _arm(self) -> None:
        """(Re)install the handlers and unblock the signals: a previous call may have
        changed either."""
        for signum in _CALL_SIGNALS:  # the C functions: no enum made of what they return
            _signal.signal(signum, self._on_signal)
        _signal.pthread_sigmask(signal.SIG_UNBLOCK, _CALL_SIGNALS)

    def _on_signal(self, signum: int, frame: object) -> None:
        """Interrupt the call, only for a genuine signal: SIGUSR1 once `interrupt` (this
        process's watchdog or output meter) has set `fired`, SIGXCPU once this process's
        own CPU time reached its limit. Any process of the call (the program a reward runs)
        may send either: a forged one is ignored, not a failure counted as a timeout."""
        if not self.active:  # a late signal after the call returned is ignored
            return
        if signum == signal.SIGXCPU:
            if not self._cpu_time_spent():
                return
            self.fired = self.fired or CPU
        elif self.fired is None:
            return
        self.active = False
        raise _Interrupted(self.fired)

    def _cpu_time_spent(self) -> bool:
        """The kernel raises the soft RLIMIT_CPU by a second as it sends SIGXCPU (so that
        the next comes a second later); kill() leaves it as this call set it."""
        if self._cpu_soft is None:
            return False
        soft, _ = resource.getrlimit(resource.RLIMIT_CPU)
        return soft == resource.RLIM_INFINITY or soft > self._cpu_soft

    def interrupt(self, kind: str) -> None:
        """Stop the call running now at limit `kind` (any thread; the first limit wins)."""
        with self._lock:
            if not self.active or self.fired is not None:
                return
            self.fired = kind  # a call that then returns anyway has still failed
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
        kill_descendants(os.getpid(), keep=self._before)

    def invoke(
        self,
        fn: Any,
        args: tuple,
        kwargs: dict,
        timeout_s: float | None = None,
        keep_processes: bool = False,
    ) -> tuple[Any, dict | None]:
        """fn(*args, **kwargs) under the limits (`timeout_s`, default the worker's): (its
        return, None), or (None, an error reply {"t": "error", "kind", "msg"})."""
        self._arm()
        self.limit_s = self.timeout_s if timeout_s is None else timeout_s
        self._before = frozenset(descendants(os.getpid()) if has_children() else ())
        modules = len(sys.modules)  # new modules are appended: sys.modules is ordered
        self.interrupted_import, self.fired, self.started = False, None, []
        self._set_cpu_limit()
        if self.meter is not None:
            self.meter.start_call()
        self.active = True
        self._watchdog.arm(self.limit_s)
        try:
            raw = fn(*args, **kwargs)
            if self.fired is not None:
                raise _Interrupted(self.fired)
            return raw, None
        except _Interrupted as e:
            return None, self._interrupted(e.kind, _importing(e) + list(sys.modules)[modules:])
        except BaseException as e:  # the user's exception, SystemExit and KeyboardInterrupt too
            return None, self._failed(e)
        finally:
            self.active = False
            self._watchdog.disarm()
            self._set_cpu_limit(off=True)
            if self.meter is not None:
                self.meter.end_call()
            self._end_processes(keep_processes)

    def _end_processes(self, keep: bool) -> None:
        if not has_children():
            return
        if keep:  # live ones only: a dead one's pid may be reused by the time it is ended
            found = descendants(os.getpid())
            self.started = [p for p in found if p not in self._before and is_live(p)]
        else:
            kill_descendants(os.getpid(), keep=self._before)
        _reap_zombies(self._before)

    def _failed(self, exc: BaseException) -> dict:
        if isinstance(exc, MemoryError):
            limit = self.limits.get("memory_limit_mb")
            under = f" under the {limit} MB limit" if limit else ""
            return _error(MEMORY, f"ran out of memory{under} (MemoryError)")
        if _out_of_processes(exc):
            limit = self.limits.get("max_processes")
            of = f" (the limit is {limit})" if limit else ""
            what = f"{type(exc).__name__}: {message(exc)}"
            return _error(PROCESSES, f"could not start a process or thread{of}: {what}")
        return _error(type(exc).__name__, message(exc))

    def _interrupted(self, kind: str, modules: list[str]) -> dict:
        """`modules`: those being imported when the call was stopped, then those it added."""
        kill_descendants(os.getpid(), keep=self._before)
        if kind == OUTPUT:
            msg = f"printed more than {self.limits.get('max_output_bytes')} bytes"
        elif kind == CPU:
            msg = f"used its CPU time after {self.cpu_time_limit_s:g} s"
        else:
            msg = f"timed out after {self.limit_s:g} s"
        if modules:
            self.interrupted_import = True
            roots = list(dict.fromkeys(m.partition(".")[0] for m in modules))
            msg += (
                f" while importing {', '.join(roots[:3])}; import heavy modules at the top "
                "of the file, where start-up time does not count"
            )
        return _error(kind, msg)

    def _set_cpu_limit(self, off: bool = False) -> None:
        if not self.cpu_time_limit_s:
            return
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        self._cpu_soft = None
        if off:
            soft = hard
        else:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            soft = int(usage.ru_utime + usage.ru_stime + self.cpu_time_limit_s + 0.999)
            if hard != resource.RLIM_INFINITY:
                soft = min(soft, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
            self._cpu_soft = None if off else soft


def _error(kind: str, msg: str) -> dict:
    return {"t": "error", "kind": kind, "msg": msg}


def _out_of_processes(exc: BaseException) -> bool:
    """fork() refused (EAGAIN: the pids or process limit) or no thread could start."""
    if isinstance(exc, BlockingIOError) and exc.errno == errno.EAGAIN:
        return True
    return isinstance(exc, RuntimeError) and "can't start new thread" in str(exc)


def _reap_zombies(keep: frozenset[int]) -> None:
    """Reap exited children the call left behind (orphans re-parented to this process)."""
    for pid in children(os.getpid()):
        if pid not in keep and not is_live(pid):
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)


def _importing(exc: BaseException) -> list[str]:
    """The modules whose top-level code was running where `exc` was raised, i.e. being
    imported (a failed import removes its own module from sys.modules, but what it
    half-imported stays; importlib's own frames are cut from the traceback)."""
    names = []
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        spec = frame.f_globals.get("__spec__")
        # a module's top level, not code run with exec() (also "<module>", not an import)
        if frame.f_code.co_name == "<module>" and spec is not None and (
            getattr(spec, "origin", None) == frame.f_code.co_filename
        ):
            names.append(str(frame.f_globals.get("__name__")))
        tb = tb.tb_next
    return names
