"""Hostile tools and rewards against the sandbox (issue 27, "Sandbox"): whatever runs in
an environment, tool or reward worker cannot read the trainer's environment, signal,
ptrace or read the trainer, leave a process behind, write outside its scratch directory
or reach the network (namespace level), exhaust memory, fork without bound or flood its
output; each limit it reaches is an error message to the model, counted. The process
level keeps what it promises (docs/sandbox.md, "What each level protects against"): the environment, the
trainer's memory, the processes, memory and output."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time

import psutil
import pytest
from support.configs import rewards_section
from support.hostile_tools import hermes
from support.sandboxes import require_namespace

from leangrpo.config.environment import EnvironmentConfig
from leangrpo.contracts import Completion, Prompt, RolloutSample
from leangrpo.environments.pool import EnvironmentPool
from leangrpo.rewards import RewardPool
from leangrpo.sandbox.confine import BOX_TASKS

USER = [{"role": "user", "content": "go"}]
TOOLS = ["attack", "read_env", "leave_processes", "write_file", "where", "connect", "connect_unix",
         "allocate", "fork_count", "fork_bomb", "flood", "burn"]  # fmt: skip
MAX_PROCESSES = 8
LIMITS = {"max_processes": MAX_PROCESSES, "max_output_bytes": 65536, "scratch_mb": 16}


def open_pool(level: str, **sandbox) -> EnvironmentPool:
    cfg = EnvironmentConfig(
        name="tools",
        tools=[f"support.hostile_tools:{n}" for n in TOOLS],
        num_workers=1,
        # wall-clock bounds far above what any call needs, so that only the limit under
        # test decides a verdict however busy the machine (a hang still ends, at 120 s)
        timeout_s=120.0,
        tool_timeout_s=120.0,
        cpu_time_limit_s=1.0,
        memory_limit_mb=2048,
        sandbox={"level": level, **LIMITS, "pass_env": ["LEANGRPO_TEST_PASSED"], **sandbox},
    )
    return EnvironmentPool(cfg)


@pytest.fixture(scope="module")
def pools():
    """One pool per level, started on first use (a worker start imports transformers),
    with a secret and a passed variable in the trainer's environment."""
    opened: dict[str, EnvironmentPool] = {}

    def get(level: str) -> EnvironmentPool:
        if level == "namespace":
            require_namespace()
        if level not in opened:
            opened[level] = open_pool(level)
        return opened[level]

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_TOKEN", "hf_secret_for_the_test")
        patch.setenv("LEANGRPO_TEST_PASSED", "passed on purpose")
        yield get
        for pool in opened.values():
            pool.close()


def call(pool: EnvironmentPool, tool: str, **arguments) -> tuple[str, dict]:
    """One trajectory calling one tool: (the tool message's text, the step's counts)."""
    (key,) = pool.new_sessions(1)
    (reset,) = pool.reset([(key, USER, {}, 0)])
    assert reset.error is None, reset.error
    (out,) = pool.step([(key, hermes(tool, **arguments), 0)])
    assert out.error is None, out.error
    pool.finish([(key, "stop")])
    return out.ok["reply"][0]["content"], out.ok["counts"]


def live_with(tag: str) -> list[int]:
    """Host pids of live processes whose command line holds `tag`."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["status"] != psutil.STATUS_ZOMBIE and any(tag in a for a in cmdline):
            found.append(proc.pid)
    return found


def worker_tree(pool: EnvironmentPool) -> list[psutil.Process]:
    """The processes below the worker's launcher: the supervisor, the zygote, the boxes
    (the trajectories' and the spare ones) and what they started."""
    return psutil.Process(pool._workers[0].pid).children(recursive=True)


def settles(condition, seconds: float = 10.0) -> bool:
    """`condition()` holds within `seconds` (a liveness bound: an ended box's tree is
    killed and reaped asynchronously)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def zombies(pool: EnvironmentPool) -> list[psutil.Process]:
    found = []
    for proc in worker_tree(pool):
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.status() == psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


@pytest.mark.parametrize("level", ["namespace", "process"])
def test_a_tool_sees_only_allow_listed_and_passed_variables(pools, level):
    pool = pools(level)
    assert os.environ["HF_TOKEN"] == "hf_secret_for_the_test"
    assert call(pool, "read_env", name="HF_TOKEN")[0] == "null"
    assert call(pool, "read_env", name="LEANGRPO_TEST_PASSED")[0] == '"passed on purpose"'
    assert call(pool, "read_env", name="PATH")[0] == json.dumps(os.environ["PATH"])


def test_a_namespace_tool_cannot_signal_ptrace_or_read_the_trainer(pools):
    received = []
    previous = signal.signal(signal.SIGWINCH, lambda *a: received.append(a))
    try:
        text, _ = call(pools("namespace"), "attack", pid=os.getpid(), signals=True)
        time.sleep(0.2)
    finally:
        signal.signal(signal.SIGWINCH, previous)
    found = json.loads(text)
    assert received == []  # nothing reached the trainer, by pid, group or broadcast
    assert found["signal"].startswith("ProcessLookupError")  # the trainer is not in its world
    assert found["mem"].startswith("FileNotFoundError")
    assert found["environ"].startswith("FileNotFoundError")
    assert found["ptrace"] == "errno 1"  # EPERM: the system-call filter refuses ptrace


def test_a_process_level_tool_cannot_ptrace_or_read_the_trainer(pools):
    found = json.loads(call(pools("process"), "attack", pid=os.getpid(), signals=False)[0])
    assert found["mem"].startswith("PermissionError")  # the trainer is not dumpable
    assert found["environ"].startswith("PermissionError")
    assert found["ptrace"] == "errno 1"  # EPERM


def test_a_process_level_tool_cannot_ptrace_or_read_a_reward_worker(pools):
    """Workers run as the trainer's user: a dumpable reward worker's memory was open to a
    tool (/proc/<pid>/mem, ptrace), which could then rewrite the scores it returns."""
    cfg = rewards_section("support.hostile_tools:isolated", sandbox={"level": "process"})
    with RewardPool(cfg) as rewards:
        target = rewards._workers[0].pid
        found = json.loads(call(pools("process"), "attack", pid=target, signals=False)[0])
    assert found["mem"].startswith("PermissionError"), found
    assert found["environ"].startswith("PermissionError"), found
    assert found["ptrace"] == "errno 1"  # EPERM


@pytest.mark.parametrize("level", ["namespace", "process"])
def test_no_process_outlives_the_tool_call_that_started_it(pools, level):
    pool = pools(level)
    tag = f"3000.{os.getpid()}{time.monotonic_ns() % 10**6}"  # a valid, unique sleep time
    assert call(pool, "leave_processes", tag=tag)[0] == "left"
    assert live_with(tag) == []  # the sleeper and the daemon that left the session
    assert settles(lambda: not zombies(pool))


def test_a_namespace_tool_writes_only_its_scratch_directory(pools, tmp_path):
    pool = pools("namespace")
    outside = tmp_path / "pwned"
    assert "Read-only file system" in call(pool, "write_file", path=str(outside))[0]
    assert not outside.exists()
    for target in ("/etc/leangrpo-pwned", "/proc/sys/kernel/core_pattern", "/dev/leangrpo"):
        result = call(pool, "write_file", path=target)[0]
        assert result.startswith(("OSError", "PermissionError")), (target, result)
    places = json.loads(call(pool, "where")[0])
    scratch = pool._workers[0].scratch
    assert places["home"][0] == places["tmp"][0] == scratch
    assert places["home"][1] == places["shm"][1] == "ok 1"  # its scratch, its /dev/shm
    assert places["cwd"] == [os.getcwd(), f"OSError: [Errno 30] Read-only file system: '{os.getcwd()}/f'"]
    assert list(os.scandir(scratch)) == []  # a tmpfs of its own: the host directory stays empty


def test_a_namespace_tool_reaches_no_network_unless_allowed():
    require_namespace(network=True)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    try:
        with open_pool("namespace") as pool:
            assert call(pool, "connect", port=port)[0].startswith("ConnectionRefusedError")
        with open_pool("namespace", allow_network=True) as pool:  # the control: it can connect
            assert call(pool, "connect", port=port)[0] == "ok"
    finally:
        server.close()


def test_a_namespace_tool_reaches_no_unix_socket_daemon_unless_network_is_allowed(tmp_path):
    """A pathname unix socket is reached through the filesystem, not the network namespace,
    and its read-only mount does not stop connect(): a daemon listening under /tmp (tmux,
    vLLM's ipc sockets) was in reach of a tool without network."""
    require_namespace(network=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = str(tmp_path / "daemon.sock")
    server.bind(path)
    server.listen()
    try:
        with open_pool("namespace") as pool:
            found = json.loads(call(pool, "connect_unix", path=path)[0])
            assert found["connect"].startswith("PermissionError"), found
            assert found["socketpair"] == "ok"  # a tool's own pipes still work
        with open_pool("namespace", allow_network=True) as pool:  # the control: it can connect
            assert json.loads(call(pool, "connect_unix", path=path)[0])["connect"] == "ok"
    finally:
        server.close()


@pytest.mark.parametrize("level", ["namespace", "process"])
def test_memory_output_and_cpu_limits_are_error_messages_counted(pools, level):
    pool = pools(level)
    text, counts = call(pool, "allocate", mb=4096)
    assert text == "error: the tool ran out of memory under the 2048 MB limit (MemoryError)"
    assert counts["tool_limit/memory"] == 1.0 and counts["tool_errors"] == 1.0
    text, counts = call(pool, "flood", mb=4096)  # minutes of printing, were it not stopped
    assert text == "error: the tool printed more than 65536 bytes"  # not the 10 s timeout
    assert counts["tool_limit/output"] == 1.0
    text, counts = call(pool, "burn", seconds=8)
    assert text == "error: the tool used its CPU time after 1 s" and counts["tool_limit/cpu"] == 1.0
    assert call(pool, "allocate", mb=16)[0] == "allocated 16 MB"  # the worker lives on


@pytest.mark.parametrize("level", ["namespace", "process"])
def test_processes_are_bounded_and_a_fork_bomb_is_an_error_message(pools, level):
    pool = pools(level)
    if not pool.plan.process_limit:
        pytest.skip(f"no process limit at this level here: {pool.plan.describe()}")
    before = len(worker_tree(pool))
    started = int(call(pool, "fork_count", attempts=64)[0].split()[-1])  # bounded attempts
    assert 0 < started <= MAX_PROCESSES + BOX_TASKS < 64
    text, counts = call(pool, "fork_bomb", attempts=64)
    assert text.startswith(f"error: the tool could not start a process or thread (the limit is {MAX_PROCESSES})")
    assert counts["tool_limit/process"] == 1.0
    assert settles(lambda: len(worker_tree(pool)) <= before)  # the bomb's ended with its box
    assert call(pool, "fork_count", attempts=2)[0] == "forked 2"  # the limit is per call again


def test_a_reward_runs_isolated_too(tmp_path, monkeypatch, caplog):
    require_namespace()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    names = {"LEANGRPO_TEST_TRAINER": str(os.getpid()), "LEANGRPO_TEST_OUTSIDE": str(tmp_path / "x"),
             "LEANGRPO_TEST_PORT": str(server.getsockname()[1])}  # fmt: skip
    for name, value in names.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LEANGRPO_TEST_SECRET", "s3cr3t")  # set, not passed
    cfg = rewards_section("support.hostile_tools:isolated", sandbox={"pass_env": list(names)})
    sample = RolloutSample(0, Prompt(0, "q", [1]), Completion([1], "a", [0.0], "stop", 0))
    try:
        with caplog.at_level("INFO", logger="leangrpo.rewards"), RewardPool(cfg) as pool:
            pool.score([sample])
    finally:
        server.close()
    assert sample.reward == 1.0, [r.getMessage() for r in caplog.records if "isolation" in r.getMessage()]
    assert not (tmp_path / "x").exists()
    assert any("reward workers: sandbox namespace" in r.getMessage() for r in caplog.records)
