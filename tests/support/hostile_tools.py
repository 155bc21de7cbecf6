"""Tools (and a tool parser) that attack the trainer from inside a worker, for the sandbox
tests (tests/sandbox/, tests/integration/test_sandbox.py). Each returns what it managed as
text, so the tests read the outcome from the tool message; none can do harm where the
sandbox fails: the fork loop is bounded, the signal is one the trainer ignores, a ptrace
attach that succeeds is undone by its process exiting."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PTRACE_SEIZE = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
rc = libc.ptrace(0x4206, int(sys.argv[1]), None, None)  # PTRACE_SEIZE: does not stop it
print("attached" if rc == 0 else f"errno {ctypes.get_errno()}")
"""  # the process exits at once, which detaches it


def _write(path: str) -> int:
    with open(path, "w") as f:
        return f.write("x")


def _read(path: str) -> int:
    with open(path, "rb") as f:
        return len(f.read(64))


def _attempt(action) -> str:
    try:
        result = action()
        return "ok" if result is None else f"ok {result}"
    except BaseException as e:  # noqa: BLE001  the outcome is the point
        return f"{type(e).__name__}: {e}"


def read_env(name: str) -> str:
    """Read an environment variable.

    Args:
        name: Its name.
    """
    return json.dumps(os.environ.get(name))


def attack(pid: int, signals: bool) -> str:
    """Try to signal, ptrace and read a process.

    Args:
        pid: The trainer's process id.
        signals: Also send it (and every process this one may signal) SIGWINCH.
    """
    out = {
        "mem": _attempt(lambda: _read(f"/proc/{pid}/mem")),
        "environ": _attempt(lambda: _read(f"/proc/{pid}/environ")),
    }
    if signals:
        out["signal"] = _attempt(lambda: os.kill(pid, signal.SIGWINCH))
        out["signal_group"] = _attempt(lambda: os.killpg(os.getpgid(pid), signal.SIGWINCH))
        out["signal_all"] = _attempt(lambda: os.kill(-1, signal.SIGWINCH))
    seize = [sys.executable, "-c", PTRACE_SEIZE, str(pid)]
    out["ptrace"] = subprocess.run(seize, capture_output=True, text=True).stdout.strip()
    return json.dumps(out)


def leave_processes(tag: str) -> str:
    """Start a background sleeper and a double-forked daemon, and return at once.

    Args:
        tag: A sleep duration that marks them.
    """
    subprocess.Popen(["sleep", tag], start_new_session=True)
    pid = os.fork()
    if pid == 0:  # a daemon: out of the worker's process group and session
        os.setsid()
        if os.fork() == 0:
            os.execvp("sleep", ["sleep", tag])
        os._exit(0)
    os.waitpid(pid, 0)
    return "left"


def write_file(path: str) -> str:
    """Write a file.

    Args:
        path: Where.
    """
    return _attempt(lambda: _write(path))


def where() -> str:
    """The working directory, HOME, TMPDIR and /dev/shm, and whether each can be written."""
    places = {"cwd": os.getcwd(), "home": os.environ.get("HOME"), "tmp": os.environ.get("TMPDIR"),
              "shm": "/dev/shm"}  # fmt: skip
    out = {}
    for name, place in places.items():
        out[name] = [place, _attempt(lambda p=place: _write(os.path.join(p, "f")))]
    return json.dumps(out)


def connect(port: int) -> str:
    """Connect to a TCP port on the loopback interface.

    Args:
        port: The port.
    """
    return _attempt(lambda: socket.create_connection(("127.0.0.1", port), timeout=2).close())


def connect_unix(path: str) -> str:
    """Connect to a unix socket on the filesystem; then make a socket pair.

    Args:
        path: The socket's path.
    """
    result = _attempt(lambda: _unix_connect(path))
    pair = _attempt(lambda: [s.close() for s in socket.socketpair()] and None)
    return json.dumps({"connect": result, "socketpair": pair})


def _unix_connect(path: str) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        s.connect(path)


def allocate(mb: int) -> str:
    """Allocate memory.

    Args:
        mb: Megabytes.
    """
    block = bytearray(mb << 20)
    return f"allocated {len(block) >> 20} MB"


def fork_count(attempts: int) -> str:
    """Fork up to `attempts` sleeping children at once; count those that started.

    Args:
        attempts: How many to try (the bound: this is never unbounded).
    """
    started = 0
    for _ in range(attempts):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        started += 1
    return f"forked {started}"


def fork_bomb(attempts: int) -> str:
    """Fork up to `attempts` sleeping children, raising at the first refusal.

    Args:
        attempts: How many to try.
    """
    for _ in range(attempts):
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
    return "forked all"


def flood(mb: int) -> str:
    """Print `mb` megabytes.

    Args:
        mb: Megabytes.
    """
    line = "spam " * 200
    for _ in range((mb << 20) // len(line)):
        print(line)
    return "printed"


def printer(lines: int) -> str:
    """Leave a process printing without end, and return at once.

    Args:
        lines: Unused.
    """
    subprocess.Popen(["yes", "spam from a leftover printer"], start_new_session=True)
    return "started"


def big(mb: int) -> str:
    """Return `mb` megabytes of text.

    Args:
        mb: Megabytes.
    """
    return "x" * (mb << 20)


def burn(seconds: float) -> str:
    """Compute for up to `seconds` of CPU time (of CPU, not wall, time: on a busy machine
    a wall-clock loop may never reach the CPU limit it is meant to reach).

    Args:
        seconds: How long.
    """
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
    return "burnt"


def spin(seconds: float) -> str:
    """Sleep, ignoring nothing.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


def pipe_flood() -> str:
    """Start a thread of the worker that writes without end to its stdout and to every
    other pipe it holds open for writing (the trainer's output pipe among them)."""
    import fcntl
    import threading

    targets = [1]
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            pipe = fd > 2 and os.readlink(f"/proc/self/fd/{name}").startswith("pipe:")
            if pipe and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY:
                targets.append(fd)
        except OSError:
            pass

    def write() -> None:
        chunk = b"flood " * 10000 + b"\n"
        while True:
            for fd in targets:
                with contextlib.suppress(OSError):
                    os.write(fd, chunk)

    threading.Thread(target=write, daemon=True).start()
    return f"flooding {targets}"


def isolated(prompts: list, completions: list, **columns) -> list:
    """A reward that reports (1.0) whether it runs isolated: no secret, no write outside
    its scratch, no trainer to signal, no network; prints what it found."""
    trainer = int(os.environ.get("LEANGRPO_TEST_TRAINER", "0"))
    found = {
        "secret": os.environ.get("LEANGRPO_TEST_SECRET"),
        "write": _attempt(lambda: _write(os.environ["LEANGRPO_TEST_OUTSIDE"])),
        "scratch": _attempt(lambda: _write(os.path.join(os.environ["TMPDIR"], "scratch-file"))),
        "signal": _attempt(lambda: os.kill(trainer, 0)),
        "connect": connect(int(os.environ["LEANGRPO_TEST_PORT"])),
    }
    print("isolation", json.dumps(found))
    ok = (found["secret"] is None and "Read-only" in found["write"] and found["scratch"] == "ok 1"
          and "ProcessLookupError" in found["signal"] and "Refused" in found["connect"])  # fmt: skip
    return [float(ok)] * len(completions)


HOSTILE = ["attack", "leave_processes", "write_file", "connect", "allocate", "fork_bomb",
           "flood", "big", "spin"]  # fmt: skip


def every_tool(text: str) -> tuple[str, list[dict], list[str]]:
    """A tool parser that ignores the model's turn and calls every hostile tool once (the
    end-to-end run: its tiny model would never call them itself). The arguments come from
    LEANGRPO_TEST_TOOL_ARGS, which the test passes to the workers (sandbox.pass_env)."""
    args = json.loads(os.environ["LEANGRPO_TEST_TOOL_ARGS"])
    return "", [{"name": name, "arguments": args[name]} for name in HOSTILE], []


def flooding_reward(prompts: list, completions: list, **columns) -> list:
    """A reward that prints without end (stopped at rewards.sandbox.max_output_bytes)."""
    while True:
        print("spam " * 200)


def hermes(tool: str, **arguments) -> str:
    """A tool call as the model writes it (Hermes format)."""
    return "<tool_call>" + json.dumps({"name": tool, "arguments": arguments}) + "</tool_call>"


# -- round 5 (issue 36): between calls, between trajectories, the channel ------------------

HOLD_MEMFD = r"""
import os, sys
fd = os.memfd_create("held")
for _ in range(int(sys.argv[1])):
    os.write(fd, b"\x01" * (1 << 20))  # written, never mapped: RLIMIT_AS does not see it
size = os.fstat(fd).st_size >> 20
print(size, flush=True)
sys.stdin.readline()
print(size, flush=True)  # still alive, still holding it
sys.stdin.read()
"""
HOLD_HEAP = r"""
import sys
block = bytearray(int(sys.argv[1]) << 20)
for i in range(0, len(block), 4096):
    block[i] = 1
print(len(block) >> 20, flush=True)
sys.stdin.readline()
print(len(block) >> 20, flush=True)  # still alive, still holding it
sys.stdin.read()
"""


def hold_memory(memfd_mb: int, processes: int, mb_each: int, one_at_a_time: bool = False) -> str:
    """Hold memory the way RLIMIT_AS never counts: a memfd filled with write() in one
    process, then `processes` processes of `mb_each` MB each. `held_mb` is what they hold
    at the same time: once all have reported, each still alive confirms it holds its
    memory (one the kernel killed in the meantime, its report already read, counts 0).

    Args:
        memfd_mb: MB written into the memfd.
        processes: How many processes then allocate.
        mb_each: MB each allocates.
        one_at_a_time: Start each process once the one before holds its memory.
    """
    starts = [(HOLD_MEMFD, memfd_mb)] + [(HOLD_HEAP, mb_each)] * processes
    kids, reported = [], []
    for code, mb in starts:
        kids.append(subprocess.Popen([sys.executable, "-c", code, str(mb)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))  # fmt: skip
        if one_at_a_time:
            reported.append(_held(kids[-1]))
    reported += [_held(kid) for kid in kids[len(reported) :]]
    confirmed = []
    for kid in kids:
        with contextlib.suppress(OSError):
            kid.stdin.write("\n")
            kid.stdin.flush()
        confirmed.append(_held(kid))
    for kid in kids:
        with contextlib.suppress(OSError):
            kid.stdin.close()
        kid.wait()
    return json.dumps({"held_mb": sum(confirmed), "reported": reported, "each": confirmed})


def _held(kid: subprocess.Popen) -> int:
    line = kid.stdout.readline().strip()
    return int(line) if line.isdigit() else 0


def _places() -> list[str]:
    """HOME/TMPDIR, and /dev/shm unless LEANGRPO_TEST_PLACES says "tmp" (process level)."""
    places = [os.environ["TMPDIR"]]
    return places if os.environ.get("LEANGRPO_TEST_PLACES") == "tmp" else [*places, "/dev/shm"]


def plant(name: str) -> str:
    """Leave a file in HOME/TMPDIR and in /dev/shm, and a module-level mark.

    Args:
        name: The file's name.
    """
    for place in _places():
        _write(os.path.join(place, name))
    _MARKS.append(name)
    return "planted"


_MARKS: list[str] = []


def find(name: str) -> str:
    """Whether what `plant` left (files, module state) is here.

    Args:
        name: The file's name.
    """
    found = [p for p in _places() if os.path.exists(os.path.join(p, name))]
    return json.dumps({"files": found, "marks": list(_MARKS)})


READ_KEY = """
import ctypes, errno, sys
libc = ctypes.CDLL(None, use_errno=True)
KEYCTL_SEARCH, KEYCTL_READ, SESSION = 10, 11, -3
kid = libc.syscall(250, KEYCTL_SEARCH, ctypes.c_long(SESSION), b"user", sys.argv[1].encode(), 0)
if kid < 0:
    print("search: " + errno.errorcode.get(ctypes.get_errno(), "?"))
else:
    buf = ctypes.create_string_buffer(256)
    n = libc.syscall(250, KEYCTL_READ, kid, buf, 256)
    print(buf.raw[:n].decode() if n >= 0 else "read: " + errno.errorcode.get(ctypes.get_errno(), "?"))
"""  # x86-64's keyctl


def read_keyring(description: str) -> str:
    """Search the session keyring for a user key and read it.

    Args:
        description: The key's description.
    """
    done = subprocess.run(
        [sys.executable, "-c", READ_KEY, description], capture_output=True, text=True
    )
    return (done.stdout + done.stderr).strip()


NESTED_USERNS = r"""
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
err = lambda: errno.errorcode.get(ctypes.get_errno(), "?")
out = {"unshare": "ok" if libc.unshare(0x10000000) == 0 else err()}
caps = [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")][0]
out["caps"] = caps
pid = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)  # clone(CLONE_NEWUSER | SIGCHLD)
if pid == 0:
    os._exit(0)
out["clone"] = "ok" if pid > 0 else err()
import socket
try:
    socket.socket(40, socket.SOCK_STREAM).close()  # AF_VSOCK
    out["vsock"] = "ok"
except OSError as e:
    out["vsock"] = errno.errorcode.get(e.errno, "?")
print(json.dumps(out))
"""


def nested_userns() -> str:
    """Make a nested user namespace (unshare, clone) and report the capabilities in it."""
    done = subprocess.run([sys.executable, "-c", NESTED_USERNS], capture_output=True, text=True)
    return (done.stdout + done.stderr).strip()


def attack_tagged(tag: str) -> str:
    """Find processes whose command line holds `tag` and try to write to their stdin,
    read their memory, signal and ptrace them.

    Args:
        tag: The mark in their command line.
    """
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if tag.encode() not in f.read():
                    continue
        except OSError:
            continue
        pid = int(name)
        seize = [sys.executable, "-c", PTRACE_SEIZE, str(pid)]
        found[name] = {
            "stdin": _attempt(lambda p=pid: _write(f"/proc/{p}/fd/0")),
            "mem": _attempt(lambda p=pid: _read(f"/proc/{p}/mem")),
            "signal": _attempt(lambda p=pid: os.kill(p, 0)),
            "ptrace": subprocess.run(seize, capture_output=True, text=True).stdout.strip(),
        }
    return json.dumps(found)


def forge_terms() -> str:
    """Wrap every reply sender this process holds so that step replies carry the reward
    term 'forged' (what model code run in-process would do to its own worker)."""
    import gc

    wrapped = 0
    for obj in gc.get_objects():
        if hasattr(obj, "send") and hasattr(obj, "sock") and not isinstance(obj, type):
            send = obj.send

            def forged(message, send=send):
                ok = message.get("ok") if isinstance(message, dict) else None
                if isinstance(ok, dict) and "done" in ok:
                    ok["rewards"] = {"forged": 100.0}
                return send(message)

            with contextlib.suppress(Exception):
                obj.send = forged
                wrapped += 1
    return f"wrapped {wrapped}"


FORGE_FRAME = r"""
import json, os, struct, sys
def forge(n):
    task = fns = None
    f = sys._getframe()
    while f is not None:  # a worker that keeps its task in a frame (before issue 36)
        if "task_id" in f.f_locals and "fns" in f.f_locals:
            task, fns = f.f_locals["task_id"], f.f_locals["fns"]
        f = f.f_back
    frames = [{"t": "result", "values": [1.0] * n, "errors": []}]
    if task is not None:
        frames = [{**frames[0], "task": task, "fn": fn} for fn in fns]
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            for message in frames:
                body = json.dumps(message).encode()
                os.write(fd, b"LGRW" + struct.pack(">I", len(body)) + body)
        except OSError:
            pass
"""


def forking_forger(prompts: list, completions: list, **columns) -> list:
    """A unit-test reward in HumanEval's pattern (each program in a forked child) whose
    program for "forge" writes well-formed replies scoring its whole call 1.0 from the
    forked child; it scores every program 0.0 itself."""
    for text in completions:
        pid = os.fork()
        if pid == 0:
            if text == "forge":
                namespace: dict = {}
                exec(FORGE_FRAME, namespace)
                namespace["forge"](len(completions))
            os._exit(0)
        os.waitpid(pid, 0)
    return [0.0] * len(completions)


def make_deep_tree(base: str, depth: int) -> None:
    """Directories `depth` levels deep under `base`, made through directory descriptors
    (no path grows past PATH_MAX)."""
    fd = os.open(base, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        child = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.close(fd)


def deep_scratch_reward(prompts: list, completions: list, **columns) -> list:
    """'deep' leaves a tree 1,500 levels deep in TMPDIR (0.0); anything else scores 1.0."""
    for text in completions:
        if text == "deep":
            make_deep_tree(os.environ["TMPDIR"], 1500)
    return [0.0 if text == "deep" else 1.0 for text in completions]


def box_sharers_reward(prompts: list, completions: list, **columns) -> list:
    """Each sample scores how many samples share its call's box: a program one leaves
    running there (a detached process scanning /proc) kills its siblings' programs."""
    return [float(len(completions))] * len(completions)


FORGED_LIMITS = "import os, signal; [os.kill(os.getppid(), s) for s in (signal.SIGUSR1, signal.SIGXCPU)]"


def forged_limit_reward(prompts: list, completions: list, **columns) -> list:
    """A unit-test reward whose programs fail their tests (0.0) but, from the process the
    reward runs them in, send it the signals of its wall-time and CPU limits."""
    for _ in completions:
        subprocess.run([sys.executable, "-c", FORGED_LIMITS], check=False)
    return [0.0] * len(completions)


def forked_pipes_reward(prompts: list, completions: list, **columns) -> list:
    """How many pipes open for writing a child forked from the call holds past 0, 1 and 2
    (the output meter's descriptor to the trainer's pipe: writes there pass the meter)."""
    import fcntl
    import stat

    pid = os.fork()
    if pid == 0:
        found = 0
        for fd in range(3, 1024):
            with contextlib.suppress(OSError):
                writable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
                found += stat.S_ISFIFO(os.fstat(fd).st_mode) and writable
        os._exit(min(found, 100))
    _, status = os.waitpid(pid, 0)
    return [float(os.waitstatus_to_exitcode(status))] * len(completions)


def import_interrupted_reward(prompts: list, completions: list, **columns) -> list:
    """Runs code with exec() that sleeps past the call's time limit: no module is being
    imported."""
    exec("import time\nwhile True: time.sleep(0.05)", {"__name__": "__reward__"})
    return [0.0] * len(completions)


def planting_reward(prompts: list, completions: list, **columns) -> list:
    """'plant' leaves files and module state (1.0); anything else scores 1.0 if it finds
    what a plant left, else 0.0."""
    out = []
    for text in completions:
        if text == "plant":
            plant("planted")
            out.append(1.0)
        else:
            found = json.loads(find("planted"))
            out.append(float(bool(found["files"] or found["marks"])))
    return out


def keyring_reward(prompts: list, completions: list, **columns) -> list:
    """1.0 if the trainer's session keyring can be read from the call, else 0.0."""
    return [float(os.environ["LEANGRPO_TEST_KEY_SECRET"] in read_keyring(completions[0]))] * len(
        completions
    )


def read_file(path: str) -> str:
    """Read a file's first bytes.

    Args:
        path: Its path.
    """
    return _attempt(lambda: _read(path))


def memory_cgroup() -> str:
    """The memory cgroup this process is in (from /proc/self/cgroup) and its limit."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if "memory" in names.split(","):
            limits = [f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"]
        elif names == "":
            limits = [f"{root}{path}/memory.max" for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")]
        else:
            continue
        for limit in filter(os.path.exists, limits):
            value = Path(limit).read_text().strip()
            limit_mb = int(value) >> 20 if value.isdigit() else value
            return json.dumps({"group": path, "limit_mb": limit_mb})
    return json.dumps({"group": None, "limit_mb": None})


PYTHON_SIGNALS = {"SIGINT": "default_int_handler", "SIGPIPE": "SIG_IGN", "SIGXFSZ": "SIG_IGN"}


def signal_state() -> str:
    """What this process inherited of signals: handlers other than a fresh interpreter's,
    the wakeup fd, and whether a child's exit (SIGCHLD) writes into a descriptor opened
    here (40 pipes: fds the zygote's wakeup fd may now name)."""
    import signal

    pipes = [os.pipe() for _ in range(40)]
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    time.sleep(0.05)
    stray = 0
    for read, write in pipes:
        os.set_blocking(read, False)
        with contextlib.suppress(BlockingIOError):
            stray += len(os.read(read, 4096))
        os.close(read)
        os.close(write)
    handlers = {}
    for signum in signal.valid_signals():
        with contextlib.suppress(ValueError, OSError):
            handler = signal.getsignal(signum)
            name = getattr(handler, "__name__", None) or getattr(handler, "name", str(handler))
            if handler not in (signal.SIG_DFL, None):
                handlers[signal.Signals(signum).name] = name
    wakeup = signal.set_wakeup_fd(-1)
    return json.dumps({"wakeup_fd": wakeup, "stray_bytes": stray, "handlers": handlers})


def other_scratch(other: str) -> str:
    """Look for other boxes' scratch directories beside this one's (HOME/TMPDIR), and write
    a file named `from-another-box` into `other` (another box's TMPDIR) unless it is "".

    Args:
        other: Another box's TMPDIR, or "".
    """
    mine = os.environ["TMPDIR"]
    out = {"mine": mine}
    try:
        out["beside"] = sorted(set(os.listdir(os.path.dirname(mine))) - {os.path.basename(mine)})
    except OSError as e:
        out["beside"] = type(e).__name__
    if other:
        out["wrote"] = _attempt(lambda: _write(os.path.join(other, "from-another-box")))
        out["listed"] = _attempt(lambda: len(os.listdir(other)))
    return json.dumps(out)


def lift_memory_limit() -> str:
    """Raise this process's memory cgroup limit to 4 GiB, and move into its parent group."""
    group = json.loads(memory_cgroup())["group"]
    out = {"group": group}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if "memory" in names.split(","):
            base, limit = "/sys/fs/cgroup/memory", "memory.limit_in_bytes"
        elif names == "" and os.path.exists(f"/sys/fs/cgroup{path}/memory.max"):
            base, limit = "/sys/fs/cgroup", "memory.max"
        elif names == "":
            base, limit = "/sys/fs/cgroup/unified", "memory.max"
        else:
            continue
        mine = f"{base}{path}"
        if limit == "memory.limit_in_bytes":  # v1: memory + swap first, never below memory
            swap = Path(f"{mine}/memory.memsw.limit_in_bytes")
            out["swap"] = _attempt(lambda p=swap: p.write_text(str(4 << 30)))
        out["limit"] = _attempt(lambda p=f"{mine}/{limit}": Path(p).write_text(str(4 << 30)))
        parent = os.path.dirname(mine)
        out["leave"] = _attempt(lambda p=f"{parent}/cgroup.procs": Path(p).write_text("0"))
        break
    out["after"] = json.loads(memory_cgroup())
    return json.dumps(out)


def frozen_objects() -> str:
    """How many objects this process's garbage collector leaves alone (gc.freeze)."""
    import gc

    return str(gc.get_freeze_count())
