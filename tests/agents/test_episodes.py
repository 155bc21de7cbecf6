"""Agent episodes in boxes (agents/episodes.py, worker.py) through the endpoint, on the tool
demo's model: an OpenAI Agents SDK agent (Agent, function_tool, Runner.run) makes groups
of token-exact trajectories with its own rewards; an agent that crashes, hangs, floods
requests or uses a foreign session key is contained and counted, never an exception; an
agent command gets its session from the environment and its task on stdin; a box reaches
the endpoint and nothing else."""

from __future__ import annotations

import functools
import socket
import sys

import pytest
import torch
from support.configs import ROOT
from support.sandboxes import require_namespace
from transformers import AutoModelForCausalLM, AutoTokenizer

from leangrpo.agents.endpoint import AgentEndpoint
from leangrpo.agents.episodes import AgentRollout, AgentWorkers
from leangrpo.config.agent import AgentConfig
from leangrpo.contracts import Prompt, SamplingParams

TOOLS_MODEL = ROOT / "examples" / "tools_demo" / "model"
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=64, seed=5)
PAIRS = [(395, 136), (548, 622)]
ADD = [{"type": "function", "function": {"name": "add"}}]


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    tokenizer = AutoTokenizer.from_pretrained(TOOLS_MODEL)
    made = AgentEndpoint(tokenizer, AgentConfig(max_total_tokens=192, max_requests=6), None, {tokenizer.eos_token_id})
    made.start(unix_socket=str(tmp_path_factory.mktemp("endpoint") / "agent.sock"))
    yield made
    made.close()


def prompts() -> list[Prompt]:
    return [Prompt(uid, f"{a}+{b}=", [0], {"answer": str(a + b)}, [{"role": "user", "content": f"{a}+{b}="}])
            for uid, (a, b) in enumerate(PAIRS)]  # fmt: skip


@functools.cache
def engine():
    from leangrpo.rollout.hf.engine import HFEngine

    model = AutoModelForCausalLM.from_pretrained(TOOLS_MODEL, dtype=torch.float32)
    return HFEngine(model.eval(), AutoTokenizer.from_pretrained(TOOLS_MODEL))


def rollout(endpoint, functions: bool = True, **agent) -> tuple[AgentRollout, AgentWorkers]:
    cfg = AgentConfig(**{"num_workers": 2, "timeout_s": 30.0, **agent})
    workers = AgentWorkers(cfg, endpoint.unix_socket)
    return AgentRollout(endpoint, workers, engine(), functions), workers


def test_an_agents_sdk_agent_makes_groups_of_token_exact_trajectories(endpoint, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests"))
    made, workers = rollout(endpoint, entry="support.agents:calculator")
    try:
        groups = made.generate(prompts(), PARAMS, 3, 0)
    finally:
        workers.close()
    assert [len(g) for g in groups] == [3, 3]
    scored = [c for g in groups for c in g if c.trajectory.error is None]
    assert len(scored) >= 4, [c.trajectory.error for g in groups for c in g]
    tokenizer = endpoint.tokenizer
    for c in scored:
        t = c.trajectory
        assert t.rewards["agent"] in (0.0, 1.0) and len(c.logprobs) == t.num_model_tokens > 0
        assert t.segments[0][1] and t.segments[-1][1]  # model turns at both ends
        # the whole conversation (the model's turns as it wrote them), rendered at once, is the
        # trajectory token for token (this tokenizer is canonical; its template lists names)
        text = tokenizer.apply_chat_template(t.messages, tools=ADD, tokenize=False)
        assert tokenizer(text, add_special_tokens=False).input_ids == t.start.ids + c.ids
    assert made.last_metrics["agent/requests"] >= len(scored)
    assert made.last_metrics["agent/errors"] == 6 - len(scored)


@pytest.mark.parametrize(
    "agent, kind",
    [("crash", "raised"), ("hang", "timeout"), ("flood", "raised"), ("foreign", "raised")],
)
def test_a_failing_agent_is_contained_and_counted(endpoint, monkeypatch, agent, kind):
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests"))
    made, workers = rollout(endpoint, entry=f"support.agents:{agent}", timeout_s=3.0, num_workers=1)
    try:
        (group,) = made.generate(prompts()[:1], PARAMS, 2, 0)
    finally:
        workers.close()
    metrics = made.last_metrics
    assert metrics["agent/errors"] == 2 and metrics[f"agent/errors/{kind}"] == 2
    for c in group:
        assert c.finish_reason == "error" and c.trajectory.error
    if agent == "flood":  # its 6 requests answered, the 7th refused
        assert all(c.trajectory.stats["requests"] == 7 and c.trajectory.stats["segments"] == 6 for c in group)
        assert metrics["agent/refused"] == 2
    if agent == "foreign":
        assert metrics["agent/foreign_keys"] == 2 and all(c.ids == [] for c in group)


@pytest.mark.parametrize("prefix", ["", "AGENT_MODE=test "])  # a shell line, assignments too
def test_an_agent_command_gets_its_session_and_task(endpoint, monkeypatch, prefix):
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests"))
    command = f"{prefix}{sys.executable} {ROOT / 'tests' / 'support' / 'agent_command.py'}"
    made, workers = rollout(endpoint, command=command, num_workers=1)
    try:
        (group,) = made.generate(prompts()[:1], PARAMS, 2, 0)
    finally:
        workers.close()
    for c in group:
        assert c.trajectory.error is None, c.trajectory.error
        assert c.trajectory.rewards == {"tokens": float(len(c.ids))} and len(c.ids) <= 4


def test_an_episode_reaches_the_endpoint_and_nothing_else(endpoint, monkeypatch):
    require_namespace()
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests"))
    outside = socket.create_server(("127.0.0.1", 0))
    made, workers = rollout(endpoint, entry="support.agents:outside", num_workers=1,
                            sandbox={"level": "namespace"})  # fmt: skip
    task = Prompt(0, "x", [0], {"port": outside.getsockname()[1]}, [{"role": "user", "content": "x"}])
    try:
        (group,) = made.generate([task], PARAMS, 1, 0)
    finally:
        workers.close()
        outside.close()
    assert group[0].trajectory.rewards == {"agent": 0.0}  # the models call worked; outside did not


@pytest.mark.parametrize("functions", [True, False])
def test_an_agent_without_a_reward_is_left_to_the_reward_functions(endpoint, monkeypatch, functions):
    """None: rewards.functions score the episode; with none configured it is unscored."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests"))
    made, workers = rollout(endpoint, functions, entry="support.agents:silent", num_workers=1)
    try:
        (group,) = made.generate(prompts()[:1], PARAMS, 2, 0)
    finally:
        workers.close()
    for c in group:
        assert c.trajectory.rewards == {} and len(c.ids) <= 2
        assert (c.trajectory.error is None) == functions
    assert made.last_metrics.get("agent/errors/no_reward", 0.0) == (0.0 if functions else 2.0)


class ForgedWorkers:
    """Workers whose boxes send these rewards (an agent that replaced the box's own check)."""

    def __init__(self, rewards):
        self.rewards = rewards

    def run(self, episodes):
        return {e["id"]: {"t": "episode", "id": e["id"], "reward": r} for e, r in zip(episodes, self.rewards)}


FORGED = ["not-a-number", [1, 2], True, float("nan"), float("inf"), {"a": "x"}, {"a": True},
          {"a": float("nan")}, {1: 1.0}, {"bad name\n": 1.0}, {f"t{i}": 1.0 for i in range(33)}]  # fmt: skip


def test_a_forged_reward_is_the_episodes_counted_error_never_an_exception(endpoint):
    """The trusted side checks the reward again: the box's check runs beside the agent."""
    made = AgentRollout(endpoint, ForgedWorkers([*FORGED, 2, {"ok/term": 0.5}]), engine())
    prompt = prompts()[:1]
    (group,) = made.generate(prompt, PARAMS, len(FORGED) + 2, 0)
    assert made.last_metrics["agent/errors/bad_reward"] == len(FORGED)
    for c in group[: len(FORGED)]:
        assert c.finish_reason == "error" and c.trajectory.rewards == {}
        assert "reward" in c.trajectory.error
    assert made.last_metrics["agent/errors"] == len(FORGED) + 2


def test_an_agent_that_makes_no_request_is_a_counted_error(endpoint):
    made = AgentRollout(endpoint, ForgedWorkers([1.0, None]), engine())
    (group,) = made.generate(prompts()[:1], PARAMS, 2, 0)
    assert made.last_metrics["agent/errors"] == made.last_metrics["agent/errors/no_request"] == 2
    assert all(c.finish_reason == "error" and "no request" in c.trajectory.error for c in group)
