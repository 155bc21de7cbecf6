"""prestart.py: the worker pools `leangrpo train` starts before importing torch; a broken
environment is still one clear error when the trainer takes the pool, and whatever the
trainer did not take is ended."""

from __future__ import annotations

import psutil
import pytest
from support.configs import minimal_run

from leangrpo.config import config_from_dict
from leangrpo.environments.registry import EnvironmentSpecError
from leangrpo.prestart import Prestarted


def worker_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.is_running()]


def config(tool: str):
    return config_from_dict(
        minimal_run(
            rewards={"functions": ["math"], "num_workers": 1},
            data={"path": "unused.jsonl", "chat_template": True},
            environment={"name": "tools", "tools": [tool], "num_workers": 1},
        )
    )


def test_the_pools_start_at_once_and_the_trainer_takes_them(tmp_path):
    tool = tmp_path / "tool.py"
    tool.write_text(
        "def add(a: int, b: int) -> int:\n"
        '    """Add.\n\n    Args:\n        a: one\n        b: two\n    """\n    return a + b\n'
    )
    before = {p.pid for p in worker_children()}
    early = Prestarted(config(f"{tool}:add"))
    started = [p for p in worker_children() if p.pid not in before]
    assert started, "the reward worker starts in the constructor, without waiting"
    pool = early.take_environment_pool()
    rewards = early.take_rewards()
    try:
        assert [t["function"]["name"] for t in pool.tools] == ["add"]
        # the pools' workers (`started` may also hold the sandbox's probe, which ends by itself)
        held = [worker.proc for taken in (pool, rewards) for worker in taken._workers]
        early.close()  # nothing left to end: the trainer holds both
        assert held and all(proc.poll() is None for proc in held)
    finally:
        pool.close()
        rewards.close()


def test_a_broken_environment_is_one_error_when_taken_and_close_ends_the_rest(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("raise ValueError('no tools today')\n")
    before = {p.pid for p in worker_children()}
    early = Prestarted(config(f"{broken}:add"))
    with pytest.raises(EnvironmentSpecError, match="no tools today"):
        early.take_environment_pool()
    early.close()  # the reward pool, never taken
    left = [p for p in worker_children() if p.pid not in before]
    psutil.wait_procs(left, timeout=10)
    assert not [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_close_while_the_environment_still_starts_does_not_wait_for_it(tmp_path):
    """An interrupt during the trainer's imports: close() returns at once; the pool that
    becomes ready afterwards is closed by its thread, leaving no worker behind."""
    slow, go = tmp_path / "slow.py", tmp_path / "go"
    slow.write_text(  # its import waits until the test says go
        f"import os, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.05)\n\n"
        "def add(a: int, b: int) -> int:\n"
        '    """Add.\n\n    Args:\n        a: one\n        b: two\n    """\n    return a + b\n'
    )
    before = {p.pid for p in worker_children()}
    early = Prestarted(config(f"{slow}:add"))
    thread = early._thread
    early.close()
    assert thread.is_alive()  # close() returned while the pool was still starting
    go.write_text("")
    thread.join(timeout=120)  # a hang guard
    assert not thread.is_alive()
    left = [p for p in worker_children() if p.pid not in before]
    psutil.wait_procs(left, timeout=10)
    assert not [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
