"""The first code a worker process runs: confine it, then split it into the supervisor and
the zygote (box.py has the picture).

The trainer starts `python -c LAUNCH_CODE <channel fd> <spec JSON>` (process.py); then,
before any user code:

1. SIGINT is ignored (the trainer decides when workers stop) and the worker joins its
   cgroups (cgroups.py; a root trainer's);
2. namespace level: the namespaces are entered, the launched process staying behind to
   wait (confine.py `enter_namespace`);
3. the worker is confined (confine.py `confine`), becomes a child subreaper, loads the
   WORKER system-call filter (seccomp.py) and reads the start-up message;
4. it forks the **zygote** (zygote.py), which closes the channel, imports the user's code
   (`prepare` of the module `init["entry"]` names) and forks the boxes; the process that
   stays is the **supervisor**: it drops its capabilities and runs the entry's
   `supervise(channel, init, boxes)`, talking to the trainer and to boxes, never running
   user code. It exits, and the worker's tree with it, when the trainer's end of the
   channel closes.

A set-up failure is sent as one init_error line ("the sandbox could not be set up: ..."),
exit code SETUP_FAILED; a zygote that exits during its set-up (user code calling exit at
import) ends the worker with the zygote's exit code.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pickle
import signal
import socket
import sys
import traceback

from leangrpo.sandbox.box import Boxes, WorkerBroken
from leangrpo.sandbox.cgroups import join
from leangrpo.sandbox.confine import SetupError, confine, drop_privileges, enter_namespace
from leangrpo.sandbox.frames import Channel
from leangrpo.sandbox.proctree import become_subreaper, kill_descendants
from leangrpo.sandbox.seccomp import FilterError, compile_filter, load

LAUNCH_CODE = "from leangrpo.sandbox.launch import main; main()"
SETUP_FAILED = 75  # exit code of a worker whose sandbox could not be set up


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fd, spec = int(sys.argv[1]), json.loads(sys.argv[2])
    code = 0
    channel = None
    zygote = None
    try:
        _enter(spec, fd)
        channel = Channel(fd)
        group_fds = _set_up(spec)
        init = pickle.loads(channel.recv())
        zygote, control = _fork_zygote(channel, init, spec, group_fds)
        if spec["level"] == "namespace":
            drop_privileges()  # the supervisor makes nothing: the zygote does
        boxes = Boxes(control, channel.sock.fileno(), max_output=int(spec["max_output_bytes"]))
        importlib.import_module(init["entry"]).supervise(channel, init, boxes)
    except SetupError as e:
        code = SETUP_FAILED
        with contextlib.suppress(OSError, ValueError):
            channel = channel or Channel(fd)
            msg = f"the sandbox ({spec['level']}) could not be set up: {e}"
            channel.send({"t": "init_error", "fn": 0, "msg": msg})
    except WorkerBroken:  # the zygote exited: during set-up, user code ended it
        code = _exit_code(zygote)
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the pool closed (the
        code = 3  # trainer's end of the channel)
    except OSError as e:  # no descriptor, memory, ...: the log says which, in one line
        print(f"the worker's supervisor failed: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    except Exception:  # a bug of the worker's own code: its traceback reaches the log
        traceback.print_exc()
        code = 1
    kill_descendants(os.getpid())  # the zygote and every box (the namespace's end would too)
    os._exit(code)


def _enter(spec: dict, channel_fd: int) -> None:
    for group in spec.get("cgroups") or ():
        leaf = os.path.join(group["path"], "worker") if group["version"] == 2 else group["path"]
        try:
            join(leaf)
        except OSError as e:
            raise SetupError(f"joining cgroup {leaf}: {e.strerror}") from None
    if spec["level"] == "namespace":
        enter_namespace(spec, channel_fd)


def _set_up(spec: dict) -> list[int]:
    group_fds = confine(spec)
    become_subreaper()
    try:
        load(compile_filter(box=False))
    except (FilterError, OSError) as e:
        raise SetupError(f"the system-call filter: {e}") from None
    return group_fds


def _fork_zygote(channel: Channel, init: dict, spec: dict, group_fds: list[int]):
    control, zygote_end = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            channel.sock.close()
            control.close()
            from leangrpo.sandbox.zygote import serve

            serve(zygote_end, init, spec, group_fds)
        except (EOFError, OSError):
            code = 3
        except BaseException:
            traceback.print_exc()
            code = 1
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    zygote_end.close()
    for fd in group_fds:
        os.close(fd)
    return pid, control


def _exit_code(zygote: int | None) -> int:
    if zygote is None:
        return 1
    try:
        _, status = os.waitpid(zygote, 0)
    except ChildProcessError:
        return 1
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code
