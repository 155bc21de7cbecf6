"""Agents the agent tests run in boxes (agent.entry = 'support.agents:NAME'; the workers get
the tests' sys.path). Each does one thing."""

from __future__ import annotations

import json
import socket
import sys
import time


async def calculator(client, task):
    """The tool demo as an OpenAI Agents SDK agent: the calculator as a function_tool."""
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        return int(a) + int(b)

    model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
    agent = Agent(name="calculator", tools=[add], model=model)
    result = await Runner.run(agent, task["messages"], max_turns=3)
    return 1.0 if task["answer"] in str(result.final_output) else 0.0


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


if __name__ == "__main__":  # agent.command: the task on stdin, the reward printed
    import openai

    task = json.load(sys.stdin)
    r = openai.OpenAI(max_retries=0).chat.completions.create(model="policy", messages=task["messages"], max_tokens=4)
    print(json.dumps({"tokens": float(r.usage.completion_tokens)}))
