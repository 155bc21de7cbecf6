"""The first code a worker process runs: confine it, then hand over to the worker's code.

The trainer starts `python -c LAUNCH_CODE <channel fd> <spec JSON>` (process.py); this
module then, before any user code:

1. ignores SIGINT (the trainer decides when workers stop) and joins its pids cgroup;
2. namespace level: enters the namespaces, the parent staying behind to wait
   (confine.py `enter_namespace`);
3. confines itself (confine.py), becomes a child subreaper (proctree.py), routes its
   output through the meter (output.py), exits with its whole tree when the trainer's end
   of the channel closes (the trainer died), and applies the process limit;
4. reads the start-up message and calls `serve(channel, init, sandbox)` of the module it
   names (`init["entry"]`: rewards/worker.py or environments/worker.py).

A set-up failure is sent as one init_error line ("the sandbox could not be set up: ...").
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pickle
import select
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from leangrpo.sandbox.calls import LimitedCall
from leangrpo.sandbox.cgroups import join
from leangrpo.sandbox.confine import SetupError, confine, enter_namespace, limit_tasks
from leangrpo.sandbox.frames import Channel
from leangrpo.sandbox.output import OutputMeter
from leangrpo.sandbox.proctree import become_subreaper, kill_descendants

LAUNCH_CODE = "from leangrpo.sandbox.launch import main; main()"
SETUP_FAILED = 75  # exit code of a worker whose sandbox could not be set up


@dataclass
class Sandbox:
    """What the set-up leaves the worker's code: its limits and output meter."""

    spec: dict
    meter: OutputMeter

    def limited_call(self, timeout_s: float, cpu_time_limit_s: float | None) -> LimitedCall:
        return LimitedCall(timeout_s, cpu_time_limit_s, self.spec, self.meter)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fd, spec = int(sys.argv[1]), json.loads(sys.argv[2])
    code = 0
    channel = None
    try:
        _enter(spec, fd)
        channel = Channel(fd)
        sandbox = _set_up(spec, channel)
        init = pickle.loads(channel.recv())
        importlib.import_module(init["entry"]).serve(channel, init, sandbox)
    except SetupError as e:
        code = SETUP_FAILED
        with contextlib.suppress(OSError, ValueError):
            channel = channel or Channel(fd)
            msg = f"the sandbox ({spec['level']}) could not be set up: {e}"
            channel.send({"t": "init_error", "fn": 0, "msg": msg})
    except (EOFError, OSError):  # the pool closed, or user code broke the channel
        code = 3
    except Exception:  # a bug of the worker's own code: its traceback reaches the log
        traceback.print_exc()
        code = 1
    kill_descendants(os.getpid())  # what its calls kept (the namespace's end would too)
    os._exit(code)  # no atexit handlers or non-daemon threads of user code to wait for


def _enter(spec: dict, channel_fd: int) -> None:
    if spec.get("cgroup"):
        try:
            join(spec["cgroup"])
        except OSError as e:
            raise SetupError(f"joining cgroup {spec['cgroup']}: {e.strerror}") from None
    if spec["level"] == "namespace":
        enter_namespace(spec, channel_fd)


def _set_up(spec: dict, channel: Channel) -> Sandbox:
    confine(spec)
    become_subreaper()
    meter = OutputMeter(int(spec["max_output_bytes"]))
    _exit_with_trainer(channel)
    limit_tasks(spec)
    return Sandbox(spec, meter)


def _exit_with_trainer(channel: Channel) -> None:
    """When the trainer's end of the channel closes (it died without closing the pool),
    kill this worker's tree and exit. A closed channel descriptor (user code) ends it too."""
    if not hasattr(select, "POLLRDHUP"):  # not Linux: watch the parent instead
        _watch_parent()
        return
    poller = select.poll()
    poller.register(channel.sock.fileno(), select.POLLRDHUP)

    def watch() -> None:
        while True:
            with contextlib.suppress(InterruptedError):
                if poller.poll():
                    break
        kill_descendants(os.getpid())
        os._exit(1)

    threading.Thread(target=watch, name="trainer-watch", daemon=True).start()


def _watch_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        kill_descendants(os.getpid())
        os._exit(1)

    threading.Thread(target=watch, name="trainer-watch", daemon=True).start()
