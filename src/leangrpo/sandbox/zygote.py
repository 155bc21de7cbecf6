"""The zygote (worker side): imports the user's code once, then forks a box per request.

Started by launch.py as the supervisor's child, confined like the whole worker, holding
no channel to the trainer (only its control socket to the supervisor): it runs the
entry's `prepare(init, announce)` (rewards/worker.py, environments/worker.py: imports,
checks, the set-up reports `announce` passes on), which returns what each box runs
(`box_main(conn)`), then serves the supervisor's requests (box.py `Boxes`):

- `{"t": "box", "id", "network", "forward", "argv", "env", "meter"}`: fork a box.
  Namespace level: the child is born PID 1 of a new PID namespace (the zygote unshares
  one before the fork and steps back after it), so it sees no other process of the
  worker; process level: a session of its own and a fresh scratch directory. Before
  anything else runs, the child joins its cgroups (cgroups.py; their cgroup.procs files
  opened by the zygote), takes a fresh interpreter's signals (no wakeup fd, no handler
  or ignored signal of the zygote's), closes every descriptor but its own, is confined
  (confine.py `confine_box`: namespaces, fresh /proc, scratch and /dev/shm; the process
  limit), starts its forwarder if asked (forward.py), drops every capability and loads
  the BOX filter (seccomp.py); then it runs `box_main` (under its output meter unless
  `meter` is false: the supervisor then counts what the box prints itself), or execs
  `argv`. The supervisor gets the box's pid and its descriptors (SCM_RIGHTS).

Every fork write-protects every page of the zygote, and each page that any code writes
afterwards, the zygote's or a box's, is copied for it (benchmarks/RESULTS.md "sandbox":
most of a call's cost). So the zygote forks the boxes of every request that has arrived
in one batch, with nothing between two forks but the fork (`_fork_all`: the descriptors,
cgroups and scratch of all of them made before the first, the replies sent after the
last), and what every box would do alike is done once, before it serves: the filters
compiled and made ready to load, the bounding set emptied (namespace level; the process
level's worker has no capability left), its signals that differ from a fresh
interpreter's listed, its objects frozen (gc.freeze: a box's collections never walk
them, which would copy every page they are on) and its memory moved into huge pages
(pages.py: a fork copies far fewer page-table entries).

When a box ends (the supervisor kills it) the zygote reaps it, tells the supervisor
`{"t": "exit", "id", "code", "oom"}`, removes its cgroups and (process level) its
scratch directory, and kills what it left behind (processes re-parented to the zygote,
a subreaper).
"""

from __future__ import annotations

import _signal
import contextlib
import fcntl
import gc
import importlib
import os
import select
import signal
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from leangrpo.sandbox.box import BoxConn, send_fds
from leangrpo.sandbox.cgroups import BoxGroups, join_by
from leangrpo.sandbox.confine import (
    BOX_TASKS,
    SetupError,
    back_to,
    confine_box,
    domain_ruleset,
    drop_bounding_set,
    drop_box_privileges,
    enter_domain,
    filesystem_grants,
    limit_box_tasks,
    new_pid_namespace,
    opened_grants,
)
from leangrpo.sandbox.files import remove_tree
from leangrpo.sandbox.frames import CHANNEL_FD_MIN, FrameReader, frame, json_payload
from leangrpo.sandbox.output import OutputMeter
from leangrpo.sandbox.pages import collapse
from leangrpo.sandbox.proctree import become_subreaper, children, kill_pids
from leangrpo.sandbox.seccomp import Program, compile_filter, load

BOX_SETUP_FAILED = 75


@dataclass
class _Live:
    id: int
    group: str | None
    scratch: str | None


@dataclass
class _Made:
    """One box of a batch: what the zygote makes for it before the fork."""

    request: dict
    parent: socket.socket  # the supervisor's end (sent), and the box's
    child: socket.socket
    out: tuple[int, int]  # the output pipe (read end sent, write end the box's)
    stdio: tuple[tuple[int, int], tuple[int, int]] | None  # a command's stdin, stdout pipes
    group: str | None
    procs: list[int]  # its cgroups' cgroup.procs, open for the box to join
    domain: int | None  # the rules of its Landlock domain
    scratch: str
    tasks: int
    pid: int = -1


class Zygote:
    def __init__(self, control: socket.socket, spec: dict, groups: BoxGroups | None):
        self.control = control
        self.spec = spec
        self.groups = groups
        self.namespace = spec["level"] == "namespace"
        self.programs = {
            unix: Program(compile_filter(box=True, unix_sockets=unix))
            for unix in {True, spec["network"]}
        }
        self.own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        # process level: what a box may read and write besides its scratch (its mounts
        # keep a namespace box's files apart: one set of rules, a domain per box)
        self.grants = None if self.namespace else opened_grants(filesystem_grants(spec["scratch"]))
        self.domain = domain_ruleset() if self.namespace else None
        self.live: dict[int, _Live] = {}  # pid -> box
        self.unremoved: list[str] = []  # cgroups whose tasks were still being released
        self.box_main: Callable[[BoxConn], Any] | None = None
        self.signals: list[tuple[int, Any]] = []  # to reset in a box (`serve` finds them)

    def announce(self, message: dict) -> None:
        self.control.sendall(frame(json_payload(message)))

    def serve(self, init: dict) -> None:
        become_subreaper()  # what an ended box left is re-parented here, and killed
        entry = importlib.import_module(init["entry"])
        self.box_main = entry.prepare(init, self.announce)
        if self.box_main is None or init.get("mode", "serve") != "serve":
            return
        wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_write)
        signal.signal(signal.SIGCHLD, lambda *a: None)
        self.signals = _changed_signals()
        if self.namespace:
            drop_bounding_set()  # (the process level's worker has no capability left)
            _scratch_environment(self.spec["scratch"])  # each box's, with a fresh tmpfs over it
        # what the imports made is never collected: a box's garbage collections then skip
        # it instead of writing to every object (copy-on-write faults: page after page of
        # the zygote's memory copied into each box)
        gc.freeze()
        collapse()
        reader = FrameReader()
        poller = select.poll()
        poller.register(self.control, select.POLLIN)
        poller.register(wake_read, select.POLLIN)
        while True:
            with contextlib.suppress(InterruptedError):
                ready = {fd for fd, _ in poller.poll()}
            if wake_read in ready:
                with contextlib.suppress(OSError):
                    os.read(wake_read, 4096)
            requests = []
            if self.control.fileno() in ready:
                data = self.control.recv(1 << 16)
                if not data:
                    return  # the supervisor is gone
                requests = [_unpickle(payload) for payload in reader.feed(data)]
            self._reap()
            if requests:
                self._fork_all(requests)

    # -- forking boxes --------------------------------------------------------------------
    def _fork_all(self, requests: list[dict]) -> None:
        """Fork a box for each request, in one batch (see the module docstring)."""
        tasks = _tasks() if self.spec.get("nproc_limit") else 0
        made = [self._make(r, tasks + n * BOX_TASKS) for n, r in enumerate(requests)]
        for box in made:
            box.pid = self._fork(box)
            if box.pid < 0:
                break
        for box in made:
            self._deliver(box)
        if any(box.pid < 0 for box in made):
            raise SetupError("fork: the worker's process limit or memory is exhausted")

    def _make(self, request: dict, tasks: int) -> _Made:
        parent, child = socket.socketpair()
        parent.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        stdio = (os.pipe(), os.pipe()) if request.get("argv") else None
        group = self.groups.make() if self.groups is not None else None
        procs = self.groups.procs(group) if group is not None else []
        scratch, domain = self.spec["scratch"], self.domain
        if not self.namespace:
            scratch = tempfile.mkdtemp(prefix="box-", dir=self.spec["scratch"])
            domain = domain_ruleset([*self.grants, (scratch, False)])
        return _Made(request, parent, child, os.pipe(), stdio, group, procs, domain, scratch,
                     tasks)  # fmt: skip

    def _fork(self, box: _Made) -> int:
        """Fork `box` (its pid; -1 if the fork failed): as little as can be between forks."""
        if self.namespace:
            new_pid_namespace()
        try:
            pid = os.fork()
        except OSError:
            pid = -1
        if pid == 0:
            self._box(box)  # never returns
        if self.namespace:
            back_to(self.own_pid_ns)  # in the zygote only: a box cannot leave its namespace
        return pid

    def _deliver(self, box: _Made) -> None:
        """Send the supervisor a forked box's pid and descriptors; close the zygote's copies
        (and undo a box that was not forked)."""
        box.child.close()
        os.close(box.out[1])
        for fd in box.procs:
            os.close(fd)
        if box.domain is not None and box.domain != self.domain:
            os.close(box.domain)
        fds = [box.parent.fileno(), box.out[0]]
        if box.stdio is not None:
            os.close(box.stdio[0][0])
            os.close(box.stdio[1][1])
            fds += [box.stdio[0][1], box.stdio[1][0]]
        request = box.request
        if box.pid > 0:
            self.live[box.pid] = _Live(request["id"], box.group, None if self.namespace else box.scratch)
            message = {"t": "box", "id": request["id"], "pid": box.pid,
                       "meter": request.get("meter", True)}  # fmt: skip
            send_fds(self.control, message, fds)
        else:
            if box.group is not None and not self.groups.remove(box.group):
                self.unremoved.append(box.group)
            if not self.namespace:
                remove_tree(box.scratch)
        box.parent.close()
        for fd in fds[1:]:
            os.close(fd)

    def _box(self, box: _Made) -> None:
        """In the new box: confine it, then run it (see the module docstring)."""
        code = 0
        # the zygote's wake-up (its pipe is closed below): a child of the box that exits
        # would otherwise print "Exception ignored ... signal wakeup fd" from the box
        _signal.set_wakeup_fd(-1)
        _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)
        request = box.request
        keep = {"sock": box.child.fileno(), "out": box.out[1]}
        if box.domain is not None:
            keep["domain"] = box.domain
        if box.stdio is not None:
            keep.update(stdin=box.stdio[0][0], stdout=box.stdio[1][1])
        try:
            try:
                join_by(box.procs)  # first: everything the box does is counted
            except OSError as e:
                raise SetupError(f"joining its cgroups: {e.strerror}") from None
            _fresh_signals(self.signals)  # before its wakeup fd is closed: no byte lands on a reused fd
            fds = _settle_descriptors(keep)  # the cgroups' and the zygote's are closed
            os.setsid()
            become_subreaper()  # orphans of its processes stay in its tree (process level)
            confine_box(self.spec, box.scratch, own_network=bool(request.get("network")))
            if not self.namespace:  # (a namespace box's scratch is the zygote's: `serve`)
                _scratch_environment(box.scratch)
            endpoint = self._forwarder(request.get("forward"))
            limit_box_tasks(self.spec, box.tasks)
            drop_box_privileges()
            domain = fds.pop("domain", None)
            enter_domain(domain)
            if domain is not None:
                os.close(domain)
            load(self.programs[bool(self.spec["network"])])
            if request.get("argv"):
                _exec(request, fds, endpoint)
            self._run(fds, endpoint, request.get("meter", True))
        except SetupError as e:
            print(
                f"the sandbox ({self.spec['level']}) could not set up a box: {e}", file=sys.stderr
            )
            code = BOX_SETUP_FAILED
        except BaseException:  # a bug of the box's own code (user code's errors are replies)
            traceback.print_exc()
            code = 1
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)

    def _forwarder(self, target: str | None) -> str | None:
        if not target:
            return None
        from leangrpo.sandbox.forward import start_forwarder

        return start_forwarder(target, self.programs[True])

    def _run(self, fds: dict[str, int], endpoint: str | None, metered: bool) -> None:
        """Run `box_main`: under an output meter (its thread drains 1 and 2), or, `metered`
        false (a box of one call: the supervisor counts what it prints), with 1 and 2 the
        output pipe itself."""
        meter = OutputMeter(int(self.spec["max_output_bytes"])) if metered else None
        os.close(fds.pop("out"))  # (the meter dup'ed 1, the output pipe)
        conn = BoxConn(socket.socket(fileno=fds["sock"]), self.spec, meter, endpoint)
        if endpoint:
            os.environ["LEANGRPO_ENDPOINT"] = endpoint
        self.box_main(conn)
        conn.settle()
        conn.linger()  # the supervisor reads the reply while its sender lives

    # -- ended boxes ------------------------------------------------------------------------
    def _reap(self) -> None:
        ended = False
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            box = self.live.pop(pid, None)
            if box is not None:
                ended = True
                self._ended(box, os.waitstatus_to_exitcode(status))
        if ended:
            kill_pids([p for p in children(os.getpid()) if p not in self.live])
        self.unremoved = [g for g in self.unremoved if not self.groups.remove(g)]

    def _ended(self, box: _Live, code: int) -> None:
        oom = False
        if box.group is not None:
            oom = self.groups.oom_killed(box.group)
            if not self.groups.remove(box.group):
                self.unremoved.append(box.group)
        if box.scratch is not None:
            remove_tree(box.scratch)
        with contextlib.suppress(OSError):
            self.announce({"t": "exit", "id": box.id, "code": code, "oom": oom})


PYTHON_DEFAULTS = {signal.SIGINT: signal.default_int_handler, signal.SIGPIPE: signal.SIG_IGN,
                   signal.SIGXFSZ: signal.SIG_IGN}  # fmt: skip  what a fresh interpreter sets


def _changed_signals() -> list[tuple[int, Any]]:
    """The zygote's signals whose handling is not a fresh interpreter's (its SIGCHLD
    handler, SIGINT ignored by the worker), with what a fresh interpreter has."""
    changed = []
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        wanted = PYTHON_DEFAULTS.get(signum, signal.SIG_DFL)
        with contextlib.suppress(OSError, ValueError):  # signals the C library reserves
            if signal.getsignal(signum) is not wanted:  # (as plain ints: `_fresh_signals`)
                changed.append((int(signum), int(wanted) if isinstance(wanted, int) else wanted))
    return changed


def _fresh_signals(changed: list[tuple[int, Any]]) -> None:
    """A fresh interpreter's signals: no wakeup fd (the zygote's would get a byte for each
    signal, on whatever descriptor has its number by then), none of the zygote's
    handlers (`changed`: `_changed_signals`), none blocked."""
    _signal.set_wakeup_fd(-1)
    for signum, wanted in changed:  # the C functions: no enum made of what they return
        _signal.signal(signum, wanted)
    _signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _scratch_environment(scratch: str) -> None:
    """HOME and TMPDIR `scratch`: a process box's own directory, or (set once, in the
    zygote, for all its boxes) a namespace worker's, over which each box mounts a fresh
    tmpfs."""
    for name in ("HOME", "TMPDIR"):
        if os.environ.get(name) != scratch:
            os.environ[name] = scratch
    tempfile.tempdir = None  # the zygote's cached one may not be this box's


def _settle_descriptors(keep: dict[str, int]) -> dict[str, int]:
    """Close every descriptor but `keep`, moved to fixed places: 0 /dev/null (a command's
    stdin pipe), 1 and 2 the output pipe (a command's stdout: its pipe), the rest above."""
    above = CHANNEL_FD_MIN + len(keep)  # out of the way of 0-2 and of the places below
    moved = {name: fcntl.fcntl(fd, fcntl.F_DUPFD, above) for name, fd in keep.items()}
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(moved.pop("stdin", null), 0)
    os.dup2(moved.pop("stdout", moved["out"]), 1)
    os.dup2(moved["out"], 2)
    placed = {}
    for n, (name, fd) in enumerate(sorted(moved.items())):
        placed[name] = os.dup2(fd, CHANNEL_FD_MIN + n, inheritable=False)
    os.closerange(3, CHANNEL_FD_MIN)
    os.closerange(CHANNEL_FD_MIN + len(placed), 1 << 20)
    return placed


def _exec(request: dict, fds: dict[str, int], endpoint: str | None) -> None:
    """Exec the command (stdin, stdout its pipes; stderr the output pipe)."""
    env = {**os.environ, **request.get("env", {})}
    if endpoint:
        env["LEANGRPO_ENDPOINT"] = endpoint
    for fd in fds.values():
        os.close(fd)
    for signum in PYTHON_DEFAULTS:  # as subprocess's restore_signals: a command's defaults
        signal.signal(signum, signal.SIG_DFL)
    argv = request["argv"]
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        print(f"could not run {argv[0]!r}: {e.strerror}", file=sys.stderr)
        os._exit(127)


def _tasks() -> int:
    """Tasks (processes and threads) in the worker's namespace now."""
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                count += len(os.listdir(f"/proc/{name}/task"))
    return count


def _unpickle(payload: bytes) -> Any:
    import pickle

    return pickle.loads(payload)  # the supervisor's: trusted


def serve(control: socket.socket, init: dict, spec: dict, group_fds: list[int]) -> None:
    """The zygote's life (launch.py forks it once the worker is confined)."""
    groups = None
    if group_fds:
        pids = int(spec["max_processes"]) + BOX_TASKS
        groups = BoxGroups(spec["cgroups"], group_fds, spec.get("memory_limit_mb"), pids)
    Zygote(control, spec, groups).serve(init)
