"""One worker process (sandbox/process.py, launch.py): a worker whose trainer dies without
closing its pool (SIGKILL) ends with its whole tree, the processes its calls keep
included, and its scratch directory is removed by the next trainer; a released worker's
scratch directory and cgroup go with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from support.configs import ROOT
from support.hostile_tools import make_deep_tree
from support.sandboxes import require_namespace

from leangrpo.config.environment import EnvironmentConfig
from leangrpo.environments.pool import EnvironmentPool
from leangrpo.sandbox import process as worker_process
from leangrpo.sandbox.confine import SCRATCH_PREFIX

TRAINER = """
import os, sys, time
sys.path.insert(0, "tests")
from leangrpo.config.environment import EnvironmentConfig
from leangrpo.environments.pool import EnvironmentPool
from leangrpo.sandbox import process as worker_process
cfg = EnvironmentConfig(name="support.environments:KeepsProcess", num_workers=1,
                        sandbox={{"level": "{level}"}})
pool = EnvironmentPool(cfg)
(key,) = pool.new_sessions(1)
pool.reset([(key, [{{"role": "user", "content": "x"}}], {{"tag": "{tag}"}}, 0)])
print(pool._workers[0].pid, pool._workers[0].scratch, flush=True)
time.sleep(600)
"""


def live_with(tag: str) -> list[int]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["status"] != psutil.STATUS_ZOMBIE and any(tag in a for a in cmdline):
            found.append(proc.pid)
    return found


@pytest.mark.parametrize("level", ["namespace", "process"])
def test_a_worker_whose_trainer_is_killed_ends_with_its_tree(level, monkeypatch):
    if level == "namespace":
        require_namespace()
    tag = f"3002.{os.getpid()}{time.monotonic_ns() % 10**6}"
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER.format(level=level, tag=tag)],
                               cwd=ROOT, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        worker, scratch = trainer.stdout.readline().split()
        assert live_with(tag) and psutil.pid_exists(int(worker))  # the helper, kept
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        deadline = time.monotonic() + 60  # a liveness bound: the worker sees the hang-up
        while time.monotonic() < deadline and (live_with(tag) or _running(int(worker))):
            time.sleep(0.1)
        assert live_with(tag) == [] and not _running(int(worker))
    finally:
        trainer.kill()
        trainer.wait()
    assert os.path.isdir(scratch)  # the trainer died before it could remove it: the next
    monkeypatch.setattr(worker_process, "_cleaned", [])  # trainer's first worker does
    fresh = worker_process.scratch_directory()
    assert not os.path.exists(scratch) and os.path.isdir(fresh)
    os.rmdir(fresh)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("level", ["namespace", "process"])
def test_a_released_worker_leaves_no_scratch_directory_or_cgroup(level):
    if level == "namespace":
        require_namespace()
    cfg = EnvironmentConfig(name="support.environments:Again", num_workers=1,
                            sandbox={"level": level})  # fmt: skip
    pool = EnvironmentPool(cfg)
    worker = pool._workers[0]
    scratch, groups = worker.scratch, [g.path for g in worker.cgroups]
    assert os.path.isdir(scratch)
    if pool.plan.uses_cgroups():
        assert groups and all(os.path.isdir(g) for g in groups)
    pool.close()
    assert not os.path.exists(scratch)
    assert not any(os.path.exists(g) for g in groups)


def test_a_sandbox_that_cannot_be_set_up_is_one_init_error_line(tmp_path):
    """The launcher's own failure (here: the scratch mount point is gone) reaches the
    trainer as one init_error line and exit code 75, before any user code."""
    import json
    import socket

    from leangrpo.sandbox.frames import FrameReader
    from leangrpo.sandbox.launch import LAUNCH_CODE, SETUP_FAILED
    from leangrpo.sandbox.levels import SandboxPlan

    require_namespace()
    plan = SandboxPlan("environment", "namespace")
    missing = str(tmp_path / "gone")
    parent, child = socket.socketpair()
    with parent:
        proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCH_CODE, str(child.fileno()),
             json.dumps(plan.worker_spec(missing, []))],
            pass_fds=(child.fileno(),), env=plan.environment(str(tmp_path)),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        child.close()
        parent.settimeout(30)
        payloads = FrameReader().feed(parent.recv(1 << 16))
    assert proc.wait(timeout=30) == SETUP_FAILED, proc.stderr.read()
    (message,) = [json.loads(p) for p in payloads]
    assert message == {"t": "init_error", "fn": 0, "msg": (
        f"the sandbox (namespace) could not be set up: mount tmpfs on {missing}: No such file or directory")}  # fmt: skip


def test_the_next_trainer_removes_a_dead_trainers_scratch_of_any_depth(tmp_path, monkeypatch):
    """A killed trainer's scratch holds a tree 1,500 levels deep (what a call may leave):
    the next trainer's sweep removed it with shutil.rmtree, whose RecursionError stopped
    every later pool from starting."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"{SCRATCH_PREFIX}{dead.pid}-x"
    stale.mkdir()
    make_deep_tree(str(stale), 1500)
    monkeypatch.setattr(worker_process, "SCRATCH_BASE", str(tmp_path))
    monkeypatch.setattr(worker_process, "_cleaned", [])
    try:
        fresh = worker_process.scratch_directory()
        assert not stale.exists() and os.path.isdir(fresh)
    finally:  # never leave the tree to pytest's own (recursive) clean-up
        subprocess.run(["rm", "-rf", "--", str(tmp_path)], check=False)
