"""Multi-turn GRPO end to end (issue 22) on the tool demo (examples/tools_demo): the
trainer's own path with the calculator tool; resume is exact inside a batch; async at
staleness 0 equals sync; an environment that fails at import or reset, or a template that
cannot carry the tools, stops the run in one line before the model loads; reasoning-gym
tasks as data and reward; a verifiers environment driven turn by turn."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml
from support.configs import ROOT, updated
from support.processes import run_cli, run_python

from leangrpo.config import config_from_dict
from leangrpo.data.files import DataError
from leangrpo.train import Trainer

TOOLS_DEMO = ROOT / "examples" / "tools_demo"


def tools_run(out: Path, **sections) -> dict:
    """A few steps of the tool demo: 4 prompts x 4 trajectories, mu 2, two steps a batch."""
    cfg = {
        "run": {"output_dir": str(out), "seed": 1, "max_steps": 4, "device": "cpu", "num_threads": 1},
        "model": {"name_or_path": str(TOOLS_DEMO / "model"), "dtype": "float32"},
        "data": {"path": str(TOOLS_DEMO / "train.jsonl"), "eval_path": str(TOOLS_DEMO / "eval.jsonl"),
                 "chat_template": True},
        "rewards": {"functions": [{"name": "math", "kwargs": {"answer_column": "answer"}}], "num_workers": 1},
        "environment": {"tools": [str(TOOLS_DEMO / "calculator.py") + ":add"], "max_turns": 3,
                        "max_total_tokens": 160, "num_workers": 1},
        # per-trajectory scheduling (the default) in the batch-invariant mode, one sequence per
        # forward: batches are then exact whatever the environments' timing
        "rollout": {"num_generations": 4, "prompts_per_batch": 4, "max_new_tokens": 64, "max_batch_size": 1},
        "loss": {"mu": 2},
        "train": {"learning_rate": 1e-3, "micro_batch_tokens": 600, "steps_per_generation": 2},
        "eval": {"every_steps": 2, "num_prompts": 8},
        "checkpoint": {"every_steps": 0, "keep_last": 3, "save_final_model": False},
        "logging": {"progress_bar": False, "samples_every": 2},
    }  # fmt: skip
    return updated(cfg, sections)


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.policy.model.named_parameters()}


def max_abs_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


class _Crash(Exception):
    pass


class CrashAt(Trainer):
    stop_at = 3

    def on_step_end(self, metrics, batch):
        super().on_step_end(metrics, batch)
        if self.step == self.stop_at:
            raise _Crash


@pytest.mark.exact
def test_the_tool_demo_trains_on_trajectories_and_resumes_exactly_inside_a_batch(tmp_path):
    straight = Trainer(config_from_dict(tools_run(tmp_path / "a")))
    before = params(straight)
    straight.train()
    after = params(straight)
    assert max_abs_diff(before, after) > 1e-4
    logged = rows(tmp_path / "a")
    step = next(r for r in logged if "multiturn/turns" in r)
    assert 1.0 <= step["multiturn/turns"] <= 3.0 and step["multiturn/tool_calls/add"] > 0
    assert step["multiturn/model_tokens"] > 0 and step["multiturn/env_tokens"] > 0
    assert step["multiturn/env_errors"] == 0 and "multiturn/turn_0_length" in step
    assert step["multiturn/finish/error"] == 0 and step["multiturn/finish/stop"] > 0
    assert any("eval/multiturn/tool_calls" in r for r in logged)
    shown = [json.loads(x) for x in (tmp_path / "a" / "samples.jsonl").read_text().splitlines()]
    assert any("assistant: " in str(r) for r in shown)  # logged samples show the turns

    for mode in ("sync", "async"):  # async at staleness 0: a batch is made as in sync
        interrupted = tools_run(
            tmp_path / f"b-{mode}",
            checkpoint={"every_steps": 1, "keep_last": 3, "save_final_model": False},
            pipeline={"mode": mode, "max_staleness": 0},
        )
        with pytest.raises(_Crash):  # step 3: inside the second batch (2 steps each)
            CrashAt(config_from_dict(interrupted)).train()
        resumed = Trainer(config_from_dict(interrupted))
        assert resumed.step == 3 and resumed.inflight is not None  # the batch in progress
        assert resumed.inflight.batch.samples[0].completion.trajectory is not None
        resumed.train()
        assert max_abs_diff(after, params(resumed)) == 0.0, mode


@pytest.mark.exact
@pytest.mark.parametrize(
    "scheduling",
    [
        {"environment": {"scheduling": "per_trajectory"}},  # one sequence per forward
        {"environment": {"scheduling": "rounds"}, "rollout": {"max_batch_size": None}},  # batched
    ],
)
def test_async_at_zero_staleness_equals_sync(tmp_path, scheduling):
    sync = Trainer(config_from_dict(tools_run(tmp_path / "sync", **scheduling)))
    sync.train()
    cfg = tools_run(tmp_path / "async", pipeline={"mode": "async", "max_staleness": 0}, **scheduling)
    asynchronous = Trainer(config_from_dict(cfg))
    asynchronous.train()
    assert max_abs_diff(params(sync), params(asynchronous)) == 0.0


def write_config(tmp_path: Path, cfg: dict) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        ({"name": "support.environments:BadReset"}, "environment.name = 'support.environments:BadReset': reset failed on train prompt row 0: BadReset.reset: ValueError: no puzzle for 531"),
        ({"name": "broken_env.py:Env"}, "environment.name = broken_env.py:Env': executing"),
        ({"tools": ["support.environments:undocumented"]}, "tool undocumented cannot be offered to the model"),
        ({"name": "support.environments:Again", "tools": [], "chat_template": "no-template"}, "environment.chat_template = 'no-template' is neither"),
        ({"name": "/no/such_file.py:Env"}, "environment.name = '/no/such_file.py:Env': file /no/such_file.py not found"),
        ({"name": "support.environments:NotAnEnvironment", "tools": []}, "is the class NotAnEnvironment, not a subclass of leangrpo.environments.Environment"),
        ({"tools": ["support.environments:Adder"]}, "environment.tools[0] = 'support.environments:Adder' is the class Adder, not a function"),
        ({"tools": ["support.environments:add", "support.environments:divide", "support.environments:add"]}, "environment.tools[2] = 'support.environments:add' and environment.tools[0] = 'support.environments:add' are both named 'add'"),
        ({"name": "verifiers", "tools": [], "kwargs": {"env_id": "no-such-env-xyz"}}, "environment.kwargs.env_id = 'no-such-env-xyz': no installed module 'no_such_env_xyz'"),
    ],
)  # fmt: skip
def test_an_environment_that_fails_stops_the_run_in_one_line_before_the_model_loads(
    tmp_path, environment, expected
):
    (tmp_path / "broken_env.py").write_text("raise RuntimeError('half-written')\n")
    if environment.get("name", "").startswith("broken_env"):
        environment = {**environment, "name": str(tmp_path / environment["name"])}
        expected = expected.replace("environment.name = ", f"environment.name = '{tmp_path}/")
    cfg = tools_run(tmp_path / "run")
    cfg["environment"].update(environment)
    result = cli_with_test_modules("train", str(write_config(tmp_path, cfg)))
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("leangrpo: error")]
    assert len(lines) == 1 and expected in lines[0], result.stderr[-3000:]
    assert "Loading weights" not in result.stderr  # before the model loads


def test_prompts_too_long_for_their_first_turn_are_refused_at_the_set_up(tmp_path, monkeypatch):
    """Without the tokenizer's record (a first run), the set-up checks every prompt as its
    first turn renders, tools listed: 23 tokens, over the 12 that environment.max_total_tokens
    20 minus rollout.max_new_tokens 8 leave (without the listing it is 12 and passed, and
    every trajectory then ended 'prompt too long')."""
    monkeypatch.setenv("LEANGRPO_CACHE", str(tmp_path / "cache"))
    cfg = tools_run(tmp_path / "run", rollout={"max_new_tokens": 8},
                    environment={"max_total_tokens": 20}, train={"micro_batch_tokens": 600})  # fmt: skip
    with pytest.raises(DataError) as info:
        Trainer(config_from_dict(cfg))
    assert str(info.value).startswith(
        f"data.path = '{TOOLS_DEMO / 'train.jsonl'}' row 0 has 23 tokens as its first turn renders it "
        "(tools listed, with environment.chat_template), more than the 12 allowed by "
        "environment.max_total_tokens = 20 minus rollout.max_new_tokens = 8 (2000 of the 2000 prompts checked"
    )


def cli_with_test_modules(*args: str):
    """The CLI with tests/ on the path (for `support.environments`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    code = "import sys\nfrom leangrpo.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    return run_python(code, *args, env=env)


def test_a_template_that_ignores_the_tools_is_refused_in_one_line(tmp_path):
    from leangrpo.model.smollm2 import missing_reason, smollm2_dir

    if missing_reason() is not None:
        pytest.skip(missing_reason())
    cfg = tools_run(tmp_path / "run", model={"name_or_path": str(smollm2_dir())})
    result = run_cli("train", str(write_config(tmp_path, cfg)))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "ignores tools=" in result.stderr and "chatml-hermes" in result.stderr


def test_reasoning_gym_tasks_as_data_and_reward(tmp_path):
    """reasoning-gym's basic_arithmetic generated locally, scored by its own scorer in the
    reward workers, through the trainer (single-turn)."""
    pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (extra 'reasoning-gym')")
    from leangrpo.environments.adapters.reasoning_gym import main, score

    train, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    config = json.dumps({"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    main(["basic_arithmetic", "--size", "64", "--seed", "0", "--config", config, "--out", str(train)])
    main(["basic_arithmetic", "--size", "8", "--seed", "1", "--config", config, "--out", str(evals)])
    row = json.loads(train.read_text().splitlines()[0])
    right, near = row["answer"], str(int(row["answer"]) + 1)
    args = ([row["rg_entry"]] * 3, [row["rg_dataset"]] * 3, [row["rg_config"]] * 3)
    values = score(["q"] * 3, [right, f"so <answer>{right}</answer>", near], *args)
    assert values[0] == values[1] == 1.0 and values[2] < 1.0
    cfg = tools_run(
        tmp_path / "run",
        data={"path": str(train), "eval_path": str(evals), "chat_template": True},
        rewards={"functions": [{"name": "leangrpo.environments.adapters.reasoning_gym:score"}]},
        rollout={"max_new_tokens": 8},
        train={"micro_batch_tokens": 200},
        run={"max_steps": 2},
    )
    cfg.pop("environment")
    trainer = Trainer(config_from_dict(cfg))
    trainer.train()
    logged = rows(tmp_path / "run")
    assert any("reward/score/mean" in r for r in logged)
    assert all(r.get("reward/score/failures", 0) == 0 for r in logged)




def test_a_verifiers_environment_driven_turn_by_turn(tmp_path):
    if sys.version_info < (3, 11):
        pytest.skip("verifiers needs Python >= 3.11")
    pytest.importorskip("verifiers", reason="verifiers is not installed (extra 'verifiers')")
    from leangrpo.environments.adapters.verifiers import main

    load = str(ROOT / "tests" / "support" / "guess_env.py") + ":load_environment"
    main(["--load", load, "--out", str(tmp_path / "train.jsonl")])
    first = json.loads((tmp_path / "train.jsonl").read_text().splitlines()[0])
    assert first["prompt"] == [{"role": "user", "content": "395+136="}] and first["answer"] == "531"
    cfg = tools_run(
        tmp_path / "run",
        data={"path": str(tmp_path / "train.jsonl"), "eval_path": None, "chat_template": True},
        rewards={"functions": []},  # the rubric's reward is the environment's reward term
        environment={"name": "verifiers", "tools": [], "kwargs": {"load": load}, "max_turns": 3},
        rollout={"max_new_tokens": 8, "prompts_per_batch": 2},
        train={"steps_per_generation": 1},
        run={"max_steps": 2},
    )
    trainer = Trainer(config_from_dict(cfg))
    trainer.train()
    logged = rows(tmp_path / "run")
    step = next(r for r in logged if "multiturn/turns" in r)
    assert step["multiturn/env_errors"] == 0
    # the rubric's weighted reward (1 x solved + 0 x short) is the reward term
    assert step["reward/env/reward/mean"] == pytest.approx(step["multiturn/env/solved"])
    assert 0.0 < step["multiturn/env/short"] <= 0.5  # 1 / (1 + messages), one at least
    assert step["multiturn/turns"] > 1  # the environment answered with user turns
