"""verifiers 0.4's v1 stack through the endpoint (agents/verifiers_v1.py, run with
.venv-verifiers' python): a v1 `Taskset` (tests/support/vf_calculator.py, the tool demo's
task) and its in-process harness, whose model calls go through verifiers' interception
server and its eval client to the episode's session. A v1 episode's session is the
trajectory the plain openai SDK makes for the same conversation and seeds (which
test_endpoint.py shows is the native tool environment's), token for token and log-prob for
log-prob; the harness got the engine's ids; every request is counted; the reward printed
is the task's `@vf.reward`. `export` writes the taskset's tasks as data rows."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess

import openai
import pytest
import torch
from support.configs import ROOT
from support.verifiers_venv import adapter_command, pythonpath
from transformers import AutoModelForCausalLM, AutoTokenizer

from leangrpo.agents.endpoint import AgentEndpoint
from leangrpo.config.agent import AgentConfig
from leangrpo.contracts import Prompt, SamplingParams
from leangrpo.environments.schema import tool_schema
from leangrpo.rollout.hf.engine import HFEngine

TOOLS_MODEL = ROOT / "examples" / "tools_demo" / "model"
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=64, seed=3)
EPISODE_HANG_S = 600  # a hang guard: importing verifiers is seconds of CPU, more under load
PROMPT = Prompt(0, "395+136=", [0], {"answer": "531"}, [{"role": "user", "content": "395+136="}])


def calculator_add():
    spec = importlib.util.spec_from_file_location("calculator", ROOT / "examples" / "tools_demo" / "calculator.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.add


add = calculator_add()  # the tool the harness offers (tests/support/vf_calculator.py)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOOLS_MODEL)


@pytest.fixture(scope="module")
def engine(tokenizer):
    model = AutoModelForCausalLM.from_pretrained(TOOLS_MODEL, dtype=torch.float32)
    return HFEngine(model.eval(), tokenizer, max_batch_size=1)  # bitwise: one row a forward


@pytest.fixture(scope="module")
def endpoint(tokenizer):
    made = AgentEndpoint(tokenizer, AgentConfig(max_total_tokens=192, max_requests=8), None, {tokenizer.eos_token_id})
    made.start()
    yield made
    made.close()


def plain_agent(client: openai.OpenAI, prompt: Prompt) -> None:
    """The harness's loop (vf_calculator.calculator_loop) with the plain openai SDK."""
    messages, tools = [dict(m) for m in prompt.messages], [tool_schema(add)]
    for _ in range(3):
        try:
            response = client.chat.completions.create(model="policy", messages=messages, tools=tools)
        except openai.BadRequestError:
            return
        choice = response.choices[0]
        if choice.finish_reason != "tool_calls":
            return
        messages.append(choice.message.model_dump(exclude_none=True))
        for call in choice.message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": str(add(**json.loads(call.function.arguments)))})  # fmt: skip


def model_turns(completion) -> list[list[int]]:
    """The ids of each model turn of a completion (its segments: (length, is_model) pairs)."""
    turns, at = [], 0
    for n, is_model in completion.trajectory.segments:
        if is_model:
            turns.append(completion.ids[at : at + n])
        at += n
    return turns


def v1_episode(endpoint, key: str, task: dict, ids_file) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": pythonpath(), "OPENAI_BASE_URL": endpoint.base_url,
           "OPENAI_API_KEY": key, "LEANGRPO_TEST_IDS": str(ids_file)}  # fmt: skip
    return subprocess.run(adapter_command("run"), input=json.dumps(task), capture_output=True, text=True,
                          env=env, timeout=EPISODE_HANG_S)  # fmt: skip


def test_a_v1_episode_is_the_plain_clients_trajectory_with_the_engines_ids(engine, endpoint, tmp_path):
    tool_calls = 0
    with endpoint.generating(engine, PARAMS, 0):
        for index in range(3):  # this seed: two answers, one call then the answer
            session = endpoint.open_session(PROMPT, PARAMS.seed, index)
            plain_agent(openai.OpenAI(base_url=endpoint.url(session), api_key="-", max_retries=0), PROMPT)
            (theirs,) = endpoint.end_session(session.key).completions()

            session = endpoint.open_session(PROMPT, PARAMS.seed, index)
            ids_file = tmp_path / f"ids-{index}.jsonl"
            done = v1_episode(endpoint, session.key, {"messages": PROMPT.messages, "answer": "531"}, ids_file)
            assert done.returncode == 0, done.stderr[-3000:]
            ended = endpoint.end_session(session.key)
            (ours,) = ended.completions()

            assert ours.ids == theirs.ids and ours.logprobs == theirs.logprobs  # bitwise
            assert ours.trajectory.segments == theirs.trajectory.segments
            assert ours.trajectory.start.ids == theirs.trajectory.start.ids
            # the harness got, through verifiers' interception server, the ids the engine made
            seen = [json.loads(line) for line in ids_file.read_text().splitlines()]
            assert seen == model_turns(ours)
            assert ended.stats["requests"] == len(seen)
            last = [m for m in ours.trajectory.messages if m["role"] == "assistant"][-1]
            assert json.loads(done.stdout.splitlines()[-1]) == (1.0 if "531" in (last.get("content") or "") else 0.0)
            tool_calls += len(ours.trajectory.tool_calls)
    assert tool_calls > 0  # the harness ran the calculator
    assert endpoint.metrics()["agent/prefix_breaks"] == 0


def test_a_failed_v1_episode_exits_non_zero_with_its_error(endpoint, tmp_path):
    """A model call refused (here: no session with that key) fails the trace: no reward."""
    done = v1_episode(endpoint, "lg-no-such-session", {"messages": PROMPT.messages, "answer": "531"},
                      tmp_path / "ids.jsonl")  # fmt: skip
    assert done.returncode == 1 and done.stdout.strip() == ""
    assert "verifiers v1 episode failed" in done.stderr and "401" in done.stderr


def test_export_writes_the_tasksets_tasks_as_data_rows(tmp_path):
    out = tmp_path / "rows.jsonl"
    done = subprocess.run([*adapter_command("export"), "--out", str(out), "--limit", "2"], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": pythonpath()}, timeout=EPISODE_HANG_S)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    demo = [json.loads(line) for line in (ROOT / "examples" / "tools_demo" / "train.jsonl").read_text().splitlines()[:2]]
    assert [r["messages"] for r in rows] == [[{"role": "user", "content": d["prompt"]}] for d in demo]
    assert [(r["vf_task"]["idx"], r["vf_task"]["prompt"], r["vf_task"]["answer"]) for r in rows] == [
        (i, d["prompt"], d["answer"]) for i, d in enumerate(demo)
    ]
