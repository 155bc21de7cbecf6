"""A pids cgroup per worker: the process limit of a root trainer's sandboxes.

RLIMIT_NPROC never applies to a process whose real user is root, in a user namespace
mapped to root too, so a root trainer bounds each worker's processes and threads with the
cgroup pids controller instead: the trainer makes `leangrpo-<its pid>-<n>` (pids.max =
the worker's limit) in the first writable pids hierarchy (cgroup v2 at /sys/fs/cgroup, or
v1 at /sys/fs/cgroup/pids), the launched worker joins it before it starts anything, and
the trainer removes it once the worker's tree is gone. Groups left by a trainer that
died (its pid no longer running) are removed the next time one is made. Where no pids
hierarchy is writable (a container with a read-only /sys/fs/cgroup) there is none, and
the log line says the process count is not limited.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from pathlib import Path

from leangrpo.sandbox.proctree import process_exists

V2, V1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/pids")
PREFIX = "leangrpo-"
_counter = itertools.count()
_root: list[Path | None] = []  # the hierarchy found, once per process


def pids_hierarchy() -> Path | None:
    """Where this (root) process can make pids cgroups; None if nowhere."""
    if not _root:
        _root.append(_find_hierarchy() if os.geteuid() == 0 else None)
        if _root[0] is not None:
            _remove_stale(_root[0])
    return _root[0]


def _find_hierarchy() -> Path | None:
    subtree = V2 / "cgroup.subtree_control"  # v2: where pids is enabled for child groups
    if subtree.is_file() and "pids" in subtree.read_text().split() and _writable(V2):
        return V2
    if (V1 / "cgroup.procs").is_file() and _writable(V1):
        return V1
    return None


def _writable(root: Path) -> bool:
    probe = root / f"{PREFIX}probe-{os.getpid()}"
    try:
        probe.mkdir()
        ok = (probe / "pids.max").is_file()
        probe.rmdir()
        return ok
    except OSError:
        return False


def make_group(limit: int) -> str | None:
    """A fresh pids cgroup allowing `limit` tasks; its path, or None without a hierarchy."""
    root = pids_hierarchy()
    if root is None:
        return None
    group = root / f"{PREFIX}{os.getpid()}-{next(_counter)}"
    try:
        group.mkdir()
        (group / "pids.max").write_text(str(limit))
    except OSError:
        remove_group(str(group))
        return None
    return str(group)


def join(group: str) -> None:
    """Move the calling process into `group` (worker side, before it starts anything)."""
    with open(os.path.join(group, "cgroup.procs"), "w") as f:
        f.write("0")


def remove_group(group: str | None, wait_s: float = 2.0) -> None:
    """Remove a group once its last task is released (the killed tree is reaped by then,
    or soon after: the kernel releases exiting tasks asynchronously)."""
    if group is None:
        return
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.rmdir(group)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return  # left for the next trainer's clean-up
            time.sleep(0.01)


def _remove_stale(root: Path) -> None:
    for group in root.glob(f"{PREFIX}*-*"):
        owner = group.name[len(PREFIX) :].partition("-")[0]
        if owner.isdigit() and int(owner) != os.getpid() and not process_exists(int(owner)):
            with contextlib.suppress(OSError):
                group.rmdir()

