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
    """Compute for up to `seconds` of wall time.

    Args:
        seconds: How long.
    """
    end = time.monotonic() + seconds
    while time.monotonic() < end:
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
