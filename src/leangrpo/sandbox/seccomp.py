"""The system-call filters (worker side), written with libseccomp through pyseccomp.

A deny-list over an allow-by-default filter: what Docker's default seccomp profile refuses
(kernel keyrings, namespaces and mounts, modules, kexec, ptrace and other processes'
memory, BPF, perf events, userfaultfd, NUMA policy, clock and swap and quota changes,
personalities that turn ASLR off, io_uring, clone3, whose flags a filter cannot read, and
the obsolete calls), plus sockets of AF_VSOCK (and, in a box without network, AF_UNIX: a
pathname socket is reached through the filesystem, not the network namespace, so a daemon
listening where a box can see would be in reach). System calls of another architecture's
table (i386, x32 on x86-64) are refused by libseccomp's bad-architecture action.

Two filters, compiled once per worker (`compile_filter`) and loaded with one prctl each
(`load`, after no_new_privs):
- `WORKER`: the worker's own processes (the supervisor, the zygote): everything above but
  namespaces and mounts, which the zygote needs to make each box;
- `BOX`: every box, before any user code runs; filters stack, so a box has both.

An integer argument is compared on its low 32 bits only (MASKED_EQ with 0xffffffff): the
kernel reads `int` arguments so, and a filter comparing all 64 bits would let a caller
set high bits to slip past it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os

PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
AF_UNIX, AF_VSOCK = 1, 40
LOW32 = 0xFFFFFFFF
NAMESPACE_FLAGS = (0x00000080, 0x00020000, 0x02000000, 0x04000000, 0x08000000,
                   0x10000000, 0x20000000, 0x40000000)  # time, ns, cgroup, uts, ipc, user, pid, net  # fmt: skip
# refused everywhere (EPERM), as Docker's default profile does
DENIED = (
    "add_key", "keyctl", "request_key",  # kernel keyrings: the trainer's session keyring
    "acct", "bpf", "perf_event_open", "userfaultfd", "lookup_dcookie", "fanotify_init",
    "init_module", "finit_module", "delete_module", "create_module", "get_kernel_syms",
    "query_module", "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "settimeofday", "stime", "clock_settime", "clock_adjtime", "syslog", "vhangup",
    "iopl", "ioperm", "quotactl", "quotactl_fd", "name_to_handle_at", "open_by_handle_at",
    "nfsservctl", "uselib", "ustat", "sysfs", "_sysctl", "vm86", "vm86old",
    "mbind", "set_mempolicy", "get_mempolicy", "migrate_pages", "move_pages",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
)  # fmt: skip
# refused in boxes (the zygote needs them to make a box)
BOX_DENIED = (
    "unshare", "setns", "mount", "umount", "umount2", "pivot_root", "chroot",
    "fsopen", "fsconfig", "fsmount", "fspick", "open_tree", "move_mount", "mount_setattr",
)  # fmt: skip
# personality flags that weaken what exec does (ASLR off, readable implies executable, page 0)
PERSONALITY_FLAGS = (0x0040000, 0x0400000, 0x0200000, 0x0100000)


class FilterError(Exception):
    """libseccomp is missing or refused the filter (one line naming the fix)."""


def compile_filter(box: bool, unix_sockets: bool = True) -> bytes:
    """The BPF program of the WORKER (box=False) or BOX filter."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError, RuntimeError) as e:  # no libseccomp.so.2 raises at import
        raise FilterError(
            f"the sandbox's system-call filter needs libseccomp ({type(e).__name__}: {e}); "
            "install it (pip install pyseccomp; apt-get install libseccomp2)"
        ) from None
    refuse, enosys = sc.ERRNO(errno.EPERM), sc.ERRNO(errno.ENOSYS)
    f = sc.SyscallFilter(sc.ALLOW)
    f.set_attr(sc.Attr.ACT_BADARCH, enosys)
    for name in DENIED + (BOX_DENIED if box else ()):
        _rule(f, refuse, name)
    _rule(f, enosys, "clone3")  # its flags live in memory: glibc falls back to clone
    if box:
        for flag in NAMESPACE_FLAGS:
            f.add_rule(refuse, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socket", sc.Arg(0, sc.MASKED_EQ, LOW32, AF_VSOCK))
    if not unix_sockets:
        f.add_rule(sc.ERRNO(errno.EACCES), "socket", sc.Arg(0, sc.MASKED_EQ, LOW32, AF_UNIX))
    for flag in PERSONALITY_FLAGS:
        f.add_rule(refuse, "personality", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    read, write = os.pipe()
    try:
        with os.fdopen(write, "wb") as out:
            f.export_bpf(out)
        return _read_all(read)
    finally:
        os.close(read)


def _rule(f, action: int, name: str) -> None:
    with contextlib.suppress(ValueError, OSError, RuntimeError):  # a name it does not know
        f.add_rule(action, name)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.c_void_p)]


class Program:
    """A compiled filter made ready to load (the zygote's, once: each box only loads it)."""

    def __init__(self, program: bytes):
        self.buffer = ctypes.create_string_buffer(program, len(program))
        self.fprog = _SockFprog(len(program) // 8, ctypes.cast(self.buffer, ctypes.c_void_p))
        self.libc = ctypes.CDLL(None, use_errno=True)


def load(program: bytes | Program) -> None:
    """Install a compiled filter on the calling thread (no_new_privs must be set)."""
    ready = program if isinstance(program, Program) else Program(program)
    fprog = ctypes.byref(ready.fprog)
    if ready.libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, fprog, 0, 0) < 0:
        raise OSError(ctypes.get_errno(), "seccomp")
