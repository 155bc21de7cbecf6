"""Confining a worker before any user code runs (worker side; stdlib and ctypes only).

`spec` is the trainer's description of the sandbox (levels.py `WorkerSpec.as_dict`).

namespace (Linux >= 5.14, unprivileged user namespaces or root):
- `enter_namespace`: the launched process unshares a user namespace (its own uid mapped to
  0 inside) with new mount, PID, IPC and, unless `network`, network namespaces, then forks:
  the child is the worker, init of the new PID namespace (when it dies the kernel kills
  every process in it; the trainer cannot be seen or signalled from inside). The parent
  only waits for it and exits with its code.
- `confine`, in the child: every mount made read-only and nosuid (recursively,
  mount_setattr), a fresh read-only /proc of the new PID namespace, a minimal /dev (null,
  zero, full, random, urandom, fd links, a private /dev/shm), an empty /run (no daemon
  sockets: docker's, D-Bus's), and one writable directory, the scratch (a tmpfs of
  `scratch_mb`, mounted over an empty directory the trainer made; HOME and TMPDIR point
  there, while the working directory stays the trainer's, read-only, so relative paths in
  settings and sys.path still resolve); the loopback interface up (its own, without
  network).
- Then privileges go: every capability (the bounding set too), no_new_privs; mounts can
  no longer be undone.
- Without `network`, a seccomp filter refuses socket(AF_UNIX) (EACCES; socketpair still
  works): a pathname unix socket is reached through the filesystem, not the network
  namespace, and a read-only mount does not stop connect(), so a daemon listening
  anywhere the worker can see (tmux under /tmp, vLLM's ZMQ ipc sockets) would be in
  reach. It also refuses io_uring (which can open sockets past the filter) and system
  calls of another architecture's table (i386, x32), which the filter does not check.

process (anywhere): no namespaces; the scratch is a plain directory, a box's a directory
in it that only the box's Landlock domain reaches (`domain_ruleset`, `filesystem_grants`);
no_new_privs, and a root worker drops every capability (so it cannot ptrace, or read the
memory of, the non-dumpable trainer: levels.py `protect_trainer`).

Both levels: the worker is non-dumpable (PR_SET_DUMPABLE 0, before user code: another
worker's code, at the `process` level as the same user, could otherwise ptrace it or
rewrite its memory through /proc/<pid>/mem: a tool forging a reward worker's scores); no
core files (RLIMIT_CORE 0: a core pattern may run a host program),
RLIMIT_AS at `memory_limit_mb`, and the process limit: a cgroup's pids.max, joined before
anything else (root; cgroups.py), or RLIMIT_NPROC, which inside a user namespace counts
the sandbox's own processes and threads only (a non-root trainer). Any failure is a
`SetupError` naming the step.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import resource
import signal
import socket
import stat
import struct
import sys

_libc = ctypes.CDLL(None, use_errno=True)

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = (
    0x00020000,
    0x08000000,
    0x10000000,
    0x20000000,
    0x40000000,
)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
OPEN_TREE_CLONE, OPEN_TREE_CLOEXEC, MOVE_MOUNT_F_EMPTY_PATH = 1, 0o2000000, 4
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442  # one table on x86-64 and arm64
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
MS_REC, MS_PRIVATE = 0x4000, 0x40000
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
LANDLOCK_ACCESS_FS_EXECUTE, LANDLOCK_ACCESS_FS_WRITE_FILE, LANDLOCK_ACCESS_FS_READ_FILE = 1, 2, 4
LANDLOCK_ACCESS_FS_READ_DIR, LANDLOCK_ACCESS_FS_REFER, LANDLOCK_ACCESS_FS_TRUNCATE = 8, 1 << 13, 1 << 14
READ_RIGHTS = LANDLOCK_ACCESS_FS_READ_FILE | LANDLOCK_ACCESS_FS_READ_DIR
FILE_RIGHTS = (LANDLOCK_ACCESS_FS_EXECUTE | LANDLOCK_ACCESS_FS_WRITE_FILE
               | LANDLOCK_ACCESS_FS_READ_FILE | LANDLOCK_ACCESS_FS_TRUNCATE)  # fmt: skip
READ_ONLY_ROOTS = ("proc", "sys")  # at `process`: a box's own cgroup files, sysctls
SCRATCH_PREFIX = "leangrpo-sandbox-"  # every worker's scratch directory (process.py)
LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET, LANDLOCK_SCOPE_SIGNAL = 1, 2
DEVICES = ("null", "zero", "full", "random", "urandom")
LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
         "stderr": "/proc/self/fd/2"}  # fmt: skip
BOX_TASKS = 4  # a box's own threads (output meter, watchdog) and its forwarder


class SetupError(Exception):
    """The sandbox could not be set up (one line naming the step)."""


class _MountAttr(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("attr_set", "attr_clr", "propagation", "userns_fd")]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("effective", "permitted", "inheritable")]


# capset's arguments, every set empty (made once: a box pays for each page it writes)
_NO_CAPS = (_CapHeader(0x20080522, 0), (_CapData * 2)())


def _check(result: int, step: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise SetupError(f"{step}: {os.strerror(code)}")
    return result


def _prctl(option: int, arg: int, step: str) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), step)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    enc = [None if s is None else s.encode() for s in (source, target, fstype)]
    result = _libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), data.encode() or None)
    _check(result, f"mount {fstype or 'bind'} on {target}")


# -- the namespaces (the launched process) -------------------------------------------------


def enter_namespace(spec: dict, channel_fd: int) -> None:
    """Unshare the namespaces and fork the worker; returns in the worker only (the parent
    waits for it and exits with its code). The parent keeps no copy of the channel."""
    uid, gid = os.geteuid(), os.getegid()
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC
    if not spec["network"]:
        flags |= CLONE_NEWNET
    _check(_libc.unshare(flags), "unshare (user namespaces may be disabled here)")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"0 {uid} 1")
    _write("/proc/self/gid_map", f"0 {gid} 1")
    try:
        child = os.fork()
    except OSError as e:
        raise SetupError(f"fork: {e.strerror}") from None
    if child == 0:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl PDEATHSIG")
        return
    os.close(channel_fd)
    os._exit(_wait_for(child))


def _wait_for(child: int) -> int:
    while True:
        try:
            _, status = os.waitpid(child, 0)
        except InterruptedError:
            continue
        code = os.waitstatus_to_exitcode(status)
        return code if code >= 0 else 128 - code


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise SetupError(f"writing {path}: {e.strerror}") from None


# -- the worker's view of the filesystem (namespace) ---------------------------------------


def confine(spec: dict) -> list[int]:
    """Everything after the namespaces, in the worker (the supervisor, before it forks the
    zygote); see the module docstring. Returns directory descriptors of the worker's
    cgroups, writable for the zygote to make a group per box."""
    try:
        return _confine(spec)
    except OSError as e:
        raise SetupError(str(e)) from None


def _confine(spec: dict) -> list[int]:
    groups = [g["path"] for g in spec.get("cgroups") or ()]
    if spec["level"] == "namespace":
        fds = [_open_tree(path) for path in groups]  # before / is read-only: detached, writable
        _mount_view(spec)
        if not spec["network"]:
            _loopback_up()
    else:
        fds = [os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) for path in groups]
    _set_limits(spec)
    _prctl(PR_SET_NO_NEW_PRIVS, 1, "prctl NO_NEW_PRIVS")
    if spec["level"] == "process":
        _drop_privileges()  # the namespace level's zygote needs them in its user namespace
    return fds


def _mount_view(spec: dict) -> None:
    devices = {n: _open_tree(f"/dev/{n}") for n in DEVICES if os.path.exists(f"/dev/{n}")}
    carried = _carried_files(spec)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # a box's mounts never propagate back
    attr = _MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    args = (AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr))
    _check(_libc.syscall(SYS_MOUNT_SETATTR, *args), "mount_setattr (Linux >= 5.12)")
    _mount("proc", "/proc", "proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _populate_dev(devices, spec["scratch_mb"])
    if os.path.isdir("/run"):
        _populate("/run", carried, "mode=755,size=1m")
    size = f"size={spec['scratch_mb']}m"
    _mount("tmpfs", spec["scratch"], "tmpfs", MS_NOSUID | MS_NODEV, f"mode=700,{size}")


def _open_tree(path: str) -> int:
    flags = OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC
    return _check(_libc.syscall(SYS_OPEN_TREE, AT_FDCWD, path.encode(), flags), f"open_tree {path}")


def _attach(tree: int, path: str) -> None:
    with open(path, "w"):
        pass
    args = (tree, b"", AT_FDCWD, path.encode(), MOVE_MOUNT_F_EMPTY_PATH)
    _check(_libc.syscall(SYS_MOVE_MOUNT, *args), f"move_mount {path}")
    os.close(tree)


def _populate_dev(devices: dict[str, int], shm_mb: int) -> None:
    flags = MS_NOSUID | MS_NOEXEC
    _mount("tmpfs", "/dev", "tmpfs", flags, "mode=755,size=64k")
    for name, tree in devices.items():
        _attach(tree, f"/dev/{name}")
    for name, target in LINKS.items():
        os.symlink(target, f"/dev/{name}")
    os.mkdir("/dev/shm")
    _mount("tmpfs", "/dev", "tmpfs", flags | MS_REMOUNT | MS_RDONLY, "mode=755,size=64k")
    _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={shm_mb}m")


def _carried_files(spec: dict) -> dict[str, int]:
    """Files under /run the worker still needs: with network, the resolver configuration
    /etc/resolv.conf may point at (systemd-resolved)."""
    if not spec["network"]:
        return {}
    target = os.path.realpath("/etc/resolv.conf")
    if target.startswith("/run/") and os.path.isfile(target):
        return {target: _open_tree(target)}
    return {}


def _populate(root: str, carried: dict[str, int], options: str) -> None:
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, options)
    for path, tree in carried.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _attach(tree, path)
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_REMOUNT | MS_RDONLY
    _mount("tmpfs", root, "tmpfs", flags, options)


def _loopback_up() -> None:
    """`ip link set lo up` in the worker's own network namespace."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH22x", b"lo", 0)
        try:
            flags = struct.unpack("16sH22x", fcntl.ioctl(s, siocgifflags, request))[1]
            fcntl.ioctl(s, siocsifflags, struct.pack("16sH22x", b"lo", flags | iff_up))
        except OSError as e:
            raise SetupError(f"bringing up the loopback interface: {e.strerror}") from None


# -- limits and privileges (both levels) ---------------------------------------------------


def _set_limits(spec: dict) -> None:
    _prctl(PR_SET_DUMPABLE, 0, "prctl DUMPABLE")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if spec.get("memory_limit_mb"):
        limit = int(spec["memory_limit_mb"]) << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _drop_privileges() -> None:
    if not sys.platform.startswith("linux"):
        return
    _prctl(PR_SET_NO_NEW_PRIVS, 1, "prctl NO_NEW_PRIVS")
    with contextlib.suppress(SetupError):  # without CAP_SETPCAP there is nothing to drop
        _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, "prctl CAP_AMBIENT")
    drop_bounding_set()
    _check(_libc.capset(ctypes.byref(_NO_CAPS[0]), _NO_CAPS[1]), "capset")


_bounding_dropped: list[bool] = []  # once per process: its children inherit the empty set


def drop_bounding_set() -> None:
    """Empty the capability bounding set (what an exec could gain), once: the zygote does it
    before forking boxes, which keep its effective capabilities (its user namespace's, to
    make their own) but inherit the empty set, so each box skips the 41 prctl calls."""
    if _bounding_dropped:
        return
    for cap in range(_last_cap() + 1):
        if _libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0) < 0:
            if ctypes.get_errno() == errno.EINVAL:  # beyond what this kernel knows
                break
            if ctypes.get_errno() == errno.EPERM:  # no CAP_SETPCAP: no capability to lose
                break
    _bounding_dropped.append(True)


# -- a box (the zygote's child, before anything else runs in it) --------------------------


def new_pid_namespace() -> None:
    """The zygote's next child is PID 1 of a new PID namespace (undone by `back_to`)."""
    _check(_libc.unshare(CLONE_NEWPID), "unshare (a box's PID namespace)")


def back_to(pid_namespace_fd: int) -> None:
    """Children of the zygote are born in its own PID namespace again."""
    _check(_libc.setns(pid_namespace_fd, CLONE_NEWPID), "setns (the zygote's PID namespace)")


def confine_box(spec: dict, scratch: str, own_network: bool) -> None:
    """A box's namespaces and files (namespace level; the box is PID 1 of its own PID
    namespace already): its own mount and IPC namespaces (System V and POSIX IPC objects
    die with it) and, for a box that asks and a worker without network, its own network
    namespace (its loopback up: what a trajectory listens on, another cannot reach); a
    fresh read-only /proc showing its own processes only; a fresh tmpfs over the scratch
    directory (HOME and TMPDIR) and /dev/shm, `scratch_mb` each, counted in its memory
    cgroup and gone with its mount namespace."""
    if spec["level"] != "namespace":
        return
    try:
        flags = CLONE_NEWNS | CLONE_NEWIPC
        if own_network and not spec["network"]:
            flags |= CLONE_NEWNET
        _check(_libc.unshare(flags), "unshare (a box's namespaces)")
        _mount("proc", "/proc", "proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
        size = f"size={spec['scratch_mb']}m"
        _mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=700,{size}")
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,{size}")
        if flags & CLONE_NEWNET:
            _loopback_up()
    except OSError as e:
        raise SetupError(str(e)) from None


def limit_box_tasks(spec: dict, tasks: int) -> None:
    """RLIMIT_NPROC where it counts only the worker's own tasks (the user namespace of a
    non-root trainer): the `tasks` running there now plus `max_processes` and the box's
    own few. (A root trainer's box has a pids cgroup instead: cgroups.py.)"""
    if spec.get("nproc_limit"):
        limit = tasks + BOX_TASKS + int(spec["max_processes"])
        resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))


def drop_privileges() -> None:
    """Every capability (the bounding set too) and no_new_privs: a box's last step before
    its system-call filter."""
    try:
        _drop_privileges()
    except OSError as e:
        raise SetupError(str(e)) from None


def drop_box_privileges() -> None:
    """A box's last step before its system-call filter: every capability it has (its user
    namespace's, from the zygote) goes, its ambient ones with them; no_new_privs again
    (the worker's, inherited). The bounding set is the zygote's, emptied once for all its
    boxes (`drop_bounding_set`)."""
    try:
        _prctl(PR_SET_NO_NEW_PRIVS, 1, "prctl NO_NEW_PRIVS")
        _check(_libc.capset(ctypes.byref(_NO_CAPS[0]), _NO_CAPS[1]), "capset")
    except OSError as e:
        raise SetupError(str(e)) from None


class _RulesetAttr(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("handled_access_fs", "handled_access_net", "scoped")]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def domain_ruleset(grants: list[tuple[str | int, bool]] | None = None) -> int | None:
    """The rules of a box's own Landlock domain (`enter_domain`, after no_new_privs), made
    by the zygote before the fork (a box pays for every page its code writes): a process
    outside the domain (the trainer, the supervisor and zygote, another box) can then not
    be ptraced, nor its /proc/<pid>/mem, fd or environ opened, and (Landlock ABI >= 6)
    neither signalled nor reached through an abstract unix socket, whatever its user: what
    keeps boxes apart at the `process` level, where they share a PID namespace and a user.
    Each box that enters gets a domain of its own, whoever else entered the same rules.

    `grants` (the `process` level: `filesystem_grants`, their paths `opened_grants`, and the
    box's own scratch) restricts the filesystem too: reading and writing only beneath
    those paths, each read-only or not, so another box's scratch is out of its reach, and /proc and /sys are read-only:
    its own cgroup's files (the limits of its memory and processes, cgroup.procs of its
    worker's group) and the sysctls, which a root box without capabilities could
    otherwise write as their owner. None (the `namespace` level, whose mounts do that): the
    filesystem is not restricted. The ruleset's descriptor (close-on-exec), or None where
    the kernel has no Landlock (the log line says so)."""
    abi = landlock_abi()
    if abi < 1:
        return None
    scoped = LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | LANDLOCK_SCOPE_SIGNAL if abi >= 6 else 0
    handled = _fs_rights(abi) if grants is not None else LANDLOCK_ACCESS_FS_EXECUTE
    if grants is None and abi >= 6:
        handled = 0  # scoping alone: the filesystem is the mounts' business
    attr = _RulesetAttr(handled, 0, scoped)
    size = ctypes.sizeof(attr) if abi >= 6 else 8
    ruleset = _check(_libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), size, 0),
                     "landlock_create_ruleset")  # fmt: skip
    try:
        if grants is not None:
            for path, read_only in grants:
                _grant(ruleset, path, handled & (READ_RIGHTS if read_only else ~0))
        elif handled:  # a domain handling one right it then allows everywhere: ptrace is scoped
            _grant(ruleset, "/", LANDLOCK_ACCESS_FS_EXECUTE)
    except BaseException:
        os.close(ruleset)
        raise
    return ruleset


def enter_domain(ruleset: int | None) -> None:
    """Restrict the calling box to a new Landlock domain of `ruleset`'s rules (none: no
    Landlock here)."""
    if ruleset is not None:
        _check(_libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")


def _fs_rights(abi: int) -> int:
    """Every filesystem right this ABI knows but executing (allowed everywhere)."""
    rights = (1 << 13) - 1 & ~LANDLOCK_ACCESS_FS_EXECUTE
    if abi >= 2:
        rights |= LANDLOCK_ACCESS_FS_REFER
    if abi >= 3:
        rights |= LANDLOCK_ACCESS_FS_TRUNCATE
    return rights


def _grant(ruleset: int, path: str | int, rights: int) -> None:
    """Allow `rights` beneath `path` (the file rights alone on a file), a path or a
    descriptor `opened_grants` opened; a path gone since it was listed is skipped
    (refused: the safe side)."""
    try:
        fd = path if isinstance(path, int) else os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            rights &= FILE_RIGHTS
        if rights:
            rule = _PathBeneath(rights, fd)
            args = (ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0)
            _check(_libc.syscall(SYS_LANDLOCK_ADD_RULE, *args), f"landlock_add_rule {path}")
    finally:
        if fd is not path:
            os.close(fd)


def opened_grants(grants: list[tuple[str, bool]]) -> list[tuple[int, bool]]:
    """`grants` with each path opened once (O_PATH, close-on-exec; those gone skipped): the
    zygote's, so that each box's ruleset costs a system call per grant, not four."""
    opened = []
    for path, read_only in grants:
        with contextlib.suppress(OSError):
            opened.append((os.open(path, os.O_PATH | os.O_CLOEXEC), read_only))
    return opened


def filesystem_grants(scratch: str) -> list[tuple[str, bool]]:
    """What a `process`-level box may read and write besides its own scratch directory
    (the zygote's, once): everything beneath every entry of every directory on the way to
    the worker's scratch directory, but that way itself and every worker's scratch
    directory (SCRATCH_PREFIX); READ_ONLY_ROOTS read-only. So a box neither lists nor creates entries directly in those few directories (/, and
    /tmp where the scratch is there: at `namespace` nothing of / is writable at all), and
    an entry made in them after the zygote started is out of its reach too."""
    root = os.path.realpath(scratch)
    grants = []
    here = "/"
    for part in root.strip("/").split("/"):
        for name in sorted(os.listdir(here)):
            path = os.path.join(here, name)
            if name != part and not _holds_scratch(os.path.realpath(path), root):
                grants.append((path, here == "/" and name in READ_ONLY_ROOTS))
        here = os.path.join(here, part)
    return grants


def _holds_scratch(path: str, root: str) -> bool:
    """Whether `path` is on the way to, or inside, the worker's or another worker's scratch."""
    return (
        root == path
        or root.startswith(path.rstrip("/") + "/")
        or path.startswith(root + "/")
        or any(part.startswith(SCRATCH_PREFIX) for part in path.split("/"))
    )


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none)."""
    return max(
        0, _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, LANDLOCK_CREATE_RULESET_VERSION)
    )


def _last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 63


def probe() -> None:
    """The trainer's test of the namespace level (levels.py; argv: the spec JSON): set it
    up as a worker and one box would, the system-call filters included, print "ok" or the
    step that failed, exit 0 or 1."""
    import json

    from leangrpo.sandbox.seccomp import FilterError, compile_filter, load

    spec = json.loads(sys.argv[1])
    try:
        enter_namespace(spec, os.open(os.devnull, os.O_RDONLY))
        confine(spec)
        box = compile_filter(box=True, unix_sockets=spec["network"])
        load(compile_filter(box=False))
        new_pid_namespace()
        if os.fork() == 0:
            confine_box(spec, spec["scratch"], own_network=True)
            drop_privileges()
            load(box)
            os._exit(0)
        _, status = os.wait()
        if status != 0:
            raise SetupError(f"a box could not be set up (status {status})")
    except (SetupError, FilterError, OSError) as e:
        print(e, flush=True)
        os._exit(1)
    print("ok", flush=True)
    os._exit(0)
