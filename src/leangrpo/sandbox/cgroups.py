"""Memory and pids cgroups: a worker's group (trainer side) and a group per box (worker side).

RLIMIT_AS bounds one process's address space, not what a call holds (a memfd filled with
write(), tmpfs pages, several processes), and RLIMIT_NPROC never applies to a root user;
so where this (root) trainer can make cgroups, every box (one reward call, one trajectory)
gets its own memory cgroup (`memory_limit_mb`, tmpfs and shared memory counted, no swap)
and pids cgroup (`max_processes`):

- the trainer makes a worker's group `leangrpo-<its pid>-<n>` per hierarchy (`make_group`):
  cgroup v1, the memory and pids hierarchies, each under the trainer's own group there, so
  the limits the trainer runs under still apply; cgroup v2, the unified hierarchy's root
  where it delegates memory and pids (the worker's own processes in a `worker` leaf, as
  v2 keeps processes out of groups with children). The launched worker joins it first.
- the worker's zygote makes `box-<k>` in each for every box it forks (`BoxGroups`), through
  directory descriptors it opened while it could (a namespace worker sees /sys read-only:
  confine.py clones the groups writable before the view is made read-only), and opens
  their cgroup.procs files; the box joins them through those before anything else runs,
  and the zygote removes them once it has reaped the box, reading the OOM-kill counter
  first (a box killed at its limit fails as "memory limit").
- A limit of memory, not of RAM: swap is counted (v1 memory.memsw.limit_in_bytes, v2
  memory.swap.max 0); a v1 kernel without swap accounting keeps a box's pages out of swap
  (memory.swappiness 0), or the kernel's swap would hold what the limit refuses.
- Groups left by a trainer that died (its pid no longer running) are removed the next
  time one is made. Where no hierarchy is writable (not root, a read-only /sys/fs/cgroup)
  there is none, and the log line says that memory is bounded per process only.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path

from leangrpo.sandbox.proctree import process_exists

MOUNT = Path("/sys/fs/cgroup")
PREFIX = "leangrpo-"
WORKER_LEAF = "worker"  # v2: the worker's own processes (no process in a group with children)
CONTROLLERS = ("memory", "pids")
_counter = itertools.count()
_found: list[dict[str, tuple[Path, int]]] = []  # controller -> (base, version), once per process


def hierarchies() -> dict[str, tuple[Path, int]]:
    """Where this (root) process can make groups, per controller: (base directory, cgroup
    version); empty where it cannot."""
    if not _found:
        found = _find() if os.geteuid() == 0 else {}
        _found.append(found)
        for base, _ in set(found.values()):
            _remove_stale(base)
    return _found[0]


def _find() -> dict[str, tuple[Path, int]]:
    found: dict[str, tuple[Path, int]] = {}
    for controller in CONTROLLERS:
        v1 = MOUNT / controller
        if (v1 / "cgroup.procs").is_file():
            base = v1 / _own_group(controller).lstrip("/")
            if _writable(base, controller, 1):
                found[controller] = (base, 1)
    for root in (MOUNT, MOUNT / "unified"):
        if not (root / "cgroup.subtree_control").is_file():
            continue
        delegated = (root / "cgroup.subtree_control").read_text().split()
        for controller in CONTROLLERS:
            if (
                controller not in found
                and controller in delegated
                and _writable(root, controller, 2)
            ):
                found[controller] = (root, 2)
    return found


def _own_group(controller: str) -> str:
    """This process's group in a v1 hierarchy ("/" if unknown)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, names, path = line.split(":", 2)
            if controller in names.split(","):
                return path
    return "/"


def _writable(base: Path, controller: str, version: int) -> bool:
    probe = base / f"{PREFIX}probe-{os.getpid()}"
    try:
        probe.mkdir()
        ok = (
            probe / f"{controller}.max" if version == 2 else probe / _limit_file(controller, 1)
        ).is_file()
        probe.rmdir()
        return ok
    except OSError:
        return False


def _limit_file(controller: str, version: int) -> str:
    if controller == "pids":
        return "pids.max"
    return "memory.max" if version == 2 else "memory.limit_in_bytes"


@dataclass(frozen=True)
class WorkerGroup:
    """One worker's group in one hierarchy: where boxes are made and where it joins."""

    path: str
    version: int
    controllers: tuple[str, ...]

    @property
    def join_path(self) -> str:
        return os.path.join(self.path, WORKER_LEAF) if self.version == 2 else self.path

    def as_dict(self) -> dict:
        return {"path": self.path, "version": self.version, "controllers": list(self.controllers)}


def make_group() -> list[WorkerGroup]:
    """A fresh worker group in every hierarchy found (none without one)."""
    by_base: dict[tuple[Path, int], list[str]] = {}
    for controller, (base, version) in hierarchies().items():
        by_base.setdefault((base, version), []).append(controller)
    groups = []
    n = next(_counter)
    for (base, version), controllers in by_base.items():
        path = base / f"{PREFIX}{os.getpid()}-{n}"
        try:
            path.mkdir()
            if version == 2:
                enable = " ".join(f"+{c}" for c in controllers)
                (path / "cgroup.subtree_control").write_text(enable)
                (path / WORKER_LEAF).mkdir()
        except OSError:
            remove_groups([WorkerGroup(str(path), version, tuple(controllers))])
            continue
        groups.append(WorkerGroup(str(path), version, tuple(controllers)))
    return groups


def join(group: str) -> None:
    """Move the calling process into `group` (worker side, before it starts anything)."""
    with open(os.path.join(group, "cgroup.procs"), "w") as f:
        f.write("0")


def remove_groups(groups: list[WorkerGroup], wait_s: float = 2.0) -> None:
    """Remove worker groups once their last task is released (boxes first, then the group)."""
    for group in groups:
        with contextlib.suppress(OSError):
            for child in Path(group.path).iterdir():
                if child.is_dir():
                    _rmdir(str(child), wait_s)
        _rmdir(group.path, wait_s)


def _rmdir(path: str, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return  # left for the next trainer's clean-up
            time.sleep(0.01)


def _remove_stale(base: Path) -> None:
    for group in base.glob(f"{PREFIX}*-*"):
        owner = group.name[len(PREFIX) :].partition("-")[0]
        if owner.isdigit() and int(owner) != os.getpid() and not process_exists(int(owner)):
            version = 2 if (group / "cgroup.subtree_control").exists() else 1
            remove_groups([WorkerGroup(str(group), version, ())], wait_s=0.0)


# -- worker side: a group per box ------------------------------------------------------------


class BoxGroups:
    """The zygote's: a memory and pids group per box under the worker's groups, reached
    through directory descriptors `fds` (one per worker group, in `groups` order)."""

    def __init__(self, groups: list[dict], fds: list[int], memory_mb: int | None, pids: int):
        self.groups = groups
        self.fds = fds
        self.limits = {"memory": None if memory_mb is None else int(memory_mb) << 20, "pids": pids}
        self._count = itertools.count()

    @property
    def controllers(self) -> set[str]:
        return {c for g in self.groups for c in g["controllers"]}

    def make(self) -> str:
        """A fresh box group, limits set; its name."""
        name = f"box-{next(self._count)}"
        for group, fd in zip(self.groups, self.fds):
            os.mkdir(name, dir_fd=fd)
            for controller in group["controllers"]:
                self._limit(fd, name, controller, group["version"])
        return name

    def _limit(self, fd: int, name: str, controller: str, version: int) -> None:
        value = self.limits[controller]
        if value is None:
            return
        _write_at(fd, f"{name}/{_limit_file(controller, version)}", str(value))
        if controller == "memory" and version == 2:
            _write_at(fd, f"{name}/memory.oom.group", "1")  # the whole box, not one process
            with contextlib.suppress(OSError):  # no swap: a limit of memory, not of RAM
                _write_at(fd, f"{name}/memory.swap.max", "0")
        elif controller == "memory":
            try:
                _write_at(fd, f"{name}/memory.memsw.limit_in_bytes", str(value))
            except OSError:  # no swap accounting (swapaccount=0): keep its pages out of swap
                with contextlib.suppress(OSError):
                    _write_at(fd, f"{name}/memory.swappiness", "0")

    def procs(self, name: str) -> list[int]:
        """Box `name`'s cgroup.procs files, opened (by the zygote, before the fork) for the
        box to join with a bare write each (`join_by`): a box pays for every page its own
        code writes, and this is the whole of its part."""
        flags = os.O_WRONLY | os.O_CLOEXEC
        return [os.open(f"{name}/cgroup.procs", flags, dir_fd=fd) for fd in self.fds]

    def oom_killed(self, name: str) -> bool:
        """Whether the kernel killed a process of box `name` at its memory limit."""
        for group, fd in zip(self.groups, self.fds):
            if "memory" not in group["controllers"]:
                continue
            events = "memory.events" if group["version"] == 2 else "memory.oom_control"
            with contextlib.suppress(OSError, ValueError):
                for line in _read_at(fd, f"{name}/{events}").splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and int(value) > 0:
                        return True
        return False

    def remove(self, name: str) -> bool:
        """Remove box `name` (False while a task of it is still being released)."""
        done = True
        for fd in self.fds:
            try:
                os.rmdir(name, dir_fd=fd)
            except FileNotFoundError:
                pass
            except OSError:
                done = False
        return done


def join_by(procs: list[int]) -> None:
    """Move the calling process (a new box, before anything runs) into its groups, through
    the cgroup.procs descriptors `BoxGroups.procs` opened."""
    for fd in procs:
        os.write(fd, b"0")


def _write_at(fd: int, path: str, text: str) -> None:
    handle = os.open(path, os.O_WRONLY, dir_fd=fd)
    try:
        os.write(handle, text.encode())
    finally:
        os.close(handle)


def _read_at(fd: int, path: str) -> str:
    handle = os.open(path, os.O_RDONLY, dir_fd=fd)
    try:
        return os.read(handle, 1 << 16).decode()
    finally:
        os.close(handle)
