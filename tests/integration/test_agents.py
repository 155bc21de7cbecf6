"""Agents written against the OpenAI client trained by the trainer (issue 37), on the tool
demo (examples/tools_demo): an OpenAI Agents SDK agent (Agent, function_tool,
Runner.run) trains through the endpoint; an episode trains the tokens and log-probs the
native tool environment trains for the same seed; resume inside a batch is exact (the
episodes in flight at the checkpoint are made again); bad agent settings stop the run in
one sentence before torch loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.configs import ROOT, updated
from support.processes import run_cli
from support.verifiers_venv import adapter_command, pythonpath

from leangrpo.config import config_from_dict
from leangrpo.errors import UserError
from leangrpo.preflight import check_inputs
from leangrpo.train import Trainer

TOOLS_DEMO = ROOT / "examples" / "tools_demo"
CALCULATOR = str(TOOLS_DEMO / "calculator.py") + ":add"


def agent_run(out: Path, **sections) -> dict:
    """A few steps of the tool demo with an agent: 4 prompts x 4 episodes a batch."""
    cfg = {
        "run": {"output_dir": str(out), "seed": 1, "max_steps": 2, "device": "cpu", "num_threads": 1},
        "model": {"name_or_path": str(TOOLS_DEMO / "model"), "dtype": "float32"},
        "data": {"path": str(TOOLS_DEMO / "train.jsonl"), "chat_template": True},
        "rewards": {"functions": [{"name": "math", "kwargs": {"answer_column": "answer"}}], "num_workers": 1},
        "agent": {"entry": "support.agents:native_tools", "num_workers": 2, "timeout_s": 60,
                  "max_total_tokens": 160},
        # one sequence per forward: a batch is exact whatever the agents' timing
        "rollout": {"num_generations": 4, "prompts_per_batch": 4, "max_new_tokens": 64, "max_batch_size": 1},
        "train": {"learning_rate": 1e-3, "micro_batch_tokens": 600},
        "eval": {"every_steps": 0},
        "checkpoint": {"every_steps": 0, "keep_last": 3, "save_final_model": False},
        "logging": {"progress_bar": False},
    }  # fmt: skip
    return updated(cfg, sections)


def native_run(out: Path, **sections) -> dict:
    """The same run with the native tool environment in place of the agent."""
    cfg = agent_run(out, **sections)
    del cfg["agent"]
    cfg["environment"] = {"tools": [CALCULATOR], "max_turns": 3, "max_total_tokens": 160, "num_workers": 1}
    return cfg


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.policy.model.named_parameters()}


def max_abs_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(autouse=True)
def agents_importable(monkeypatch):
    """The agent workers import `support.agents` as the tests do."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests"))


class Recording(Trainer):
    """Keeps every batch it scores."""

    def score(self, batch):
        self.batches = [*getattr(self, "batches", []), batch]
        return super().score(batch)


def test_an_agents_sdk_agent_trains_through_the_endpoint(tmp_path):
    cfg = agent_run(tmp_path, agent={"entry": "support.agents:calculator"}, rewards={"functions": []},
                    train={"learning_rate": 1e-3, "micro_batch_tokens": 600})  # fmt: skip
    trainer = Recording(config_from_dict(cfg))
    before = params(trainer)
    trainer.train()
    assert max_abs_diff(before, params(trainer)) > 0  # it learned from the agent's rewards
    (first, second) = [r for r in rows(tmp_path) if r.get("step", 0) > 0 and "agent/requests" in r]
    assert first["agent/requests"] >= 16 and first["agent/errors"] < 16
    assert "reward/env/agent/mean" in first and first["agent/latency_s"] > 0
    assert "agent/prefix_breaks" in first and "multiturn/tool_calls" in first
    episodes = [s for b in trainer.batches for s in b.samples if s.reward is not None]
    assert episodes and all(len(s.completion.logprobs) == s.completion.num_model_tokens for s in episodes)


@pytest.mark.slow
def test_a_verifiers_v1_environment_trains_through_the_endpoint(tmp_path, monkeypatch):
    """verifiers 0.4's v1 stack as agent.command (leangrpo.agents.verifiers_v1 with
    .venv-verifiers' python): a Taskset and its harness (tests/support/vf_calculator.py) per
    episode, in the episode's box; the task's @vf.reward is the episode's reward, trained."""
    monkeypatch.setenv("PYTHONPATH", pythonpath())
    cfg = agent_run(tmp_path, agent={"entry": None, "command": " ".join(adapter_command("run")), "timeout_s": 600},
                    rewards={"functions": []},
                    rollout={"num_generations": 2, "prompts_per_batch": 2, "max_new_tokens": 64, "max_batch_size": 1})  # fmt: skip
    trainer = Recording(config_from_dict(cfg))
    before = params(trainer)
    trainer.train()
    steps = [r for r in rows(tmp_path) if r.get("step", 0) > 0 and "agent/requests" in r]
    assert len(steps) == 2
    for row in steps:
        assert row["agent/errors"] == 0 and row["agent/prefix_breaks"] == 0
        assert row["agent/requests"] >= 4 and row["reward/env/agent/mean"] == row["reward/mean"]
    episodes = [s for b in trainer.batches for s in b.samples]
    assert len(episodes) == 8 and all(s.reward in (0.0, 1.0) for s in episodes)
    for s in episodes:  # the reward is the task's: the answer in the episode's last reply
        last = [m for m in s.completion.trajectory.messages if m["role"] == "assistant"][-1]
        assert s.reward == (1.0 if s.prompt.columns["answer"] in (last.get("content") or "") else 0.0)
        assert len(s.completion.logprobs) == s.completion.num_model_tokens > 0
    assert len({s.reward for s in episodes}) > 1  # this seed: some right, some wrong
    assert all(row["grad_norm"] > 0 for row in steps) and max_abs_diff(before, params(trainer)) > 0  # it learned


@pytest.mark.exact
def test_an_episode_trains_what_the_native_environment_trains(tmp_path):
    """Same seed, same prompts: each episode is the native trajectory, token for token and
    log-prob for log-prob (behaviour and the trainer's), scored alike."""
    made = {}
    for name, run in (("native", native_run), ("agent", agent_run)):
        trainer = Recording(config_from_dict(run(tmp_path / name, run={"max_steps": 1})))
        trainer.train()
        (made[name],) = trainer.batches
    native, agent = made["native"].samples, made["agent"].samples
    assert len(native) == len(agent) == 16
    compared = 0
    for theirs, ours in zip(native, agent):
        if theirs.completion.trajectory.stats.get("tool_errors", 0):  # an error reply the
            continue  # client never sees (a call that does not parse): not reproducible
        assert ours.prompt.ids == theirs.prompt.ids
        assert ours.completion.ids == theirs.completion.ids
        assert ours.completion.logprobs == theirs.completion.logprobs  # bitwise
        assert ours.completion.trajectory.segments == theirs.completion.trajectory.segments
        assert ours.reward == theirs.reward
        compared += 1
    assert compared == len(native)  # this seed's calls all parse
    calls = sum(len(s.completion.trajectory.tool_calls) for s in native)
    assert calls > 0  # some episodes called the tool
    (a,), (b,) = ([r for r in rows(tmp_path / n) if r["step"] == 1] for n in ("native", "agent"))
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]  # the same step


class _Crash(Exception):
    pass


class CrashAt(Trainer):
    stop_at = 3

    def on_step_end(self, metrics, batch):
        super().on_step_end(metrics, batch)
        if self.step == self.stop_at:
            raise _Crash


@pytest.mark.exact
def test_resume_inside_a_batch_of_episodes_is_exact(tmp_path):
    """Two steps a batch, async at staleness 0 (sample for sample sync's batches). A crash
    at step 2, when the next batch's episodes start (their weights were pushed before the
    checkpoint), then one at step 3, inside that batch: each resume makes the episodes in
    flight again, and the weights end equal to the straight run's, bit for bit."""
    sections = {"run": {"max_steps": 4},
                "rollout": {"num_generations": 4, "prompts_per_batch": 2, "max_new_tokens": 64, "max_batch_size": 1},
                "train": {"learning_rate": 1e-3, "micro_batch_tokens": 600, "steps_per_generation": 2}}  # fmt: skip
    straight = Trainer(config_from_dict(agent_run(tmp_path / "a", **sections)))
    straight.train()
    interrupted = agent_run(
        tmp_path / "b",
        checkpoint={"every_steps": 1, "keep_last": 3, "save_final_model": False},
        pipeline={"mode": "async", "max_staleness": 0},
        **sections,
    )
    for stop_at in (2, 3):
        crashing = CrashAt(config_from_dict(interrupted))
        crashing.stop_at = stop_at
        with pytest.raises(_Crash):
            crashing.train()
    resumed = Trainer(config_from_dict(interrupted))
    assert resumed.step == 3 and resumed.inflight is not None  # the batch in progress
    resumed.train()
    assert max_abs_diff(params(straight), params(resumed)) == 0.0


@pytest.mark.parametrize(
    ("agent", "expected"),
    [
        ({"entry": "no_such_agent.py:run"}, "agent.entry = 'no_such_agent.py:run': file"),
        ({"entry": "no_such_package.agent:run"}, "module 'no_such_package.agent' not found"),
        ({"entry": "support.agents"}, "does not name a function"),
        ({"entry": str(TOOLS_DEMO / "calculator.py") + ":run"}, "calculator.py defines no top-level 'run'"),
        ({"command": "no-such-program --flag"}, "program 'no-such-program' is not on PATH"),
        ({"command": "python 'unclosed"}, "is not a shell command line"),
        ({"entry": "support.agents:calculator", "command": "python a.py"}, "agent.entry and agent.command both name the agent"),
        ({}, "agent needs agent.entry"),
    ],
)
def test_bad_agent_settings_are_one_sentence_before_the_model_loads(tmp_path, agent, expected):
    cfg = agent_run(tmp_path)
    cfg["agent"] = agent
    with pytest.raises(UserError) as caught:
        check_inputs(config_from_dict(cfg))
    assert expected in str(caught.value) and "\n" not in str(caught.value)


def test_a_bad_agent_entry_stops_the_cli_before_torch(tmp_path):
    cfg = agent_run(tmp_path / "run", agent={"entry": "no_such_agent.py:run"})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    result = run_cli("train", str(path), probe=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "no_such_agent.py" in result.stderr and "Traceback" not in result.stderr
    assert result.stdout.strip().splitlines()[-1] == "torch imported: False"


def test_an_agent_and_an_environment_together_are_refused(tmp_path):
    cfg = agent_run(tmp_path)
    cfg["environment"] = native_run(tmp_path)["environment"]
    with pytest.raises(UserError, match="environment and agent both say how a trajectory is made"):
        config_from_dict(cfg)


def test_serve_agent_answers_any_key_token_exactly(tmp_path):
    """`leangrpo serve-agent CONFIG`: the policy for an outside agent; a key is a session,
    its second request continues on the engine's ids."""
    import openai

    cfg = agent_run(tmp_path / "run")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    server = subprocess.Popen([sys.executable, "-m", "leangrpo", "serve-agent", str(path), "--port", "0"],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = server.stdout.readline()
        assert line.startswith("leangrpo: serving at http://127.0.0.1:"), line
        client = openai.OpenAI(base_url=line.split(" at ")[1].strip(), api_key="an-outside-agent", max_retries=0)
        messages = [{"role": "user", "content": "395+136="}]
        first = client.chat.completions.create(model="policy", messages=messages, max_tokens=64,
                                               extra_body={"return_token_ids": True})  # fmt: skip
        messages.append(first.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": "again"})
        second = client.chat.completions.create(model="policy", messages=messages, max_tokens=8,
                                                extra_body={"return_token_ids": True})  # fmt: skip
        so_far = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
        assert second.model_extra["prompt_token_ids"][: len(so_far)] == so_far  # the engine's ids
        with pytest.raises(openai.BadRequestError, match="temperature"):
            client.chat.completions.create(model="policy", messages=messages, temperature=0.3)
    finally:
        server.terminate()
        assert server.wait(timeout=60) == 0
