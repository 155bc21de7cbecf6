"""Each reward call and each trajectory in a box of its own (issue 36, sandbox/box.py): what
one call or trajectory does reaches neither another, nor the next, nor the trainer's
scores. Every test here failed before boxes: a forked child forged a whole call's scores;
files and module state outlived a call; one trajectory wrote into another's process; undeclared
reward terms reached the total; a memfd and several processes held past memory_limit_mb;
the trainer's session keyring was readable; a nested user namespace gave capabilities
back."""

from __future__ import annotations

import contextlib
import ctypes
import glob
import json
import os
import subprocess
import sys
import time

import pytest
from support.configs import ROOT, rewards_section
from support.hostile_tools import PYTHON_SIGNALS, hermes
from support.sandboxes import require_namespace

from leangrpo.config.environment import EnvironmentConfig
from leangrpo.contracts import Completion, Prompt, RolloutSample
from leangrpo.environments.pool import EnvironmentPool
from leangrpo.rewards import RewardPool
from leangrpo.sandbox import cgroups, levels
from leangrpo.sandbox import process as worker_process
from leangrpo.sandbox.confine import landlock_abi

USER = [{"role": "user", "content": "go"}]
LEVELS = ["namespace", "process"]
TOOLS = ["hold_memory", "memory_cgroup", "plant", "find", "read_keyring", "nested_userns", "attack_tagged",
         "forge_terms", "read_file", "signal_state", "other_scratch",
         "lift_memory_limit", "write_file", "frozen_objects"]  # fmt: skip
KEY, SECRET = "leangrpo-test-token", "hf_keyring_secret_for_the_test"


def level_here(level: str) -> str:
    if level == "namespace":
        require_namespace()
    return level


def tools_pool(level: str, name: str = "tools", **fields) -> EnvironmentPool:
    sandbox = {"level": level_here(level), "scratch_mb": 16, **fields.pop("sandbox", {})}
    cfg = EnvironmentConfig(name=name, tools=[f"support.hostile_tools:{t}" for t in TOOLS],
                            num_workers=1, timeout_s=30.0, tool_timeout_s=30.0,
                            sandbox=sandbox, **fields)  # fmt: skip
    return EnvironmentPool(cfg)


def trajectory(pool: EnvironmentPool, tool: str, row: dict | None = None, **arguments):
    """One trajectory calling `tool` once: (its step's outcome, its key; finished)."""
    (key,) = pool.new_sessions(1)
    (reset,) = pool.reset([(key, USER, row or {}, 0)])
    assert reset.error is None, reset.error
    (out,) = pool.step([(key, hermes(tool, **arguments), 0)])
    pool.finish([(key, "stop")])
    return out


def text(out) -> str:
    assert out.error is None, out.error
    return out.ok["reply"][0]["content"]


def samples(texts: list[str], prompts: list[int]) -> list[RolloutSample]:
    return [
        RolloutSample(p, Prompt(p, "q", [1]), Completion([1], t, [0.0], "stop", 0))
        for t, p in zip(texts, prompts)
    ]


# -- the channel -----------------------------------------------------------------------------


@pytest.mark.parametrize("level", LEVELS)
def test_a_forked_child_cannot_forge_its_calls_scores(level):
    """HumanEval's check_correctness pattern: the program runs in a forked child, which
    writes well-formed replies scoring the whole call 1.0 on every socket it holds."""
    cfg = rewards_section(
        "support.hostile_tools:forking_forger", sandbox={"level": level_here(level)}
    )
    batch = samples(["forge", "honest", "honest"], [0, 0, 0])  # one prompt: one call
    with RewardPool(cfg) as pool:
        metrics = pool.score(batch)
    assert [s.rewards["forking_forger"] for s in batch] == [None, 0.0, 0.0]
    assert metrics["reward/forking_forger/failures"] == 1.0  # the forger's own call, counted


@pytest.mark.parametrize("level", LEVELS)
def test_undeclared_reward_terms_never_reach_the_trainer(level):
    """Code run in the trajectory's process rewrites its replies to carry the term
    'forged' (the tools environment declares none): that item fails, a later trajectory
    is untouched."""
    with tools_pool(level) as pool:
        assert pool.reward_terms == ()
        forged = trajectory(pool, "forge_terms")
        later = trajectory(pool, "find", name="x")
    assert forged.ok is None and "'forged'" in forged.error, forged
    assert later.error is None and later.ok["rewards"] == {}


def test_the_trainer_itself_refuses_undeclared_reward_terms(monkeypatch):
    """A worker whose supervisor skips its check (support/lying_env_worker.py) sends the
    term 'forged' the environment never declared: the pool's own check fails the item."""
    spawn = EnvironmentPool._spawn

    def lying(pool: EnvironmentPool, slot: int):
        pool._init["entry"] = "support.lying_env_worker"
        return spawn(pool, slot)

    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests"))
    monkeypatch.setattr(EnvironmentPool, "_spawn", lying)
    with tools_pool("process") as pool:
        assert pool.reward_terms == ()
        out = trajectory(pool, "find", name="x")
    assert out.ok is None and "'forged'" in out.error, out


@pytest.mark.parametrize("level", LEVELS)
def test_a_box_starts_with_a_fresh_interpreters_signals(level):
    """The zygote waits on a signal wakeup fd and a SIGCHLD handler; a box inheriting them
    had a child's exit write a byte into whatever descriptor now has the wakeup fd's number
    (a file, a pipe, the reply socket): each box resets both before user code runs."""
    with tools_pool(level) as pool:
        state = json.loads(text(trajectory(pool, "signal_state")))
    handlers = {**PYTHON_SIGNALS, "SIGUSR1": "_on_signal", "SIGXCPU": "_on_signal"}  # calls.py's
    assert state == {"wakeup_fd": -1, "stray_bytes": 0, "handlers": handlers}, state


def test_a_boxs_collections_leave_the_zygotes_objects_alone():
    """The zygote freezes what it imported (gc.freeze) before it forks: a box's garbage
    collections then never walk those objects, which would copy every page of them (a
    box forked from a worker that imported math-verify cost 7x more per call)."""
    with tools_pool("process") as pool:
        frozen = int(text(trajectory(pool, "frozen_objects")))
    assert frozen > 10_000, frozen


# -- between calls and trajectories ----------------------------------------------------------


@pytest.mark.parametrize("level", LEVELS)
def test_what_a_call_leaves_reaches_no_other_call(level, monkeypatch):
    """Files in HOME/TMPDIR (and /dev/shm: namespace level) and module state: gone for
    another prompt's call in the same scoring and for the next scoring."""
    if level == "process":  # its /dev/shm is the machine's (docs/sandbox.md)
        monkeypatch.setenv("LEANGRPO_TEST_PLACES", "tmp")
    sandbox = {"level": level_here(level), "pass_env": ["LEANGRPO_TEST_PLACES"]}
    cfg = rewards_section("support.hostile_tools:planting_reward", sandbox=sandbox)
    with RewardPool(cfg) as pool:
        first = samples(["plant", "find"], [0, 1])
        pool.score(first)
        later = samples(["find"], [2])
        pool.score(later)
    assert [s.reward for s in first + later] == [1.0, 0.0, 0.0]


def test_a_samples_program_cannot_reach_its_siblings():
    """A unit-test reward runs each sample's program; one leaves a detached process that
    kills the later programs of its call, its GRPO group's siblings: they scored 0 and its
    advantage rose. A user function now gets one sample per call, a box of its own; a
    built-in (which never executes model text) keeps its chunks."""
    cfg = rewards_section("support.hostile_tools:box_sharers_reward", ("length", 1.0, {"target": 5}),
                          sandbox={"level": "process"})  # fmt: skip
    batch = samples(["a", "b", "c", "d"], [0, 0, 0, 0])  # one prompt's group
    with RewardPool(cfg) as pool:
        pool.score(batch)
        sizes = {call.fn: len(call.indices) for call in pool._initial_calls(batch)}
    assert [s.rewards["box_sharers_reward"] for s in batch] == [1.0] * 4
    assert sizes == {0: 1, 1: 4}, sizes


def test_a_program_cannot_forge_its_calls_limit():
    """The program a reward runs sends its reward's process SIGUSR1 and SIGXCPU (the
    signals of the wall-time and CPU limits): they were taken as a timeout, and the wrong
    program was left unscored (advantage 0) instead of scoring 0.0."""
    cfg = rewards_section("support.hostile_tools:forged_limit_reward", cpu_time_limit_s=30.0,
                          sandbox={"level": "process"})  # fmt: skip
    batch = samples(["wrong"], [0])
    with RewardPool(cfg) as pool:
        metrics = pool.score(batch)
    assert batch[0].reward == 0.0, metrics
    assert not any(v for k, v in metrics.items() if "failures" in k or "timeouts" in k), metrics


@pytest.mark.parametrize("level", LEVELS)
def test_a_forked_child_holds_no_way_past_the_output_meter(level):
    """The meter's descriptor to the trainer's pipe was close-on-exec only: a child forked
    from the call kept it and wrote past max_output_bytes (and the meter's count)."""
    cfg = rewards_section("support.hostile_tools:forked_pipes_reward",
                          sandbox={"level": level_here(level)})  # fmt: skip
    batch = samples(["x"], [0])
    with RewardPool(cfg) as pool:
        pool.score(batch)
    assert batch[0].reward == 0.0


@pytest.mark.parametrize("level", LEVELS)
def test_a_reward_printing_without_end_fails_at_its_output_limit(level, caplog):
    """A reward call's box writes into the supervisor's pipe directly (no meter thread in
    it: one call per box), so the supervisor counts what it prints: past max_output_bytes
    the call fails as "output limit" and its box is killed; at most 64 KiB of lines reach
    the log; the other function's calls are scored."""
    cfg = rewards_section("support.hostile_tools:flooding_reward", ("length", 1.0, {"target": 1}),
                          sandbox={"level": level_here(level), "max_output_bytes": 65536})  # fmt: skip
    batch = samples(["x", "y"], [0, 1])
    with caplog.at_level("INFO", logger="leangrpo.rewards"), RewardPool(cfg) as pool:
        metrics = pool.score(batch)
    assert [s.rewards["flooding_reward"] for s in batch] == [None, None], metrics
    assert [s.rewards["length"] for s in batch] == [1.0, 1.0], metrics
    assert metrics["reward/output_failures"] == 2, metrics
    said = [r.getMessage() for r in caplog.records]
    assert any("printed more than 65536 bytes" in line for line in said), said
    assert 0 < sum("spam" in line for line in said) <= (64 << 10) // 1000 + 1


def test_a_timeout_in_exec_code_names_no_import(caplog):
    """Code run with exec() is a "<module>" frame too: the timeout said "while importing
    __reward__" (and retired the worker as if an import had been cut)."""
    cfg = rewards_section("support.hostile_tools:import_interrupted_reward", timeout_s=1.0,
                          sandbox={"level": "process"})  # fmt: skip
    batch = samples(["x"], [0])
    with caplog.at_level("WARNING", logger="leangrpo.rewards"), RewardPool(cfg) as pool:
        pool.score(batch)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert batch[0].reward is None and "timed out after 1 s" in said, said
    assert "while importing" not in said, said


@pytest.mark.parametrize("level", LEVELS)
def test_what_a_trajectory_leaves_reaches_no_later_one(level, monkeypatch):
    if level == "process":
        monkeypatch.setenv("LEANGRPO_TEST_PLACES", "tmp")
    with tools_pool(level, sandbox={"pass_env": ["LEANGRPO_TEST_PLACES"]}) as pool:
        assert text(trajectory(pool, "plant", name="planted")) == "planted"
        found = json.loads(text(trajectory(pool, "find", name="planted")))
    assert found == {"files": [], "marks": []}


def test_a_scratch_tree_of_any_depth_is_removed(tmp_path, monkeypatch):
    """A `process`-level call leaves a tree 1,500 levels deep in its scratch (a directory
    on disk): shutil.rmtree raised RecursionError there (ignore_errors does not cover it),
    which killed the zygote and then the trainer's own clean-up. The zygote removes the
    box's scratch and lives on (the next call is scored on the same worker), and the
    worker's scratch goes with it whole."""
    monkeypatch.setattr(worker_process, "SCRATCH_BASE", str(tmp_path))
    cfg = rewards_section("support.hostile_tools:deep_scratch_reward", sandbox={"level": "process"})
    try:
        with RewardPool(cfg) as pool:
            worker = pool._workers[0]
            first, later = samples(["deep"], [0]), samples(["fine"], [1])
            pool.score(first)
            deadline = time.monotonic() + 60  # a liveness bound: the zygote removes it
            while glob.glob(f"{worker.scratch}/*/d") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not glob.glob(f"{worker.scratch}/*/d")
            pool.score(later)
            assert pool._workers[0] is worker  # not replaced: its zygote lived on
        assert [s.reward for s in first + later] == [0.0, 1.0]
        assert list(tmp_path.iterdir()) == []
    finally:  # never leave the tree to pytest's own (recursive) clean-up
        subprocess.run(["rm", "-rf", "--", str(tmp_path)], check=False)


@pytest.mark.parametrize("level", LEVELS)
def test_a_box_cannot_reach_another_boxs_scratch(level, monkeypatch):
    """Trajectory B is live; trajectory A, on the same worker, gets B's TMPDIR and writes
    there, and looks beside its own for other boxes' (B's, the spare box's): at
    `namespace` B's path is A's own tmpfs, at `process` a Landlock domain per box refuses
    what is not its own. B never sees the file."""
    if level == "process":
        monkeypatch.setenv("LEANGRPO_TEST_PLACES", "tmp")
    with tools_pool(level, sandbox={"pass_env": ["LEANGRPO_TEST_PLACES"]}) as pool:
        if level == "process" and landlock_abi() < 1:  # the documented fallback
            assert "no Landlock in this kernel" in pool.plan.describe(), pool.plan.describe()
            return
        (b,) = pool.new_sessions(1)
        assert pool.reset([(b, USER, {}, 0)])[0].error is None
        (step,) = pool.step([(b, hermes("other_scratch", other=""), 0)])
        b_scratch = json.loads(text(step))["mine"]
        a = json.loads(text(trajectory(pool, "other_scratch", other=b_scratch)))
        (step,) = pool.step([(b, hermes("find", name="from-another-box"), 0)])
        pool.finish([(b, "stop")])
    assert json.loads(text(step))["files"] == [], (a, text(step))
    if level == "process":
        assert a["beside"] == "PermissionError", a
        assert a["wrote"].startswith("PermissionError") and a["listed"].startswith("Perm"), a


def test_a_process_level_box_writes_where_its_user_may(tmp_path):
    """What the Landlock domain of a `process`-level box leaves as it was: files anywhere
    its user may write, directly in /tmp too (the scratch directories are elsewhere);
    but /proc and /sys are read-only."""
    made = f"/tmp/leangrpo-test-{os.getpid()}"
    try:
        with tools_pool("process") as pool:
            if landlock_abi() < 1:  # the documented fallback: nothing is restricted
                assert "no Landlock in this kernel" in pool.plan.describe()
                return
            wrote = [text(trajectory(pool, "write_file", path=path))
                     for path in (str(tmp_path / "state.json"), made, "/proc/self/comm")]  # fmt: skip
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(made)
    assert wrote[:2] == ["ok 1", "ok 1"] and wrote[2].startswith("PermissionError"), wrote


@pytest.mark.parametrize("level", LEVELS)
def test_a_trajectory_cannot_reach_another_trajectorys_processes(level):
    """Trajectory B keeps a process reading its stdin (a REPL); trajectory A, on the same
    worker, looks for it: at `namespace` it is not there to find (its own PID namespace);
    at `process` writing to its stdin, reading its memory, signalling and ptracing it are
    refused (a Landlock domain per box, non-dumpable, the system-call filter)."""
    tag = f"leangrpo-helper-{os.getpid()}"
    with tools_pool(level, name="support.environments:KeepsHelper") as pool:
        (b,) = pool.new_sessions(1)
        assert pool.reset([(b, USER, {"tag": tag}, 0)])[0].error is None
        found = json.loads(text(trajectory(pool, "attack_tagged", {"tag": "other"}, tag=tag)))
        pool.finish([(b, "stop")])
    if level == "namespace":
        assert found == {}
    else:  # the attacker found B's helper: the refusals below are not vacuous
        assert found, found
    for attempts in found.values():
        assert not any(attempts[k].startswith("ok") for k in ("stdin", "mem", "signal")), found
        assert attempts["ptrace"] != "attached", found


@pytest.mark.parametrize("level", LEVELS)
def test_a_call_cannot_hold_more_than_its_memory_limit(level):
    """A memfd filled with write() (never mapped: RLIMIT_AS does not see it), then three
    processes each under the limit, at once and one after another: the call's memory
    cgroup, joined before the box runs anything, stops both. What counts is what the
    processes hold at the same time: the kernel kills the largest, which may be one whose
    report was already read (the CI failure "360 <= 256" counted such a report)."""
    with tools_pool(level, memory_limit_mb=256) as pool:
        if not pool.plan.memory_cgroup:
            if os.environ.get("CI") and os.geteuid() == 0:
                pytest.fail(f"CI, as root, must bound a call's memory with a cgroup (is "
                            f"/sys/fs/cgroup writable?): {pool.plan.describe()}")  # fmt: skip
            assert_memory_bounded_per_process(pool)
            return
        own = json.loads(text(trajectory(pool, "memory_cgroup")))
        assert own["group"].rsplit("/", 1)[-1].startswith("box-") and own["limit_mb"] == 256, own
        for args in ({"memfd_mb": 400, "processes": 0, "mb_each": 0},
                     {"memfd_mb": 0, "processes": 3, "mb_each": 120},
                     {"memfd_mb": 0, "processes": 3, "mb_each": 120, "one_at_a_time": True}):  # fmt: skip
            out = trajectory(pool, "hold_memory", **args)
            if out.error is None:  # the tool lived on: what it held is what counts
                assert json.loads(text(out))["held_mb"] <= 256, out
            else:
                assert "memory limit" in out.error, out


@pytest.mark.parametrize("level", LEVELS)
def test_a_box_cannot_lift_its_own_memory_limit(level):
    """The box's cgroup files are out of its reach: it can neither raise its limit nor move
    into its worker's group (uid 0 owns them, and a root box without capabilities still
    passes their permission checks: at `namespace` /sys is read-only, at `process` its
    Landlock domain makes it so)."""
    with tools_pool(level, memory_limit_mb=256) as pool:
        if not pool.plan.memory_cgroup:
            if os.environ.get("CI") and os.geteuid() == 0:
                pytest.fail(f"CI, as root, must bound a call's memory with a cgroup: "
                            f"{pool.plan.describe()}")  # fmt: skip
            assert_memory_bounded_per_process(pool)
            return
        if level == "process" and landlock_abi() < 1:  # the documented fallback
            assert "no Landlock in this kernel" in pool.plan.describe(), pool.plan.describe()
            return
        out = json.loads(text(trajectory(pool, "lift_memory_limit")))
    assert not out["limit"].startswith("ok") and not out["leave"].startswith("ok"), out
    assert out["after"] == {"group": out["group"], "limit_mb": 256}, out


@pytest.mark.parametrize("level", LEVELS)
def test_without_a_memory_cgroup_memory_is_bounded_per_process(level, monkeypatch):
    """The documented fallback where no memory cgroup can be made (not root, a read-only
    /sys/fs/cgroup): the log line says so, and RLIMIT_AS still stops one process."""
    monkeypatch.setattr(levels, "hierarchies", dict)  # what a machine without one finds
    with tools_pool(level, memory_limit_mb=256) as pool:
        assert not pool.plan.memory_cgroup
        assert_memory_bounded_per_process(pool)


def test_without_swap_accounting_a_box_is_kept_out_of_swap(tmp_path, monkeypatch):
    """A cgroup v1 kernel without swap accounting (no memory.memsw.*: swapaccount=0) would
    let a box's pages go to swap past its limit; its swappiness 0 keeps them in memory."""
    written = {}

    def write_at(fd: int, path: str, text: str) -> None:
        if path.endswith("memsw.limit_in_bytes"):
            raise FileNotFoundError(path)
        written[path] = text

    monkeypatch.setattr(cgroups, "_write_at", write_at)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        v1 = [{"path": str(tmp_path), "version": 1, "controllers": ["memory"]}]
        name = cgroups.BoxGroups(v1, [fd], memory_mb=256, pids=8).make()
    finally:
        os.close(fd)
    assert written == {f"{name}/memory.limit_in_bytes": str(256 << 20),
                       f"{name}/memory.swappiness": "0"}  # fmt: skip


def assert_memory_bounded_per_process(pool: EnvironmentPool) -> None:
    assert "256 MB of memory per process only" in pool.plan.describe(), pool.plan.describe()
    out = trajectory(pool, "hold_memory", memfd_mb=0, processes=1, mb_each=400)
    assert json.loads(text(out))["each"] == [0, 0], out  # the 400 MB process could not


# -- the kernel's surface ----------------------------------------------------------------------


@pytest.fixture
def keyring_secret():
    """A session keyring of this (the trainer's) process holding a user key."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(250, 1, None) < 0:  # KEYCTL_JOIN_SESSION_KEYRING, anonymous (x86-64)
        pytest.skip("no session keyring here (keyctl refused)")
    key = libc.syscall(248, b"user", KEY.encode(), SECRET.encode(), len(SECRET), ctypes.c_long(-3))
    assert key >= 0
    yield SECRET
    libc.syscall(250, 3, key)  # KEYCTL_REVOKE


@pytest.mark.parametrize("level", LEVELS)
def test_the_trainers_keyring_is_out_of_reach(level, keyring_secret, monkeypatch):
    with tools_pool(level) as pool:
        got = text(trajectory(pool, "read_keyring", description=KEY))
    assert got == "search: EPERM", got  # keyctl is refused by the system-call filter
    monkeypatch.setenv("LEANGRPO_TEST_KEY_SECRET", keyring_secret)
    cfg = rewards_section("support.hostile_tools:keyring_reward",
                          sandbox={"level": level, "pass_env": ["LEANGRPO_TEST_KEY_SECRET"]})  # fmt: skip
    with RewardPool(cfg) as rewards:
        batch = samples([KEY], [0])
        rewards.score(batch)
    assert batch[0].reward == 0.0


@pytest.mark.parametrize("level", LEVELS)
def test_a_nested_user_namespace_is_refused(level):
    with tools_pool(level) as pool:
        found = json.loads(text(trajectory(pool, "nested_userns")))
    assert found["unshare"] == "EPERM" and found["clone"] == "EPERM", found
    assert found["caps"].strip("0") == "" and found["vsock"] == "EAFNOSUPPORT", found


@pytest.mark.parametrize("level", LEVELS)
def test_a_box_reads_what_the_trainer_can_read(level, tmp_path):
    """What the threat table says stays open: a dataset with its answers, readable by the
    trainer's user, is readable in a box (read-only). Keep answers out of its reach."""
    answers = tmp_path / "answers.jsonl"
    answers.write_text('{"answer": "42"}\n')
    with tools_pool(level) as pool:
        assert text(trajectory(pool, "read_file", path=str(answers))) == "ok 17"


CLIENT = """
import os, socket, sys
host, port = os.environ["LEANGRPO_ENDPOINT"].removeprefix("http://").split(":")
with socket.create_connection((host, int(port)), timeout=10) as s:
    s.sendall(sys.stdin.read().encode())
    s.shutdown(socket.SHUT_WR)
    print("endpoint:", s.recv(100).decode())
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2).close()
    print("outside: reached")
except OSError as e:
    print("outside:", type(e).__name__)
"""


def test_a_command_in_a_box_reaches_its_forwarded_endpoint_only(tmp_path):
    """The box API's command half (what agent episodes use): stdin and stdout are pipes,
    and the one place a box without network reaches is the endpoint forwarded into it."""
    import socket
    import threading

    require_namespace()
    path = str(tmp_path / "endpoint.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen()
    outside = socket.socket()
    outside.bind(("127.0.0.1", 0))
    outside.listen()

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"pong:" + conn.recv(100))

    threading.Thread(target=answer, daemon=True).start()
    try:
        argv = [sys.executable, "-c", CLIENT, str(outside.getsockname()[1])]
        out = run_command("namespace", argv, stdin="ping", forward=path)
    finally:
        server.close()
        outside.close()
    assert out.splitlines() == ["endpoint: pong:ping", "outside: ConnectionRefusedError"]


@pytest.mark.parametrize("level", LEVELS)
def test_a_command_in_a_box_starts_with_default_signals(level):
    """Exec keeps what is ignored and blocked: a command inherited the worker's ignored
    SIGINT and Python's ignored SIGPIPE (a pipeline that never ends on a closed reader)."""
    out = run_command(level_here(level), ["grep", "-E", "^Sig(Ign|Blk)", "/proc/self/status"])
    masks = dict(zip(out.split()[::2], (int(m, 16) for m in out.split()[1::2])))
    # signals 32 and 33 are glibc's own (threads' cancellation and set*id): no library call
    # may change them, and a process that runs the tests (pytest-xdist's workers) may have
    # them ignored; every signal a program can use starts at its default
    glibc = (1 << 31) | (1 << 32)
    assert masks == {"SigBlk:": masks["SigBlk:"] & glibc, "SigIgn:": masks["SigIgn:"] & glibc}, out


def run_command(level: str, argv: list[str], stdin: str = "", forward: str | None = None) -> str:
    """What `argv`, run in a box of a worker at `level` (support/box_entry.py), prints."""
    from leangrpo.sandbox.frames import FrameReader
    from leangrpo.sandbox.levels import SandboxPlan
    from leangrpo.sandbox.process import OutputBudget, WorkerProcess

    init = {"entry": "support.box_entry", "mode": "serve", "forward": forward, "stdin": stdin,
            "argv": argv}  # fmt: skip
    replies = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(ROOT / "tests"))
        worker = WorkerProcess(init, "box test", OutputBudget(), parse=lambda p: json.loads(p),
                               plan=SandboxPlan("environment", level))  # fmt: skip
    try:
        worker.sock.settimeout(60)
        reader = FrameReader()
        while not any(r.get("t") == "result" for r in replies):
            replies += [json.loads(p) for p in reader.feed(worker.sock.recv(1 << 16))]
    finally:
        worker.kill()
    (result,) = [r for r in replies if r["t"] == "result"]
    return result["out"]
