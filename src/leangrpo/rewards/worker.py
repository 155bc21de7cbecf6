"""A reward worker process: resolve the reward functions, then score chunks until EOF.

Started by process.WorkerProcess as a fresh interpreter (`python -c ... FD`) in its own
session. It holds only: the channel socket (moved to a high descriptor, close-on-exec, so
processes a reward starts do not inherit it), stdin = /dev/null, and stdout/stderr = a pipe
the trainer relays line by line with a prefix.

Set-up: ignore SIGINT (the trainer decides when workers stop), become a child subreaper
(proctree.py), exit with its whole tree if the trainer dies, read the start-up message,
apply the memory limit, import the functions (announcing each first, so the trainer can name
the one that hangs or exits), warm up the built-ins, report ready. In "check" mode it stops
there (the start-up check of `check_rewards`).

A task is one chunk of samples for one or more functions; the inputs are unpickled afresh
for every function, so a function that mutates its arguments cannot affect another. Per call:
- Time limit: at `timeout_s` a watchdog thread sends SIGUSR1 to the main thread, whose handler
  raises `_Interrupted` (user code that catches Exception cannot swallow it), and kills the
  processes started during the call, so a blocking `os.system` returns. Not SIGALRM:
  math-verify uses alarm() for its own limits. A call stuck in C code is left to the
  trainer's hard limit (it kills the worker's tree).
- CPU limit (`cpu_time_limit_s`): the soft RLIMIT_CPU is set to the CPU used so far plus the
  limit; SIGXCPU interrupts the call the same way.
- A call interrupted while importing modules retires the worker after the task (a
  half-imported module cannot be trusted); the pool starts a fresh one.
- Any exception, SystemExit and KeyboardInterrupt included, is one failed call, reported as
  one line. Values are checked per sample (`validate`).
"""

from __future__ import annotations

import contextlib
import fcntl
import numbers
import os
import pickle
import resource
import signal
import socket
import sys
import threading
import time
from typing import Any

from leangrpo.rewards.proctree import (
    become_subreaper,
    children,
    descendants,
    has_children,
    is_live,
    kill_descendants,
)
from leangrpo.rewards.protocol import json_frame, one_line, read_frame
from leangrpo.rewards.registry import BUILTIN_NAMES, ResolvedReward, RewardSpecError, resolve

CHANNEL_FD_MIN = 100  # user code writing to "fd 3" or "the first socket" misses it


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = 0
    try:
        channel = Channel(int(sys.argv[1]))
        become_subreaper()
        exit_with_parent()
        _serve(channel, pickle.loads(channel.recv()))
    except (EOFError, OSError):  # the pool closed, or user code broke the channel
        code = 3
    os._exit(code)  # no atexit handlers or non-daemon threads of user code to wait for


class Channel:
    """A worker's end of the socket pair: JSON frames out, pickled frames in."""

    def __init__(self, fd: int):
        try:
            high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, CHANNEL_FD_MIN)
            os.close(fd)
        except OSError:  # a low RLIMIT_NOFILE: stay where we are
            high = fd
            os.set_inheritable(fd, False)
        self.sock = socket.socket(fileno=high)

    def send(self, message: dict) -> None:
        self.sock.sendall(json_frame(message))

    def recv(self) -> bytes:
        return read_frame(self.sock)


def _serve(channel: Channel, init: dict) -> None:
    sys.path[:0] = [p for p in init["sys_path"] if p not in sys.path]
    if init.get("memory_limit_mb"):
        limit = int(init["memory_limit_mb"]) << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    specs = [ResolvedReward(**d) for d in init["specs"]]
    functions = _resolve_all(channel, specs, warm_up=init["mode"] == "serve")
    if functions is None or init["mode"] != "serve":
        return
    call = LimitedCall(init["timeout_s"], init.get("cpu_time_limit_s"))
    while True:
        task_id, fns, payload = pickle.loads(channel.recv())
        retire = False
        for k, fn in enumerate(fns):
            prompts, completions, columns = pickle.loads(payload)  # a fresh copy each
            kwargs = {**columns, **specs[fn].kwargs}
            reply = call.run(functions[fn], prompts, completions, kwargs)
            retire |= call.interrupted_import
            if retire and k == len(fns) - 1:
                reply["retire"] = True  # the trainer replaces this worker once it has read this
            channel.send({**reply, "task": task_id, "fn": fn})
        if retire:
            return


def _resolve_all(channel: Channel, specs: list[ResolvedReward], warm_up: bool) -> list | None:
    functions = []
    for i, spec in enumerate(specs):
        channel.send({"t": "loading", "fn": i})
        try:
            functions.append(resolve(spec.name, spec.file))
            if warm_up and spec.name in BUILTIN_NAMES:
                from leangrpo.rewards import builtin

                builtin.warm_up(spec.name)
        except BaseException as e:  # SystemExit and KeyboardInterrupt at import included
            channel.send({"t": "init_error", "fn": i, "msg": _describe(e, spec)})
            return None
    channel.send({"t": "ready"})
    return functions


def _describe(exc: BaseException, spec: ResolvedReward) -> str:
    where = spec.file or spec.name.rpartition(":")[0]
    if isinstance(exc, SystemExit):
        return f"{where} called sys.exit({exc.code!r}) at import; a reward file must not exit"
    if isinstance(exc, RewardSpecError):
        return message(exc)
    return f"importing {where} raised {type(exc).__name__}: {message(exc)}"


def message(exc: BaseException) -> str:
    """An exception's text on one line (a user exception whose __str__ fails included)."""
    try:
        return one_line(str(exc))
    except Exception:  # a user exception whose __str__ fails
        return f"<unprintable {type(exc).__name__}>"


def _reap_zombies(keep: frozenset[int]) -> None:
    """Reap exited children the call left behind (orphans re-parented to this subreaper)."""
    for pid in children(os.getpid()):
        if pid not in keep and not is_live(pid):
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)


class _Interrupted(BaseException):
    """Raised inside a reward call at its time or CPU limit."""

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
        threading.Thread(target=self._run, name="reward-watchdog", daemon=True).start()

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
            self._fire()


class LimitedCall:
    """Runs one call under the time and CPU limits: `run` a reward (the reply to send),
    `invoke` any function (the environment worker's resets, steps and tools)."""

    def __init__(self, timeout_s: float, cpu_time_limit_s: float | None):
        self.timeout_s = timeout_s
        self.limit_s = timeout_s  # the time limit of the call running now
        self.cpu_time_limit_s = cpu_time_limit_s
        self.active = False
        self.fired = False
        self.interrupted_import = False
        self._before: frozenset[int] = frozenset()
        self._watchdog = _Watchdog(self._fire)

    def _arm(self) -> None:
        """(Re)install the handlers and unblock the signals: a previous call may have
        changed either."""
        for signum in (signal.SIGUSR1, signal.SIGXCPU):
            signal.signal(signum, self._on_signal)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGUSR1, signal.SIGXCPU])

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.active:  # a late signal after the call returned is ignored
            self.active = False
            raise _Interrupted("timeout" if signum == signal.SIGUSR1 else "cpu time limit")

    def _fire(self) -> None:
        if self.active:
            self.fired = True  # a call that then returns anyway has still timed out
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
            kill_descendants(os.getpid(), keep=self._before)

    def run(self, fn: Any, prompts: list, completions: list, kwargs: dict) -> dict:
        n = len(completions)  # before the call: a reward may mutate its lists (they are its own)
        raw, error = self.invoke(fn, (prompts, completions), kwargs)
        if error is not None:
            return error
        try:
            values, errors = validate(raw, n)
        except BadReturn as e:
            return {"t": "error", "kind": e.kind, "msg": message(e)}
        except BaseException as e:  # a returned object whose tolist() raises
            return {"t": "error", "kind": type(e).__name__, "msg": message(e)}
        return {"t": "result", "values": values, "errors": errors}

    def invoke(
        self, fn: Any, args: tuple, kwargs: dict, timeout_s: float | None = None
    ) -> tuple[Any, dict | None]:
        """fn(*args, **kwargs) under the limits (`timeout_s`, default the worker's): (its
        return, None), or (None, an error reply {"t": "error", "kind", "msg"})."""
        self._arm()
        self.limit_s = self.timeout_s if timeout_s is None else timeout_s
        self._before = frozenset(descendants(os.getpid()) if has_children() else ())
        modules = len(sys.modules)  # new modules are appended: sys.modules is ordered
        self.interrupted_import = self.fired = False
        self._set_cpu_limit()
        self.active = True
        self._watchdog.arm(self.limit_s)
        try:
            raw = fn(*args, **kwargs)
            if self.fired:
                raise _Interrupted("timeout")
            return raw, None
        except _Interrupted as e:
            return None, self._interrupted(e.kind, _importing(e) + list(sys.modules)[modules:])
        except BaseException as e:  # the user's exception, SystemExit and KeyboardInterrupt too
            return None, {"t": "error", "kind": type(e).__name__, "msg": message(e)}
        finally:
            self.active = False
            self._watchdog.disarm()
            self._set_cpu_limit(off=True)
            if has_children():
                _reap_zombies(self._before)

    def _interrupted(self, kind: str, modules: list[str]) -> dict:
        """`modules`: those being imported when the call was stopped, then those it added."""
        kill_descendants(os.getpid(), keep=self._before)
        limit = self.limit_s if kind == "timeout" else self.cpu_time_limit_s
        msg = f"{'timed out' if kind == 'timeout' else 'used its CPU time'} after {limit:g} s"
        if modules:
            self.interrupted_import = True
            roots = list(dict.fromkeys(m.partition(".")[0] for m in modules))
            msg += (
                f" while importing {', '.join(roots[:3])}; import heavy modules at the top "
                "of the reward file, where start-up time does not count"
            )
        return {"t": "error", "kind": kind, "msg": msg}

    def _set_cpu_limit(self, off: bool = False) -> None:
        if not self.cpu_time_limit_s:
            return
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        if off:
            soft = hard
        else:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            soft = int(usage.ru_utime + usage.ru_stime + self.cpu_time_limit_s + 0.999)
            if hard != resource.RLIM_INFINITY:
                soft = min(soft, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _importing(exc: BaseException) -> list[str]:
    """The modules whose top-level code was running where `exc` was raised, i.e. being
    imported (a failed import removes its own module from sys.modules, but what it
    half-imported stays; importlib's own frames are cut from the traceback)."""
    names = []
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "<module>":
            names.append(str(tb.tb_frame.f_globals.get("__name__")))
        tb = tb.tb_next
    return names


class BadReturn(ValueError):
    """A reward returned something other than one value per sample: `kind` is "wrong
    length" (a list of another length: never retried, rewards/pool.py) or "bad return"."""

    def __init__(self, msg: str, kind: str = "bad return"):
        super().__init__(msg)
        self.kind = kind


def validate(raw: Any, n: int) -> tuple[list[float | None], list[list]]:
    """Per-sample values and errors ([position, kind, message]) from a reward's return.

    Accepted: a list or tuple of length n, or anything whose tolist() gives one (numpy
    arrays, tensors). Each item: None, or a real number float() accepts (int, float, bool,
    numpy scalars, 0-d arrays and tensors), finite. An unusable item is that sample's
    failure; a return of the wrong kind or length fails the whole call (BadReturn).
    """
    items = raw
    if not isinstance(raw, (list, tuple)) and callable(getattr(raw, "tolist", None)):
        items = raw.tolist()
    if not isinstance(items, (list, tuple)):
        raise BadReturn(f"returned a {type(raw).__name__} for {n} samples; return a list of {n}")
    if len(items) != n:
        raise BadReturn(
            f"returned {len(items)} values for {n} samples; return a list of {n}", "wrong length"
        )
    values: list[float | None] = []
    errors: list[list] = []
    for j, item in enumerate(items):
        try:
            values.append(_number(item))
        except Exception as e:
            values.append(None)
            errors.append([j, "bad value", one_line(str(e))])
    return values, errors


def _number(item: Any) -> float | None:
    if item is None:
        return None
    if not isinstance(item, numbers.Real) and getattr(item, "shape", None) != ():
        raise ValueError(
            f"returned {one_line(repr(item), 60)} ({type(item).__name__}); "
            "return a float or None per sample"
        )
    try:
        value = float(item)
    except OverflowError:
        raise ValueError("returned an integer too large for a float") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"returned {value}; rewards must be finite (or None)")
    return value


def exit_with_parent() -> None:
    """If the trainer dies (it cannot close the pool), kill this worker's tree and exit."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                kill_descendants(os.getpid())
                with contextlib.suppress(OSError):
                    os.killpg(0, signal.SIGKILL)
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
