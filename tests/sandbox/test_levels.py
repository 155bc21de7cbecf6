"""Which sandbox a worker gets (sandbox/levels.py): the strongest this machine offers, one
log line saying which; `namespace` where it cannot start is refused before the model
loads, in one sentence; `auto` there falls back to `process`, which still works. A machine
without user namespaces is made for real: a user namespace without a uid mapping (util-
linux's `unshare --user`) cannot create another."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support.configs import ROOT
from support.sandboxes import require_namespace

from leangrpo.config.environment import EnvironmentConfig
from leangrpo.sandbox.confine import BOX_TASKS
from leangrpo.sandbox.levels import SandboxPlan, plan_for

SRC = str(ROOT / "src")


def without_user_namespaces(*command: str) -> subprocess.CompletedProcess:
    """`command` where user namespaces cannot be made (inside one with no uid mapping)."""
    require_namespace()  # the outer namespace needs them here
    if shutil.which("unshare") is None:
        pytest.skip("util-linux's unshare is not installed")
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    return subprocess.run(["unshare", "--user", *command], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=600)  # fmt: skip


def test_the_default_is_the_namespace_where_it_starts():
    require_namespace()
    plan = plan_for(EnvironmentConfig(tools=["support.environments:add"]), "environment")
    assert plan.level == "namespace" and plan.reason == ""
    line = plan.describe()
    assert line.startswith(
        "environment workers: sandbox namespace (user, PID, IPC, mount and network"
    )
    assert "\n" not in line


def test_the_process_levels_line_says_ipc_is_shared_between_calls():
    """At `process` a box has no IPC namespace (its capabilities are gone before the
    zygote forks it): a System V segment one call makes is there for the next. The line
    says so."""
    cfg = EnvironmentConfig(tools=["support.environments:add"], sandbox={"level": "process"})
    line = plan_for(cfg, "environment").describe()
    assert "System V IPC and /dev/shm shared by every process of this user" in line, line


def test_namespace_where_it_cannot_start_is_refused_in_one_sentence_before_the_model(tmp_path):
    done = without_user_namespaces(
        sys.executable, "-m", "leangrpo", "train", "examples/tools_demo.yaml",
        "--set", "environment.sandbox.level=namespace", "--set", f"run.output_dir={tmp_path / 'run'}",
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(
        "leangrpo: error: environment.sandbox.level is 'namespace', but this machine cannot "
        "start one (unshare (user namespaces may be disabled here): Operation not permitted)"
    )
    assert line.endswith("or set environment.sandbox.level: process")
    assert not (tmp_path / "run").exists()  # refused before the run directory, or the model


AUTO_HERE = """
import json, logging, os, sys
sys.path.insert(0, "tests")
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
from support.hostile_tools import hermes
from leangrpo.config.environment import EnvironmentConfig
from leangrpo.environments.pool import EnvironmentPool
os.environ["HF_TOKEN"] = "hf_secret"
cfg = EnvironmentConfig(name="tools", tools=["support.hostile_tools:read_env"], num_workers=1)
with EnvironmentPool(cfg) as pool:
    (key,) = pool.new_sessions(1)
    pool.reset([(key, [{"role": "user", "content": "x"}], {}, 0)])
    (out,) = pool.step([(key, hermes("read_env", name="HF_TOKEN"), 0)])
    print("tool said", out.ok["reply"][0]["content"])
"""


def test_auto_falls_back_to_a_working_process_level_and_says_why():
    done = without_user_namespaces(sys.executable, "-c", AUTO_HERE)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    (said,) = [line for line in lines if line.startswith("environment workers: sandbox")]
    assert said.startswith(
        "environment workers: sandbox process, chosen because unshare (user namespaces may "
        "be disabled here): Operation not permitted (own session, allow-listed environment"
    )
    assert "tool said null" in lines  # the process level keeps the trainer's secret too


RLIMIT_FORKS = """
import json, os, sys, time
from leangrpo.sandbox.confine import confine, enter_namespace, limit_box_tasks
spec = json.loads(sys.argv[1])
enter_namespace(spec, os.open(os.devnull, os.O_RDONLY))
confine(spec)
tasks = sum(len(os.listdir(f"/proc/{p}/task")) for p in os.listdir("/proc") if p.isdigit())
limit_box_tasks(spec, tasks)  # as a box does, before user code
started = 0
for _ in range(64):  # bounded: never more than 64, whatever the limit does
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    started += 1
print(started, flush=True)
os._exit(0)  # the namespace's init: its end ends the children
"""


def readable_copy_of_the_package(folder: str) -> str:
    """src/leangrpo copied under `folder`, readable by every user (nobody cannot read a
    checkout in a 0700 folder, such as CI's `mktemp -d` clone); returns what to put on
    PYTHONPATH."""
    src = Path(folder) / "src"
    shutil.copytree(Path(SRC) / "leangrpo", src / "leangrpo",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    for path in [Path(folder), src, *src.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return str(src)


def test_a_non_root_worker_bounds_its_processes_in_its_user_namespace():
    """RLIMIT_NPROC counts the user namespace's own tasks (Linux >= 5.14): what bounds a
    non-root trainer's worker. As root, the test drops to nobody with the system Python
    (the launcher and confine.py need only the standard library)."""
    require_namespace()
    command = [sys.executable]
    if os.geteuid() == 0:
        python = Path("/usr/bin/python3")
        if not python.exists() or shutil.which("setpriv") is None:
            pytest.skip("running as root, and no system python3 or setpriv to drop to nobody")
        command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(python)]
    scratch, package = (tempfile.mkdtemp(prefix=f"leangrpo-test-{n}-") for n in ("scratch", "src"))
    try:
        plan = SandboxPlan("rewards", "namespace", max_processes=4, scratch_mb=1)
        spec = {**plan.worker_spec(scratch, []), "nproc_limit": True}
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": readable_copy_of_the_package(package),
               "PYTHONDONTWRITEBYTECODE": "1"}  # fmt: skip
        done = subprocess.run([*command, "-c", RLIMIT_FORKS, json.dumps(spec)], env=env,
                              capture_output=True, text=True, timeout=120, cwd="/")  # fmt: skip
    finally:
        os.rmdir(scratch)
        shutil.rmtree(package)
    assert done.returncode == 0, done.stderr
    started = int(done.stdout.split()[-1])
    assert 0 < started <= 4 + BOX_TASKS < 64


def test_a_kernel_without_mount_setattr_falls_back_to_process(monkeypatch):
    """Linux < 5.12 cannot make the whole filesystem read-only at once: no probe is run,
    auto says why, namespace is refused."""
    from leangrpo.sandbox import levels

    monkeypatch.setattr(levels, "_kernel", lambda: (5, 4))
    monkeypatch.setattr(levels, "_probed", {})
    plan = plan_for(EnvironmentConfig(tools=["support.environments:add"]), "environment")
    assert (plan.level, plan.reason) == ("process", "Linux 5.4 predates mount_setattr (5.12)")
    cfg = EnvironmentConfig(tools=["support.environments:add"], sandbox={"level": "namespace"})
    with pytest.raises(levels.SandboxError, match=r"cannot start one \(Linux 5.4 predates"):
        plan_for(cfg, "environment")
