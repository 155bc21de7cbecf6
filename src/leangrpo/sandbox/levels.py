"""Which sandbox a worker runs in (trainer side): the level, whether this machine offers it,
the refusal, the one log line, and what a worker is started with.

`plan_for(section, key)` turns a section's `sandbox` settings (config/sandbox.py) and its
`memory_limit_mb` into a `SandboxPlan` (`check_level` is preflight's part of it):
- level `auto` is `namespace` where a probe (a throw-away worker that sets the namespace
  sandbox up and reports, run once per trainer process and network setting) succeeds, else
  `process` with the probe's reason; `namespace` asked for where the probe fails is a
  `SandboxError` of one sentence naming what is missing;
- every reward call and trajectory runs in a box of its own (box.py); a root trainer
  bounds each box with a memory cgroup (`memory_limit_mb`, tmpfs counted) and a pids
  cgroup (`max_processes`) where this machine has a writable hierarchy, v1 or v2
  (cgroups.py); otherwise memory is RLIMIT_AS per process and the process limit
  RLIMIT_NPROC inside the user namespace (counted per namespace since Linux 5.14), and
  the log line says so;
- a worker's environment is an allow-list (ENV_NAMES, LC_*, the section's `pass_env`)
  plus PYTHONPATH, PYTHONUNBUFFERED, and HOME / TMPDIR at its scratch directory: the
  trainer's tokens and keys stay in the trainer.
- `protect_trainer` makes the trainer non-dumpable before a process-level worker starts,
  so code running as the trainer's user without CAP_SYS_PTRACE (a root worker drops it)
  can neither ptrace it nor read its /proc/<pid>/mem or environ.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from leangrpo.errors import UserError
from leangrpo.sandbox.cgroups import hierarchies
from leangrpo.sandbox.confine import landlock_abi
from leangrpo.sandbox.files import remove_tree

ENV_NAMES = (
    "PATH", "LANG", "LANGUAGE", "TZ", "TERM", "LD_LIBRARY_PATH", "SSL_CERT_FILE",
    "SSL_CERT_DIR", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
    "TOKENIZERS_PARALLELISM", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "VIRTUAL_ENV", "CONDA_PREFIX",
)  # fmt: skip
ENV_PREFIXES = ("LC_",)
PROBE_CODE = "from leangrpo.sandbox.confine import probe; probe()"
PROBE_TIMEOUT_S = 30.0
_SRC = str(Path(__file__).resolve().parents[2])  # the directory holding the leangrpo package
_probed: dict[bool, str | None] = {}  # network -> None (namespace works) or the reason


class SandboxError(UserError):
    """The sandbox asked for cannot start here (one sentence naming what is missing)."""


@dataclass(frozen=True)
class SandboxPlan:
    key: str  # the config section: "environment" or "rewards"
    level: str  # "namespace" or "process" (auto resolved)
    network: bool = False
    scratch_mb: int = 256
    max_processes: int = 64
    max_output_bytes: int = 1 << 20
    memory_limit_mb: int | None = None
    pass_env: tuple[str, ...] = ()
    reason: str = ""  # why auto chose process
    process_limit: str = field(default="", compare=False)  # "cgroup", "rlimit" or ""
    memory_cgroup: bool = field(default=False, compare=False)  # a memory cgroup per box

    def worker_spec(self, scratch: str, cgroups: list[dict]) -> dict[str, Any]:
        """What the launched worker confines itself and its boxes with (confine.py)."""
        return {
            "level": self.level,
            "network": self.network,
            "scratch": scratch,
            "scratch_mb": self.scratch_mb,
            "max_processes": self.max_processes,
            "max_output_bytes": self.max_output_bytes,
            "memory_limit_mb": self.memory_limit_mb,
            "cgroups": cgroups,
            "nproc_limit": self.process_limit == "rlimit",
        }

    def boxes_share_a_process_count(self) -> bool:
        """Whether the boxes of one worker count their processes together: RLIMIT_NPROC
        (a non-root trainer) counts every task of the worker's one uid, where a pids
        cgroup is per box."""
        return self.process_limit == "rlimit"

    def boxes_own_network(self) -> bool:
        """Whether a box can have a network namespace of its own (its own loopback): at
        namespace level, in a worker without network."""
        return self.level == "namespace" and not self.network

    def uses_cgroups(self) -> bool:
        return self.process_limit == "cgroup" or self.memory_cgroup

    def environment(self, scratch: str) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if k in ENV_NAMES or k.startswith(ENV_PREFIXES) or k in self.pass_env
        }
        path = os.pathsep.join(p for p in (_SRC, os.environ.get("PYTHONPATH")) if p)
        env.update(PYTHONPATH=path, PYTHONUNBUFFERED="1", HOME=scratch, TMPDIR=scratch)
        return env

    def describe(self) -> str:
        """The start-up log line."""
        unit = "reward call" if self.key == "rewards" else "trajectory"
        if self.level == "namespace":
            spaces = "user, PID, IPC, mount" + ("" if self.network else " and network")
            what = (
                f"namespace ({spaces} namespaces; read-only filesystem; each {unit} in a "
                f"box of its own: own PID, mount and IPC namespaces, fresh {self.scratch_mb} "
                f"MB HOME/TMPDIR and /dev/shm; the trainer cannot be seen"
                f"{'' if self.network else '; no network'})"
            )
        else:
            why = f", chosen because {self.reason}" if self.reason else ""
            what = (
                f"process{why} (own session, allow-listed environment, no capabilities; "
                f"each {unit} a process of its own with a fresh HOME/TMPDIR, but System V "
                f"IPC and /dev/shm shared by every process of this user; {_apart()}; "
                "the trainer's memory cannot be read, but code running as its user can "
                "signal it and the filesystem is the trainer's)"
            )
        workers = "reward" if self.key == "rewards" else self.key
        return (
            f"{workers} workers: sandbox {what}; {self._process_text()}; "
            f"{self._memory_text(unit)}; at most {self.max_output_bytes} output bytes per call"
        )

    def _process_text(self) -> str:
        if self.process_limit:
            return f"at most {self.max_processes} processes"
        if os.geteuid() == 0:
            return "no process limit (no writable cgroup pids controller)"
        return "no process limit (RLIMIT_NPROC would count every process of this user)"

    def _memory_text(self, unit: str) -> str:
        if not self.memory_limit_mb:
            return "no memory limit"
        if self.memory_cgroup:
            return f"{self.memory_limit_mb} MB of memory per {unit} (memory cgroup, tmpfs counted)"
        return (
            f"{self.memory_limit_mb} MB of memory per process only (RLIMIT_AS: no writable "
            "memory cgroup here, so memfd, tmpfs and a call's several processes are not "
            "bounded together)"
        )


def _apart() -> str:
    """What keeps the boxes of a `process`-level worker apart (confine.py `domain_ruleset`)."""
    if landlock_abi() >= 1:
        return (
            "each box's scratch and processes out of the others' reach, /proc and /sys "
            "read-only (Landlock)"
        )
    return (
        "no Landlock in this kernel: the boxes of a worker can reach each other's scratch "
        "directories and processes, and a root box its own cgroup limits"
    )


def check_level(section: Any, key: str) -> None:
    """The start-up check (preflight, before the model loads): a `namespace` level this
    machine cannot start is refused (SandboxError). `auto` is resolved, with its probe,
    when the workers start."""
    if getattr(getattr(section, "sandbox", None), "level", "auto") == "namespace":
        plan_for(section, key)


def plan_for(section: Any, key: str) -> SandboxPlan:
    """The plan of a config section (`environment` or `rewards`); SandboxError when its
    sandbox.level is 'namespace' and this machine cannot start one."""
    cfg = getattr(section, "sandbox", None)
    asked = getattr(cfg, "level", "auto")
    network = bool(getattr(cfg, "allow_network", False))
    level, reason = asked, ""
    if asked in ("auto", "namespace"):
        failure = namespace_failure(network)
        if failure is not None and asked == "namespace":
            raise SandboxError(refusal(key, failure))
        level, reason = ("process", failure) if failure is not None else ("namespace", "")
    plan = SandboxPlan(
        key=key,
        level=level,
        network=network,
        scratch_mb=int(getattr(cfg, "scratch_mb", 256)),
        max_processes=int(getattr(cfg, "max_processes", 64)),
        max_output_bytes=int(getattr(cfg, "max_output_bytes", 1 << 20)),
        memory_limit_mb=getattr(section, "memory_limit_mb", None),
        pass_env=tuple(getattr(cfg, "pass_env", ())),
        reason=reason,
    )
    return _with_process_limit(plan)


def _with_process_limit(plan: SandboxPlan) -> SandboxPlan:
    found = hierarchies()
    how = ""
    if "pids" in found:
        how = "cgroup"
    elif os.geteuid() != 0 and plan.level == "namespace" and _kernel() >= (5, 14):
        how = "rlimit"
    return replace(plan, process_limit=how, memory_cgroup="memory" in found)


def refusal(key: str, failure: str) -> str:
    return (
        f"{key}.sandbox.level is 'namespace', but this machine cannot start one ({failure}); "
        "it needs Linux >= 5.12 with user namespaces allowed (root, or "
        "kernel.unprivileged_userns_clone = 1, user.max_user_namespaces > 0 and, on Ubuntu, "
        f"kernel.apparmor_restrict_unprivileged_userns = 0); or set {key}.sandbox.level: process"
    )


def namespace_failure(network: bool) -> str | None:
    """None if a namespace sandbox starts here, else why not (probed once per process)."""
    if network not in _probed:
        _probed[network] = _probe(network)
    return _probed[network]


def _probe(network: bool) -> str | None:
    if not sys.platform.startswith("linux"):
        return f"namespaces are Linux's, and this is {sys.platform}"
    if _kernel() < (5, 12):
        return f"Linux {'.'.join(map(str, _kernel()))} predates mount_setattr (5.12)"
    scratch = tempfile.mkdtemp(prefix="leangrpo-probe-")
    plan = SandboxPlan("probe", "namespace", network=network, scratch_mb=1)
    try:
        done = subprocess.run(
            [sys.executable, "-c", PROBE_CODE, json.dumps(plan.worker_spec(scratch, []))],
            env=plan.environment(scratch),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the probe failed: {type(e).__name__}: {e}"
    finally:
        remove_tree(scratch)
    if done.returncode == 0 and done.stdout.strip() == "ok":
        return None
    lines = (done.stdout + done.stderr).strip().splitlines()
    return lines[-1] if lines else f"the probe exited with code {done.returncode}"


def _kernel() -> tuple[int, int]:
    try:
        major, minor = os.uname().release.split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except ValueError:
        return (0, 0)


def protect_trainer() -> None:
    """Make this (the trainer's) process non-dumpable (Linux; idempotent)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
