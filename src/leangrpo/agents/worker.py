"""An agent worker: each episode in a box of its own, reaching the endpoint and nothing else.

Started by episodes.py like every worker (sandbox/launch.py: confined, a supervisor that
holds the channel, a zygote that imports; sandbox/box.py has the picture). Two halves:

- `prepare(init, announce)`, in the zygote: for `agent.entry`, import the agent's
  `run(client, task)` and the openai SDK (so a box starts with them loaded), report ready
  (or one init_error line); for `agent.command`, nothing to import.
- `supervise(channel, init, boxes)`, in the supervisor: tasks are episodes
  `{"id", "key", "task"}`, one at a time. Each runs in a new box without network whose
  one address is the endpoint's unix socket forwarded into it (`forward`): for an entry,
  the box's `run(client, task)` with an `openai.OpenAI` (or `AsyncOpenAI` for an async
  `run`) at the forwarded address and the session's key; for a command, `sh -c COMMAND`
  with OPENAI_BASE_URL and OPENAI_API_KEY set and the task as JSON on stdin, its reward
  the last line it prints. The box is killed with its tree when the episode ends, replies
  or not, by `agent.timeout_s`. The reply `{"t": "episode", "id", "reward" | "error"}`:
  a reward is a number, an object of numbers (reward terms) or null (rewards.functions
  score the episode); anything else, a crash, a timeout, is an error (counted, unscored).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import json
import math
import os
import pickle
import select
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from leangrpo.sandbox.box import Box, BoxConn, Boxes, Failed
from leangrpo.sandbox.frames import Channel

MAX_ERROR_CHARS = 300
MAX_OUTPUT_BYTES = 1 << 16  # what a command may print (its reward is the last line)


def prepare(init: dict, announce: Callable[[dict], None]) -> Callable[[BoxConn], None] | None:
    sys.path[:0] = [p for p in init["sys_path"] if p not in sys.path]
    if init.get("command"):
        announce({"t": "ready"})
        return lambda conn: None
    try:
        from leangrpo.rewards import resolve

        importlib.import_module("openai")  # loaded once here, not in every box
        _warm_openai()
        run = resolve(init["agent_entry"])
        if not callable(run):
            raise TypeError(f"{type(run).__name__} is not callable")
        if "agents" in sys.modules:  # the agent uses the OpenAI Agents SDK
            _warm_agents_sdk()
    except BaseException as e:  # SystemExit at import included
        announce({"t": "init_error", "msg": f"agent.entry = {init['agent_entry']!r}: {type(e).__name__}: {e}"})
        return None
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    announce({"t": "ready"})
    return lambda conn: _episode(run, conn)


WARM_COMPLETION = {
    "id": "warm", "object": "chat.completion", "created": 0, "model": "policy",
    "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "",
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}  # fmt: skip


def _warm_openai() -> None:
    """One chat completion, sync and async, against a canned answer (no network): what
    the SDK does lazily on a client's first request (platform headers, the response
    models' validators, about 0.1 s of CPU) is then done once here, in the zygote, and
    every episode's box starts with it done."""
    import httpx
    import openai

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=WARM_COMPLETION)

    messages = [{"role": "user", "content": "warm"}, {"role": "tool", "tool_call_id": "c", "content": "1"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    http = httpx.Client(transport=httpx.MockTransport(answer))
    openai.OpenAI(base_url="http://warm/v1", api_key="-", http_client=http).chat.completions.create(
        model="policy", messages=messages, tools=tools
    ).choices[0].message.model_dump(exclude_none=True)

    async def warm_async() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            aclient = openai.AsyncOpenAI(base_url="http://warm/v1", api_key="-", http_client=client)
            await aclient.chat.completions.create(model="policy", messages=messages, tools=tools)

    asyncio.run(warm_async())


def _warm_agents_sdk() -> None:
    """One Runner.run of a one-tool Agent against canned answers (a call, then text): the
    SDK's own first-run work (about 30 ms of CPU) done once in the zygote, not in every
    box. Best effort: an SDK whose API differs is simply not warmed."""
    import httpx
    import openai

    try:
        from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool
    except ImportError:
        return
    turns = iter([WARM_COMPLETION, {**WARM_COMPLETION, "choices": [{"index": 0, "finish_reason": "stop",
                  "message": {"role": "assistant", "content": "1"}}]}])  # fmt: skip

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=next(turns, WARM_COMPLETION))

    def f() -> int:
        """Return 1."""
        return 1

    async def warm() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
            client = openai.AsyncOpenAI(base_url="http://warm/v1", api_key="-", http_client=http)
            model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
            agent = Agent(name="warm", tools=[function_tool(f)], model=model)
            await Runner.run(agent, "warm", max_turns=2)

    with contextlib.suppress(Exception):
        asyncio.run(warm())


def _episode(run: Callable, conn: BoxConn) -> None:
    """In the box: the agent's run(client, task), its return as the reply."""
    request = conn.recv()
    import openai

    base = f"{conn.endpoint}/v1"
    # plain HTTP to the forwarded endpoint: no TLS, so no certificate store to load (what
    # the SDK's default client does on every construction: ~40 ms of CPU per episode)
    try:
        if inspect.iscoroutinefunction(run):
            http: Any = openai.DefaultAsyncHttpxClient(verify=False)
            client: Any = openai.AsyncOpenAI(base_url=base, api_key=request["key"], max_retries=0, http_client=http)
            result = asyncio.run(run(client, request["task"]))
        else:
            http = openai.DefaultHttpxClient(verify=False)
            client = openai.OpenAI(base_url=base, api_key=request["key"], max_retries=0, http_client=http)
            result = run(client, request["task"])
        reply = {"reward": reward_of(result)}
    except Exception as e:  # noqa: BLE001  the agent's failure is its episode's error
        traceback.print_exc()
        reply = {"error": _line(f"{type(e).__name__}: {e}")}
    conn.send(reply)


def reward_of(value: Any) -> float | dict[str, float] | None:
    """What an agent may return: a number, a dict of numbers, or None; else TypeError."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    if isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        for k, v in value.items()
    ):
        return {k: float(v) for k, v in value.items()}
    raise TypeError(f"the agent returned {type(value).__name__} {str(value)[:60]!r}; return a number, a dict of numbers or None")


def _line(text: str) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= MAX_ERROR_CHARS else flat[: MAX_ERROR_CHARS - 3] + "..."


# -- the supervisor -------------------------------------------------------------------------


def supervise(channel: Channel, init: dict, boxes: Boxes) -> None:
    if boxes.forward_setup(channel, init["mode"] == "serve") is None:
        return
    boxes.spare_count = 0  # every box is made with the endpoint forwarded into it
    while True:
        episode = pickle.loads(channel.recv())
        deadline = time.monotonic() + float(init["timeout_s"])
        if init.get("command"):
            reply = _command(boxes, init, episode, deadline)
        else:
            reply = _entry(boxes, init, episode, deadline)
        channel.send({"t": "episode", "id": episode["id"], **reply})


def _entry(boxes: Boxes, init: dict, episode: dict, deadline: float) -> dict:
    box = boxes.start(network=False, forward=init["forward"])
    try:
        outcome = boxes.ask(box, {"key": episode["key"], "task": episode["task"]}, deadline)
    finally:
        boxes.end(box)
    if isinstance(outcome, Failed):
        what = f"the agent ran past agent.timeout_s = {init['timeout_s']}" if outcome.kind == "timeout" else f"{outcome.kind}: {outcome.msg}"
        return {"error": _line(what), "kind": outcome.kind}
    message = outcome.message
    if "error" in message:
        return {"error": _line(str(message["error"])), "kind": "raised"}
    return {"reward": message.get("reward")}


def _command(boxes: Boxes, init: dict, episode: dict, deadline: float) -> dict:
    # the command as the shell line it was checked as (no `exec`: `exec VAR=1 prog` is not
    # a command); the box ends the shell's whole tree with the episode
    script = f'OPENAI_BASE_URL="$LEANGRPO_ENDPOINT/v1"; export OPENAI_BASE_URL; {init["command"]}'
    box = boxes.command(["/bin/sh", "-c", script], network=False, forward=init["forward"],
                        env={"OPENAI_API_KEY": episode["key"]})  # fmt: skip
    try:
        with_stdin(box, json.dumps(episode["task"]).encode())
        out, timed_out = _read_until_eof(boxes, box, deadline)
    finally:
        boxes.end(box)
    if timed_out:
        return {"error": f"the agent ran past agent.timeout_s = {init['timeout_s']}", "kind": "timeout"}
    lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
    if not lines:
        return {"error": "the agent command printed no reward (print a number, a JSON object of numbers, or null as its last line)", "kind": "no reward"}
    try:
        return {"reward": reward_of(json.loads(lines[-1]))}
    except (ValueError, TypeError) as e:
        return {"error": _line(f"the agent command's last line {lines[-1][:60]!r} is not a reward: {e}"), "kind": "no reward"}


def with_stdin(box: Box, data: bytes) -> None:
    with contextlib.suppress(OSError):  # the command does not read its task: its business
        os.write(box.stdin, data)
    os.close(box.stdin)
    box.stdin = None


def _read_until_eof(boxes: Boxes, box: Box, deadline: float) -> tuple[bytes, bool]:
    """What the command prints on stdout until it closes it (its stderr relayed to the
    log meanwhile); True when the deadline came first."""
    chunks, size, watched = [], 0, [box.stdout, box.out]
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"".join(chunks), True
        ready, _, _ = select.select(watched, [], [], left)
        if box.out in ready:
            data = os.read(box.out, 1 << 16)
            if data:
                os.write(1, data[:4096])
            else:
                watched.remove(box.out)
        if box.stdout in ready:
            data = os.read(box.stdout, 1 << 16)
            if not data:
                return b"".join(chunks), False
            if size < MAX_OUTPUT_BYTES:
                chunks.append(data[: MAX_OUTPUT_BYTES - size])
                size += len(chunks[-1])
