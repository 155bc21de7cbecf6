"""Agents the agent tests run in boxes (agent.entry = 'support.agents:NAME'; the workers get
the tests' sys.path). Each does one thing. The module is imported once per worker (the
OpenAI Agents SDK with it); each episode's box starts from that import."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

# imported once per worker (each episode's box starts from it), not once per episode
from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

set_tracing_disabled(True)


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return int(a) + int(b)


async def calculator(client, task):
    """The tool demo as an OpenAI Agents SDK agent: the calculator as a function_tool."""
    model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
    agent = Agent(name="calculator", tools=[add], model=model)
    result = await Runner.run(agent, task["messages"], max_turns=3)
    return 1.0 if task["answer"] in str(result.final_output) else 0.0


def native_tools(client, task):
    """The native tool environment's loop as an agent with the plain openai client: the
    calculator's schema as the environment offers it, one tool message per call, at most 3
    turns; no reward (rewards.functions score the episode)."""
    import openai

    from leangrpo.environments.schema import tool_schema

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "tools_demo"))
    from calculator import add

    tools, messages = [tool_schema(add)], [dict(m) for m in task["messages"]]
    for _ in range(3):
        try:
            response = client.chat.completions.create(model="policy", messages=messages, tools=tools)
        except openai.BadRequestError:  # no room left for a turn: the episode ends
            return None
        choice = response.choices[0]
        if choice.finish_reason != "tool_calls":
            return None
        messages.append(choice.message.model_dump(exclude_none=True))
        for call in choice.message.tool_calls:
            result = add(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    return None


def crash(client, task):
    raise RuntimeError("the agent fell over")


def hang(client, task):
    time.sleep(3600)


def flood(client, task):
    while True:  # until the session's request limit refuses it
        client.chat.completions.create(model="policy", messages=task["messages"], max_tokens=1)


def foreign(client, task):
    import openai

    other = openai.OpenAI(base_url=str(client.base_url), api_key="lg-someone-elses-session", max_retries=0)
    other.chat.completions.create(model="policy", messages=task["messages"])


def one_turn(client, task):
    """One request; the reward terms say what the answer held."""
    r = client.chat.completions.create(model="policy", messages=task["messages"], max_tokens=8)
    return {"answered": 1.0, "tokens": float(r.usage.completion_tokens)}


def outside(client, task):
    """Reach the endpoint, then try an address outside the box: the reward says which worked."""
    client.chat.completions.create(model="policy", messages=task["messages"], max_tokens=1)
    try:
        socket.create_connection(("127.0.0.1", int(task["port"])), timeout=2).close()
        return 1.0
    except OSError:
        return 0.0


def returns_at_once(client, task):
    """No request: what a box per episode costs (benchmarks/agent.py)."""
    return 0.0


def silent(client, task):
    """One request and no reward: rewards.functions must score it."""
    client.chat.completions.create(model="policy", messages=task["messages"], max_tokens=2)
