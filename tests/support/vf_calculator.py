"""A verifiers 0.4 v1 environment (taskset id `vf_calculator`, tests/support on PYTHONPATH;
run in .venv-verifiers only): the tool demo's task as a v1 `Taskset` and its bundled
`Harness`, for tests/agents/test_verifiers_v1.py.

- `CalculatorTaskset` loads the tool demo's problems (examples/tools_demo/train.jsonl) as
  `CalculatorTask`s, whose `@vf.reward` `correct` is 1.0 when the answer is in the last reply.
- `CalculatorHarness` runs its loop in-process (the v1 contract allows it: every model call
  goes through the interception `endpoint` with the rollout's `secret`): the openai SDK's
  `AsyncOpenAI`, the calculator's `add` offered as the native tool environment offers it,
  one tool message per call, at most 3 turns, a 400 (no room for a turn) ending the run, as
  tests/support/agents.py `native_tools` does. With LEANGRPO_TEST_IDS set it appends, per
  answer, the token ids the answer carried (vLLM's `token_ids`, relayed by verifiers'
  interception server) to that file, one JSON list a line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import openai
import verifiers.v1 as vf

from leangrpo.environments.schema import tool_schema

TOOLS_DEMO = Path(__file__).resolve().parents[2] / "examples" / "tools_demo"
sys.path.insert(0, str(TOOLS_DEMO))
from calculator import add  # noqa: E402

MAX_TURNS = 3
__all__ = ["CalculatorHarness", "CalculatorTaskset"]


class CalculatorData(vf.TaskData):
    answer: str


class CalculatorTask(vf.Task[CalculatorData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: CalculatorData, trace: vf.Trace) -> float:
        return 1.0 if task.answer in trace.last_reply else 0.0


class CalculatorTaskset(vf.Taskset[CalculatorTask, vf.TasksetConfig]):
    def load(self):
        with open(TOOLS_DEMO / "train.jsonl", encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                yield CalculatorTask(CalculatorData(prompt=row["prompt"], answer=row["answer"]), self.config.task)


class CalculatorHarness(vf.Harness[vf.HarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [m.model_dump(mode="json", exclude_none=True) for m in prompt or []]
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        await calculator_loop(client, ctx.model, messages)
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


async def calculator_loop(client: openai.AsyncOpenAI, model: str, messages: list[dict]) -> None:
    tools = [tool_schema(add)]
    for _ in range(MAX_TURNS):
        try:
            response = await client.chat.completions.create(model=model, messages=messages, tools=tools)
        except openai.BadRequestError:  # no room left for a turn: the episode ends
            return
        choice = response.choices[0]
        if os.environ.get("LEANGRPO_TEST_IDS"):
            with open(os.environ["LEANGRPO_TEST_IDS"], "a", encoding="utf-8") as f:
                f.write(json.dumps(choice.model_extra["token_ids"]) + "\n")
        if choice.finish_reason != "tool_calls":
            return
        messages.append(choice.message.model_dump(exclude_none=True))
        for call in choice.message.tool_calls:
            result = add(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
