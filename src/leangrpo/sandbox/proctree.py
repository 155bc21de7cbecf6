"""Finding and killing every process a worker started.

Each worker is a session and process-group leader (`start_new_session`), so one killpg
reaches what its user code starts with `os.system` or `Popen`. A process that leaves the
group (a daemon that double-forks and calls `setsid`) is still found on Linux: the worker
is a *child subreaper* (`PR_SET_CHILD_SUBREAPER`; in a namespace sandbox it is the PID
namespace's init anyway), so orphans are re-parented to it instead of init, and
`descendants` walks /proc/<pid>/task/<tid>/children. Elsewhere only the group is reached.

`kill_tree` stops the worker first (SIGSTOP: it can neither fork nor reap while the tree is
walked; a stopped subreaper still adopts orphans), SIGKILLs its live descendants until none
is left, then kills the group with the worker in it. The caller reaps the worker afterwards:
until then its pid, and so its process-group id, cannot be reused.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import sys
import time

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make orphaned descendants of this process its children (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return _libc().prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def has_children() -> bool:
    """Whether this process has any child (zombies included): one syscall, no /proc. For a
    subreaper, no child means no descendant at all."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        return True
    except ChildProcessError:
        return False


def children(pid: int) -> list[int]:
    """Direct children of `pid`, zombies included ([] where /proc cannot tell)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    kids: list[int] = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids.extend(int(p) for p in f.read().split())
        except (OSError, ValueError):
            continue
    return kids


def descendants(pid: int) -> list[int]:
    """Every descendant of `pid`, parents before their children."""
    found: dict[int, None] = {}  # ordered set
    stack = [pid]
    while stack:
        for child in children(stack.pop()):
            if child not in found and child != pid:
                found[child] = None
                stack.append(child)
    return list(found)


def process_exists(pid: int) -> bool:
    """A process with this pid exists (one of another user's included; zombies too)."""
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def is_live(pid: int) -> bool:
    """True unless `pid` is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def kill_descendants(pid: int, keep: frozenset[int] = frozenset(), rounds: int = 50) -> None:
    """SIGKILL the live descendants of `pid` (except `keep`) until none is left."""
    for _ in range(rounds):
        live = [p for p in descendants(pid) if p not in keep and is_live(p)]
        if not live:
            return
        kill_pids(live)
        time.sleep(0.002)


def kill_tree(pid: int) -> None:
    """Kill worker `pid` (a process-group leader), its group and all its descendants."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGSTOP)
    kill_descendants(pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)
