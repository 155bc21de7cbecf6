"""The tool demo's task as an ordinary OpenAI Agents SDK agent (`make demo-agent`).

The calculator is a `function_tool`; the agent is an `Agent` run by `Runner.run` against
the chat-completions client leangrpo hands it (already pointed at the episode's session
on the trainer's endpoint). Nothing here knows about leangrpo: pointed at any
OpenAI-compatible server, `run` does the same. It returns None, so the run's
`rewards.functions` (the `math` reward on the final answer) score the episode.

Heavy imports sit at the top: each agent worker imports this module once, and every
episode's box starts from that import.
"""

from __future__ import annotations

import contextlib

import openai
from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded

set_tracing_disabled(True)  # no traces sent to OpenAI's servers


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return int(a) + int(b)


async def run(client: openai.AsyncOpenAI, task: dict) -> None:
    model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
    agent = Agent(name="calculator", tools=[add], model=model)
    # out of turns or of tokens: the episode ends there, scored on its last turn, as the
    # tool environment's
    with contextlib.suppress(MaxTurnsExceeded, openai.BadRequestError):
        await Runner.run(agent, task["messages"], max_turns=3)
    return None
