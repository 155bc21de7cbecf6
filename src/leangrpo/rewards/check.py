"""The start-up check of the reward functions: `check_rewards(cfg.rewards)`.

First every check that imports nothing (registry.parse_specs: names, files, built-in
kwargs, weights), and the sandbox (sandbox/levels.py: a `namespace` level this machine
cannot start is refused). Then, if any function is user code, one short-lived worker
(worker.py in "check" mode, in the sandbox) imports the functions and reports each by name, under
`rewards.startup_timeout_s`: user code never runs in the trainer, so a file that calls
`sys.exit`, `os._exit`, sleeps or prints at import cannot end, hang or clutter the trainer.
Every failure is a RewardSpecError of one sentence naming the function, its file or module
and what happened. Built-ins need no import check.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict
from multiprocessing.connection import wait
from typing import Any

from leangrpo.rewards.protocol import InitError, Loading, Ready, parse_reply
from leangrpo.rewards.registry import ResolvedReward, RewardSpecError, is_user_code, parse_specs
from leangrpo.sandbox.frames import ProtocolError
from leangrpo.sandbox.levels import SandboxPlan, check_level, plan_for
from leangrpo.sandbox.process import OutputBudget, WorkerGone, WorkerProcess

DEFAULT_STARTUP_TIMEOUT_S = 60.0


def check_rewards(rewards_cfg: Any) -> list[ResolvedReward]:
    """Check the configured functions before any model loads; returns their specs. The
    sandbox is checked first (a `namespace` this machine cannot start is refused)."""
    specs = parse_specs(rewards_cfg)
    if any(is_user_code(s) for s in specs):  # imported or unpickled in a sandbox
        import_check(specs, rewards_cfg, plan_for(rewards_cfg, "rewards"))
    elif specs:
        check_level(rewards_cfg, "rewards")
    return specs


def worker_init(specs: list[ResolvedReward], rewards_cfg: Any, mode: str) -> dict:
    """The start-up message of a worker."""
    return {
        "entry": "leangrpo.rewards.worker",
        "mode": mode,
        "sys_path": list(sys.path),
        "specs": [asdict(s) for s in specs],
        "timeout_s": float(rewards_cfg.timeout_s),
        "cpu_time_limit_s": getattr(rewards_cfg, "cpu_time_limit_s", None),
        "parallel": calls_per_worker(rewards_cfg),
    }


def calls_per_worker(rewards_cfg: Any) -> int:
    """Calls one worker runs side by side (`rewards.calls_per_worker`; null: the CPUs this
    process may use shared among the workers, at least 1)."""
    chosen = getattr(rewards_cfg, "calls_per_worker", None)
    if chosen:
        return int(chosen)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cpus or 1) // int(getattr(rewards_cfg, "num_workers", 1) or 1))


def side_by_side(plan: SandboxPlan, parallel: int) -> dict:
    """What a worker's start-up message says of its calls side by side: as many as asked,
    each box with a network namespace of its own where it can have one (levels.py
    `boxes_own_network`: else the loopback is every worker's anyway, the host's); one at a
    time where its boxes would share a process count (`boxes_share_a_process_count`: a
    call that forks up to it would leave its neighbour none)."""
    if plan.boxes_share_a_process_count():
        parallel = 1
    return {"parallel": parallel, "own_network": parallel > 1 and plan.boxes_own_network()}


def startup_timeout(rewards_cfg: Any) -> float:
    return float(getattr(rewards_cfg, "startup_timeout_s", None) or DEFAULT_STARTUP_TIMEOUT_S)


def import_check(specs: list[ResolvedReward], rewards_cfg: Any, plan: SandboxPlan) -> None:
    limit = startup_timeout(rewards_cfg)
    budget = OutputBudget()
    init = worker_init(specs, rewards_cfg, "check")
    worker = WorkerProcess(init, "reward check", budget, parse=parse_reply, plan=plan)
    loading = 0
    try:
        deadline = time.monotonic() + limit
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RewardSpecError(did_not_start(specs, loading, limit))
            ready = wait(worker.handles(), left)
            if worker.out_fd in ready:
                worker.relay_output()
            if worker.sock not in ready:
                continue
            try:
                replies = worker.receive()
            except WorkerGone:
                raise RewardSpecError(exited(specs, loading, worker.exit_code())) from None
            except ProtocolError as e:
                raise RewardSpecError(f"{_where(specs, loading)}: {e}") from None
            for reply in replies:
                if isinstance(reply, Loading) and reply.fn < len(specs):
                    loading = reply.fn
                elif isinstance(reply, InitError):
                    raise RewardSpecError(init_error(specs, reply))
                elif isinstance(reply, Ready):
                    return
    finally:
        worker.kill()
        budget.reset()


def _where(specs: list[ResolvedReward], i: int) -> str:
    spec = specs[i]
    if spec.value is not None:
        return f"rewards.functions[{i}].name = '{spec.name}': unpickling it (passed by value)"
    if not is_user_code(spec):  # nothing to import: the worker's start and warm-up
        return f"rewards.functions[{i}].name = '{spec.name}': starting its worker (the built-in's warm-up included)"
    source = spec.file or f"module '{spec.name.rpartition(':')[0]}'"
    return f"rewards.functions[{i}].name = '{spec.name}': importing {source}"


def init_error(specs: list[ResolvedReward], reply: InitError) -> str:
    i = min(reply.fn, len(specs) - 1)
    return f"rewards.functions[{i}].name = '{specs[i].name}': {reply.msg}"


def exited(specs: list[ResolvedReward], loading: int, code: int | None) -> str:
    return (
        f"{_where(specs, loading)} ended the reward worker (exit code {code}); "
        "a reward file must not exit at import"
    )


def did_not_start(specs: list[ResolvedReward], loading: int, limit: float) -> str:
    return (
        f"{_where(specs, loading)} did not finish within {limit:g} s; raise "
        "rewards.startup_timeout_s if it is just slow"
    )
