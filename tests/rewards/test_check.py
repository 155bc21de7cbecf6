"""check_rewards imports user reward files in a short-lived worker, under a time limit:
a file that exits, kills its process or hangs at import gets one sentence, the trainer
survives; built-ins need no worker."""

from __future__ import annotations

import logging
import textwrap

import pytest
from support.configs import SRC, rewards_section
from support.processes import run_python

from leangrpo.rewards import RewardSpecError, check_rewards
from leangrpo.rewards.check import side_by_side
from leangrpo.sandbox.levels import SandboxPlan

CLEAN_ENV = {"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}  # nothing else inherited


def write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body) + "\ndef fn(prompts, completions, **c):\n    return []\n")
    return path


def test_sys_exit_at_import_is_one_sentence(tmp_path):
    path = write(tmp_path, "exits.py", "import sys\nsys.exit(3)")
    with pytest.raises(RewardSpecError) as err:
        check_rewards(rewards_section("math", f"{path}:fn"))
    assert str(err.value) == (
        f"rewards.functions[1].name = '{path}:fn': {path} called sys.exit(3) at import; "
        "a reward file must not exit"
    )


def test_sleep_at_import_is_stopped_by_the_startup_limit(tmp_path):
    path = write(tmp_path, "sleeps.py", "import time\ntime.sleep(20)")
    with pytest.raises(RewardSpecError, match=r"importing .*sleeps\.py did not finish within 1 s"):
        check_rewards(rewards_section(f"{path}:fn", startup_timeout_s=1.0))


def test_os_exit_at_import_does_not_end_the_trainer(tmp_path):
    # run in a child interpreter: on failure (the import in the checking process itself)
    # os._exit would end the test run
    path = write(tmp_path, "kills.py", "import os\nos._exit(5)")
    code = textwrap.dedent(
        f"""
        from leangrpo.config.run import RewardsConfig
        from leangrpo.rewards import RewardSpecError, check_rewards
        cfg = RewardsConfig(functions=[{f"{path}:fn"!r}], timeout_s=5.0, num_workers=1)
        try:
            check_rewards(cfg)
        except RewardSpecError as e:
            print(e)
        """
    )
    done = run_python(code, env=CLEAN_ENV)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        f"rewards.functions[0].name = '{path}:fn': importing {path} ended the reward worker "
        "(exit code 5); a reward file must not exit at import"
    )


def test_valid_files_pass_and_their_prints_are_prefixed(tmp_path, caplog, capfd):
    path = write(tmp_path, "chatty.py", "print('loading my reward')")
    with caplog.at_level(logging.INFO, logger="leangrpo.rewards"):
        specs = check_rewards(rewards_section("math", f"{path}:fn"))
    assert [s.key for s in specs] == ["math", "fn"]
    assert "[reward check] loading my reward" in [r.getMessage() for r in caplog.records]
    assert "loading my reward" not in "".join(capfd.readouterr())


def test_builtins_need_no_worker(monkeypatch):
    import leangrpo.rewards.check as check

    def no_worker(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(check, "WorkerProcess", no_worker)
    specs = check_rewards(rewards_section("math", "math"))
    assert [s.key for s in specs] == ["math", "math_2"]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("timeout_s", ".inf"),
        ("timeout_s", "1e9"),
        ("startup_timeout_s", "0"),
        ("memory_limit_mb", "16"),
        ("cpu_time_limit_s", "-1"),
    ],
)
def test_reward_limits_in_the_config_are_checked(key, value):
    from leangrpo.config import ConfigError, load_config

    overrides = [
        "model.name_or_path=m",
        "data.path=d.jsonl",
        "rewards.functions=[math]",
        f"rewards.{key}={value}",
    ]
    with pytest.raises(ConfigError, match=rf"rewards\.{key}"):
        load_config(None, overrides)


def test_the_check_imports_neither_torch_nor_the_pool(tmp_path):
    path = write(tmp_path, "ok.py", "")
    code = textwrap.dedent(
        f"""
        import sys
        from leangrpo.config.run import RewardsConfig
        from leangrpo.rewards import check_rewards
        check_rewards(RewardsConfig(functions=[{f"{path}:fn"!r}], timeout_s=5.0))
        print(sorted(m for m in ("torch", "leangrpo.rewards.pool") if m in sys.modules))
        """
    )
    done = run_python(code, env=CLEAN_ENV)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("level", "network", "process_limit", "parallel", "own_network"),
    [
        ("namespace", False, "cgroup", 4, True),  # a loopback and a pids cgroup per box
        ("namespace", False, "", 4, True),  # no process limit: no count shared either
        ("namespace", False, "rlimit", 1, False),  # RLIMIT_NPROC: the worker's uid's count
        ("namespace", True, "cgroup", 4, False),  # the host's network, every worker's
        ("process", False, "cgroup", 4, False),  # no network namespace per box
    ],
)
def test_calls_side_by_side_get_a_loopback_and_process_count_of_their_own(
    level, network, process_limit, parallel, own_network
):
    plan = SandboxPlan("rewards", level, network=network, process_limit=process_limit)
    assert side_by_side(plan, 4) == {"parallel": parallel, "own_network": own_network}
    assert side_by_side(plan, 1) == {"parallel": 1, "own_network": False}
