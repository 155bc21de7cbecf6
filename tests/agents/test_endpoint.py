"""The OpenAI-compatible endpoint (agents/) with the real `openai` SDK on the tool demo's
model and the real hf engine: an agent's session is, token for token and log-prob for
log-prob, the trajectory the native tool environment makes for the same conversation and
seeds (sync and async clients, sessions in parallel); an assistant message sent back with
reformatted tool-call JSON still continues on the engine's ids; a history edit starts a
new, counted segment; streamed and non-streamed answers carry the same ids; sampling
settings the run cannot honour and foreign keys are refused OpenAI-style."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
from support.configs import ROOT
from transformers import AutoModelForCausalLM, AutoTokenizer

from leangrpo.agents.endpoint import AgentEndpoint, max_body_bytes
from leangrpo.agents.sessions import Session
from leangrpo.config.agent import AgentConfig
from leangrpo.config.environment import EnvironmentConfig
from leangrpo.contracts import Completion, Prompt, SamplingParams
from leangrpo.environments.driver import MultiTurnRollout, TurnLimits
from leangrpo.environments.pool import EnvironmentPool
from leangrpo.environments.rendering import Renderer
from leangrpo.rollout.hf.engine import HFEngine

TOOLS_MODEL = ROOT / "examples" / "tools_demo" / "model"
CALCULATOR = str(ROOT / "examples" / "tools_demo" / "calculator.py") + ":add"
PAIRS = [(395, 136), (548, 622), (586, 556), (689, 736), (951, 434), (244, 673)]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=64, seed=3)
MAX_TURNS, MAX_TOTAL = 3, 192
N = 4  # trajectories per prompt


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOOLS_MODEL)


@pytest.fixture(scope="module")
def engine(tokenizer):
    model = AutoModelForCausalLM.from_pretrained(TOOLS_MODEL, dtype=torch.float32)
    return HFEngine(model.eval(), tokenizer, max_batch_size=1)  # bitwise: one row a forward


@pytest.fixture(scope="module")
def pool():
    made = EnvironmentPool(EnvironmentConfig(name="tools", tools=[CALCULATOR], num_workers=1))
    yield made
    made.close()


@pytest.fixture(scope="module")
def endpoint(tokenizer):
    config = AgentConfig(max_total_tokens=MAX_TOTAL, max_requests=8)
    made = AgentEndpoint(tokenizer, config, None, {tokenizer.eos_token_id})
    made.start()
    yield made
    made.close()


def prompts() -> list[Prompt]:
    return [
        Prompt(uid, f"{a}+{b}=", [0], {"answer": str(a + b)}, [{"role": "user", "content": f"{a}+{b}="}])
        for uid, (a, b) in enumerate(PAIRS)
    ]


@pytest.fixture(scope="module")
def native(engine, tokenizer, pool):
    """The native tool environment's trajectories: (prompt, index, completion)."""
    rollout = MultiTurnRollout(engine, pool, Renderer(tokenizer, pool.tools),
                               TurnLimits(MAX_TURNS, MAX_TOTAL), {tokenizer.eos_token_id})  # fmt: skip
    groups = rollout.generate(prompts(), PARAMS, N, 0)
    return [(p, i * N + g, c) for i, (p, group) in enumerate(zip(prompts(), groups)) for g, c in enumerate(group)]


def add(a: int, b: int) -> int:
    return int(a) + int(b)


def answer_calls(messages: list[dict], message) -> None:
    """The agent's side of the tool loop: the model's message, then one result per call."""
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or []:
        result = add(**json.loads(call.function.arguments))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})


def calculator_agent(client: openai.OpenAI, prompt: Prompt, tools: list[dict]) -> None:
    messages = [dict(m) for m in prompt.messages]
    for _ in range(MAX_TURNS):
        try:
            response = client.chat.completions.create(model="policy", messages=messages, tools=tools)
        except openai.BadRequestError as e:  # no room left for a turn: the episode ends
            assert e.code == "context_length_exceeded"
            return
        choice = response.choices[0]
        if choice.finish_reason != "tool_calls":
            return
        answer_calls(messages, choice.message)


async def async_calculator_agent(client: openai.AsyncOpenAI, prompt: Prompt, tools: list[dict]) -> None:
    messages = [dict(m) for m in prompt.messages]
    for _ in range(MAX_TURNS):
        try:
            response = await client.chat.completions.create(model="policy", messages=messages, tools=tools)
        except openai.BadRequestError:
            return
        if response.choices[0].finish_reason != "tool_calls":
            return
        answer_calls(messages, response.choices[0].message)


def clean(completion) -> bool:
    """A native trajectory the agent above reproduces: every call ran without an error."""
    return completion.trajectory.stats.get("tool_errors", 0) == 0


def same_trajectory(ours, theirs) -> None:
    assert ours.ids == theirs.ids
    assert ours.logprobs == theirs.logprobs  # bitwise
    assert ours.trajectory.segments == theirs.trajectory.segments
    assert ours.trajectory.start.ids == theirs.trajectory.start.ids
    assert ours.trajectory.turn_versions == theirs.trajectory.turn_versions


@pytest.mark.exact
def test_a_session_is_the_native_trajectory_token_for_token(engine, endpoint, native, pool):
    compared = calls = 0
    with endpoint.generating(engine, PARAMS, 0):
        for prompt, index, theirs in native:
            if not clean(theirs):
                continue
            session = endpoint.open_session(prompt, PARAMS.seed, index)
            calculator_agent(openai.OpenAI(base_url=endpoint.url(session), api_key="-"), prompt, pool.tools)
            (ours,) = endpoint.end_session(session.key).completions()
            same_trajectory(ours, theirs)
            compared += 1
            calls += len(theirs.trajectory.tool_calls)
    assert compared >= 16 and calls >= 3  # some trajectories called the tool
    assert endpoint.metrics()["agent/prefix_breaks"] == 0


@pytest.mark.exact
def test_async_sessions_in_parallel_are_the_native_trajectories(engine, endpoint, native, pool):
    """AsyncOpenAI, every episode at once (the API key names the session): each turn joins
    the running batch as it arrives, and each trajectory is still its own."""
    chosen = [(p, i, c) for p, i, c in native if clean(c)]

    async def episodes(sessions):
        clients = [openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=s.key) for s in sessions]
        await asyncio.gather(*(async_calculator_agent(c, p, pool.tools) for c, (p, _, _) in zip(clients, chosen)))

    with endpoint.generating(engine, PARAMS, 0):
        sessions = [endpoint.open_session(p, PARAMS.seed, i) for p, i, _ in chosen]
        asyncio.run(episodes(sessions))
        for session, (_, _, theirs) in zip(sessions, chosen):
            (ours,) = endpoint.end_session(session.key).completions()
            same_trajectory(ours, theirs)


def first_call(native):
    """A native trajectory whose first turn calls the tool: (prompt, index)."""
    for prompt, index, c in native:
        if clean(c) and c.trajectory.tool_calls and len(c.trajectory.segments) >= 3:
            return prompt, index
    pytest.fail("no native trajectory calls the tool")


def reformatted(message: dict) -> dict:
    """The assistant message with its calls' JSON re-spaced, keys reordered, no content."""
    out = {k: v for k, v in message.items() if k != "content"}
    out["tool_calls"] = [
        {**c, "function": {"name": c["function"]["name"],
                           "arguments": json.dumps(dict(reversed(json.loads(c["function"]["arguments"]).items())), indent=3)}}
        for c in message["tool_calls"]
    ]  # fmt: skip
    return out


def test_reformatted_tool_call_json_continues_on_the_engines_ids(engine, endpoint, native, pool):
    prompt, index = first_call(native)
    made = []
    with endpoint.generating(engine, PARAMS, 0):
        for reformat in (False, True):
            session = endpoint.open_session(prompt, PARAMS.seed, index)
            client = openai.OpenAI(base_url=endpoint.url(session), api_key="-")
            messages = [dict(m) for m in prompt.messages]
            first = client.chat.completions.create(model="policy", messages=messages, tools=pool.tools)
            assert first.choices[0].finish_reason == "tool_calls"
            answer_calls(messages, first.choices[0].message)
            if reformat:
                messages[1] = reformatted(messages[1])
                assert messages[1]["tool_calls"][0]["function"]["arguments"].startswith('{\n   "b"')
            second = client.chat.completions.create(model="policy", messages=messages, tools=pool.tools)
            (trajectory,) = endpoint.end_session(session.key).completions()
            first_ids = first.choices[0].model_extra["token_ids"]
            second_ids = second.choices[0].model_extra["token_ids"]
            assert trajectory.ids[: len(first_ids)] == first_ids  # the engine's ids, verbatim
            assert trajectory.ids[-len(second_ids) :] == second_ids
            made.append(trajectory)
    assert made[0].ids == made[1].ids and made[0].logprobs == made[1].logprobs
    assert endpoint.metrics()["agent/prefix_breaks"] == 0


def test_a_history_edit_starts_a_new_counted_segment(engine, endpoint, native, pool):
    prompt, index = first_call(native)
    with endpoint.generating(engine, PARAMS, 0):
        session = endpoint.open_session(prompt, PARAMS.seed, index)
        client = openai.OpenAI(base_url=endpoint.base_url, api_key=session.key)
        messages = [dict(m) for m in prompt.messages]
        first = client.chat.completions.create(model="policy", messages=messages, tools=pool.tools)
        answer_calls(messages, first.choices[0].message)
        messages[0] = {"role": "user", "content": "Please add: " + messages[0]["content"]}  # edited
        client.chat.completions.create(model="policy", messages=messages, tools=pool.tools)
        segments = endpoint.end_session(session.key).completions()
    assert len(segments) == 2
    assert segments[0].ids == first.choices[0].model_extra["token_ids"]  # the first stays as made
    edited = segments[1].trajectory
    assert edited.segments == [(len(segments[1].ids), True)]  # the history is its prompt
    assert edited.start.messages[0]["content"].startswith("Please add: ")
    assert "Please add: " in edited.start.text and edited.start.text.count("<|assistant|>") == 2
    assert endpoint.metrics()["agent/prefix_breaks"] == 1


def test_streamed_and_plain_answers_carry_the_same_ids(engine, endpoint, native, pool):
    prompt, index = first_call(native)
    got = {}
    with endpoint.generating(engine, PARAMS, 0):
        for stream in (False, True):
            session = endpoint.open_session(prompt, PARAMS.seed, index)
            client = openai.OpenAI(base_url=endpoint.url(session), api_key="-")
            kwargs = {"model": "policy", "messages": prompt.messages, "tools": pool.tools, "logprobs": True}
            if stream:
                ids, logprobs, calls, finish = [], [], [], None
                for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
                    if not chunk.choices:
                        assert chunk.usage.completion_tokens == len(ids)
                        continue
                    choice = chunk.choices[0]
                    ids += (choice.model_extra or {}).get("token_ids", [])
                    logprobs += [t.logprob for t in (choice.logprobs.content if choice.logprobs else [])]
                    calls += choice.delta.tool_calls or []
                    finish = choice.finish_reason or finish
                got[stream] = (ids, logprobs, [c.function.arguments for c in calls], finish)
            else:
                choice = client.chat.completions.create(**kwargs).choices[0]
                got[stream] = (choice.model_extra["token_ids"], [t.logprob for t in choice.logprobs.content],
                               [c.function.arguments for c in choice.message.tool_calls], choice.finish_reason)  # fmt: skip
            (trajectory,) = endpoint.end_session(session.key).completions()
            assert got[stream][0] == trajectory.ids and got[stream][1] == trajectory.logprobs
    assert got[True] == got[False] and got[True][3] == "tool_calls"


def test_what_the_run_cannot_honour_is_refused_openai_style(engine, endpoint, native, pool):
    prompt, index = first_call(native)
    endpoint.metrics()  # counts from here
    with endpoint.generating(engine, PARAMS, 0):
        session = endpoint.open_session(prompt, PARAMS.seed, index)
        client = openai.OpenAI(base_url=endpoint.url(session), api_key="-", max_retries=0)
        for bad, param in [({"temperature": 0.7}, "temperature"), ({"top_p": 0.9}, "top_p"),
                           ({"n": 2}, "n"), ({"presence_penalty": 0.5}, "presence_penalty"),
                           ({"tool_choice": "required"}, "tool_choice")]:  # fmt: skip
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model="policy", messages=prompt.messages, tools=pool.tools, **bad)
            assert refused.value.param == param and param in refused.value.message
        ok = client.chat.completions.create(model="policy", messages=prompt.messages, temperature=1.0, max_tokens=5)
        assert ok.usage.completion_tokens <= 5  # the run's temperature is accepted; the budget capped
        foreign = openai.OpenAI(base_url=endpoint.base_url, api_key="lg-not-a-session", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            foreign.chat.completions.create(model="policy", messages=prompt.messages)
        ended = endpoint.end_session(session.key)
        assert len(ended.segments) == 1  # the refused requests recorded nothing
        with pytest.raises(openai.AuthenticationError):  # an ended session's key is foreign
            client.chat.completions.create(model="policy", messages=prompt.messages)
    metrics = endpoint.metrics()
    assert metrics["agent/refused"] == 7 and metrics["agent/foreign_keys"] == 2
    assert metrics["agent/requests"] == 6  # the session's own (refused ones included)


def test_completions_continue_on_token_ids_and_models_are_listed(engine, endpoint, tokenizer):
    with endpoint.generating(engine, PARAMS, 0):
        session = endpoint.open_session(None, 11, 0)
        client = openai.OpenAI(base_url=endpoint.url(session), api_key="-")
        assert [m.id for m in client.models.list()] == ["policy"]
        prompt = tokenizer("<|user|>1+2=<|end|><|assistant|>", add_special_tokens=False).input_ids
        first = client.completions.create(model="policy", prompt=prompt, max_tokens=8, logprobs=1,
                                          extra_body={"return_token_ids": True})  # fmt: skip
        ids = first.choices[0].model_extra["token_ids"]
        assert first.model_extra["prompt_token_ids"] == prompt and len(ids) <= 8
        more = tokenizer("<|user|>again<|end|><|assistant|>", add_special_tokens=False).input_ids
        second = client.completions.create(model="policy", prompt=prompt + ids + more, max_tokens=8)
        (trajectory,) = endpoint.end_session(session.key).completions()
    second_ids = second.choices[0].model_extra["token_ids"]
    assert trajectory.ids == ids + more + second_ids
    assert trajectory.trajectory.segments == [(len(ids), True), (len(more), False), (len(second_ids), True)]
    assert trajectory.logprobs[: len(ids)] == first.choices[0].logprobs.token_logprobs


def test_an_oversized_body_is_refused_before_it_is_read_and_rendering_is_off_the_loop(engine, endpoint, monkeypatch):
    """413 from Content-Length, or from the bytes streamed so far (no length declared);
    a request's rendering runs in a worker thread, never on the loop every session shares."""
    limit = max_body_bytes(endpoint.config.max_total_tokens)
    threads = []
    plan_chat = Session.plan_chat

    def recorded(self, *args):
        threads.append(threading.current_thread())
        return plan_chat(self, *args)

    monkeypatch.setattr(Session, "plan_chat", recorded)
    endpoint.metrics()  # counts from here
    with endpoint.generating(engine, PARAMS, 0):
        session = endpoint.open_session(None, 1, 0)
        headers = {"Authorization": f"Bearer {session.key}", "Content-Type": "application/json"}
        url = endpoint.base_url + "/chat/completions"
        big = json.dumps({"messages": [{"role": "user", "content": "x" * limit}]}).encode()
        declared = httpx.post(url, headers=headers, content=big, timeout=60)
        streamed = httpx.post(url, headers=headers, content=(big[i : i + 65536] for i in range(0, len(big), 65536)),
                              timeout=60)  # fmt: skip
        ok = httpx.post(url, headers=headers, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                        timeout=60)  # fmt: skip
        endpoint.end_session(session.key)
    for refused in (declared, streamed):
        assert refused.status_code == 413 and refused.json()["error"]["code"] == "request_too_large"
    assert ok.status_code == 200 and endpoint.metrics()["agent/refused"] == 2
    assert threads and all(t is not endpoint._thread for t in threads)


def test_max_requests_is_the_number_of_requests_answered(engine, tokenizer):
    made = AgentEndpoint(tokenizer, AgentConfig(max_total_tokens=MAX_TOTAL, max_requests=2), None, {tokenizer.eos_token_id})
    made.start()
    try:
        with made.generating(engine, PARAMS, 0):
            session = made.open_session(None, 1, 0)
            client = openai.OpenAI(base_url=made.url(session), api_key="-", max_retries=0)
            messages = [{"role": "user", "content": "1+2="}]
            for _ in range(2):
                client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
            ended = made.end_session(session.key)
    finally:
        made.close()
    assert refused.value.code == "session_limit" and "2 requests" in refused.value.message
    assert ended.stats["requests"] == 3 and ended.stats["turns"] == 2


@pytest.mark.parametrize("depth", [100_000, 900])
def test_deeply_nested_json_is_refused_and_counted(engine, endpoint, depth):
    """Too deep to parse, or parsed but too deep to render: 400, OpenAI-style, counted."""
    endpoint.metrics()  # counts from here
    nested = "[" * depth + "]" * depth
    body = f'{{"messages": [{{"role": "user", "content": "x"}}], "tools": {nested}}}' if depth < 1000 else nested
    with endpoint.generating(engine, PARAMS, 0):
        session = endpoint.open_session(None, 1, 0)
        answer = httpx.post(endpoint.base_url + "/chat/completions", content=body.encode(), timeout=60,
                            headers={"Authorization": f"Bearer {session.key}"})  # fmt: skip
        endpoint.end_session(session.key)
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"
    assert endpoint.metrics()["agent/refused"] == 1


class GatedEngine:
    """A turn engine that answers only once `gate` is set (`asked` says a turn arrived)."""

    version = 0

    def __init__(self, tokenizer):
        self.tokenizer, self.asked, self.gate, self.released = tokenizer, threading.Event(), threading.Event(), []

    @contextlib.contextmanager
    def open_turns(self, params, version):
        yield self

    def submit(self, request):
        self.queue, self.queue_key = [*getattr(self, "queue", []), request], request.key
        self.asked.set()

    def pending(self):
        return len(getattr(self, "queue", []))

    def advance(self, timeout):
        if not self.gate.wait(0.01):
            return []
        done, self.queue = self.queue, []
        ids = [*self.tokenizer.encode("hi", add_special_tokens=False), self.tokenizer.eos_token_id]
        return [(r, Completion(ids, "hi", [-0.5] * len(ids), "stop", 0)) for r in done]

    def release(self, key):
        self.released.append(key)

    def metrics(self):
        return {}

    def close(self):
        pass


HI = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}


def test_a_turn_whose_session_ended_meanwhile_is_refused_and_released(endpoint, tokenizer):
    gated = GatedEngine(tokenizer)
    with endpoint.generating(gated, PARAMS, 0):
        session = endpoint.open_session(None, 1, 0)
        answers = []
        late = threading.Thread(target=lambda: answers.append(httpx.post(
            endpoint.base_url + "/chat/completions", json=HI, timeout=60,
            headers={"Authorization": f"Bearer {session.key}"})))  # fmt: skip
        late.start()
        assert gated.asked.wait(60)
        ended = endpoint.end_session(session.key)  # the episode's reply came back first
        gated.gate.set()
        late.join(60)
    assert answers[0].status_code == 404 and answers[0].json()["error"]["code"] == "session_ended"
    assert ended.segments == [] and gated.released == [gated.queue_key]


def test_a_turn_whose_client_disconnected_is_not_recorded(endpoint, tokenizer):
    gated = GatedEngine(tokenizer)
    endpoint.metrics()  # counts from here
    with endpoint.generating(gated, PARAMS, 0):
        session = endpoint.open_session(None, 1, 0)
        body = json.dumps(HI).encode()
        client = socket.create_connection(("127.0.0.1", endpoint.port))
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       + f"Authorization: Bearer {session.key}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        assert gated.asked.wait(60)
        client.close()  # the agent gave up (its timeout, its box killed)
        gated.gate.set()
        deadline = time.monotonic() + 60  # against a hang only
        while endpoint.stats["abandoned"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        ended = endpoint.end_session(session.key)
    assert ended.segments == [] and ended.stats["turns"] == 0
    assert endpoint.metrics()["agent/abandoned"] == 1
