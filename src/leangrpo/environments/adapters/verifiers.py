"""verifiers' classic environments (`vf.MultiTurnEnv`, `vf.ToolEnv`) as a leangrpo environment.

    environment: {name: verifiers, kwargs: {load: 'path/to/file.py:load_environment', args: {...}}}
    environment: {name: verifiers, kwargs: {env_id: my-env, args: {...}}}  (an installed
                                                                           verifiers package)

Needs verifiers >= 0.2, < 0.4 (`pip install 'leangrpo[verifiers]'`, Python >= 3.11): 0.4
replaced MultiTurnEnv with its v1 stack, where a harness program drives the model over
HTTP (verifiers owns the loop; leangrpo cannot drive it turn by turn), so it is refused in
one line here; a v1 environment trains as an agent instead (agents/verifiers_v1.py, in a
venv of its own). The data: `python -m leangrpo.environments.adapters.verifiers --load ... --out
train.jsonl` writes the environment's dataset (`--eval`: its eval dataset) as rows with the
prompt messages and the columns verifiers' rubric reads (answer, info, task, example_id);
train on them with data.chat_template: true.

leangrpo generates every model turn and verifiers answers it, in the environment worker:
per trajectory `init_state` (with a client that refuses to be called: verifiers never
calls a model here), `setup_state` and the prompt messages; per turn a verifiers Response
made from the turn's text and the calls leangrpo's tool parser read, then
`add_model_response`, `is_completed` and, if not done, `get_prompt_messages` (which runs
`env_response`): its new messages are the reply. At the end `cleanup` and
`rubric.score_rollout`: the rubric's weighted reward is the reward term `reward`, its
functions' values the metrics (`multiturn/env/<name>`). leangrpo's limits apply, not
verifiers' (timeout_seconds, token budgets); group rubrics (score_group) are not run.
A ToolEnv's tools are offered through the chat template and run by verifiers.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import time
import uuid
from typing import Any, ClassVar

from leangrpo.environments.protocol import Environment, ModelTurn, StepResult
from leangrpo.environments.registry import EnvironmentSpecError, load

REQUIRES = "verifiers>=0.2,<0.4"


def import_verifiers() -> Any:
    try:
        import verifiers as vf
    except ImportError:
        raise EnvironmentSpecError(
            f"environment.name 'verifiers' needs verifiers installed: pip install '{REQUIRES}' (Python >= 3.11)"
        ) from None
    if not hasattr(vf, "MultiTurnEnv") or str(vf.__version__).startswith("0.4"):
        raise EnvironmentSpecError(
            f"verifiers {vf.__version__} replaced MultiTurnEnv with its v1 harness stack, which leangrpo cannot drive turn by turn; install '{REQUIRES}', or train a v1 environment as an agent (agent.command: .venv-verifiers/bin/python -m leangrpo.agents.verifiers_v1 --taskset ID; docs/agents.md)"
        )
    return vf


def load_vf_environment(load_name: str | None = None, env_id: str | None = None, args: dict | None = None) -> Any:
    if (load_name is None) == (env_id is None):
        raise EnvironmentSpecError(
            "environment.kwargs for verifiers need exactly one of load ('path/to/file.py:load_environment') and env_id (an installed verifiers environment)"
        )
    if env_id is not None:
        _check_installed(env_id)  # before importing verifiers, which takes seconds
        return import_verifiers().load_environment(env_id, **(args or {}))
    vf = import_verifiers()
    factory = load(load_name, "environment.kwargs.load")
    env = factory(**(args or {}))
    if not isinstance(env, vf.MultiTurnEnv):
        raise EnvironmentSpecError(
            f"environment.kwargs.load = {load_name!r} returned {type(env).__name__}, not a verifiers MultiTurnEnv"
        )
    return env


def _check_installed(env_id: str) -> None:
    """verifiers imports environment `env_id` as the module `env_id` with '-' as '_'."""
    module = str(env_id).replace("-", "_").split("/")[-1]
    try:
        found = module.isidentifier() and importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise EnvironmentSpecError(
            f"environment.kwargs.env_id = {env_id!r}: no installed module {module!r}, which verifiers would import it as; install the environment's package (e.g. vf-install {env_id}), or give its file as environment.kwargs.load"
        )


class VerifiersEnvironment(Environment):
    """One verifiers rollout, driven turn by turn (see the module docstring)."""

    reward_terms = ("reward",)  # the rubric's weighted reward
    _loaded: ClassVar[dict[str, Any]] = {}  # one verifiers environment per worker and spec
    _loop: ClassVar[asyncio.AbstractEventLoop | None] = None

    def __init__(self, load: str | None = None, env_id: str | None = None, args: dict | None = None):
        key = json.dumps([load, env_id, args], sort_keys=True, default=str)
        if key not in self._loaded:
            self._loaded[key] = load_vf_environment(load, env_id, args)
        self.vf_env = self._loaded[key]
        self.replies = ("tool",) if getattr(self.vf_env, "tools", None) else ("user",)

    def offered_tools(self) -> list:
        return [*(getattr(self.vf_env, "tools", None) or []), *super().offered_tools()]

    @classmethod
    def _run(cls, coroutine: Any) -> Any:
        if cls._loop is None:  # one loop for every session of this worker
            cls._loop = asyncio.new_event_loop()
        return cls._loop.run_until_complete(coroutine)

    def reset(self, messages: list[dict], row: dict[str, Any], seed: int) -> list[dict]:
        env = self.vf_env
        row_input = {"prompt": messages, **row}
        row_input.setdefault("example_id", 0)
        self.state = self._run(env.init_state(row_input, client=_no_client(), model="leangrpo"))
        self.state = self._run(env.setup_state(self.state)) or self.state
        self.prompt = self._run(env.get_prompt_messages(self.state))
        return [_as_dict(m) for m in self.prompt]

    def step(self, turn: ModelTurn) -> StepResult:
        from verifiers.types import Response, ResponseMessage, ToolCall

        env, state = self.vf_env, self.state
        calls = [
            ToolCall(id=f"call_{uuid.uuid4().hex[:8]}", name=c.name, arguments=json.dumps(c.arguments))
            for c in turn.calls
        ]
        message = ResponseMessage(
            content=turn.content if calls else turn.text,
            tool_calls=calls or None,
            finish_reason="tool_calls" if calls else "stop",
            is_truncated=False,
            tokens=None,
        )
        response = Response(id="leangrpo", created=int(time.time()), model="leangrpo", message=message)
        self._run(env.add_model_response(state, self.prompt, response))
        if self._run(env.is_completed(state)):
            return StepResult(done=True)
        before = len(self.prompt) + 1  # the prompt so far and the turn
        self.prompt = self._run(env.get_prompt_messages(state))
        if state.get("final_env_response") is not None:
            return StepResult([_as_dict(m) for m in state["final_env_response"]], done=True)
        reply = [_as_dict(m) for m in self.prompt[before:]]
        return StepResult(reply, done=self._run(env.is_completed(state)))

    def finish(self, finish_reason: str) -> StepResult:
        env, state = self.vf_env, self.state
        self._run(env.cleanup(state))
        self._run(env.rubric.score_rollout(state))
        metrics = {k: float(v) for k, v in (state.get("metrics") or {}).items()}
        reward = state.get("reward")
        return StepResult(rewards={"reward": float(reward)} if reward is not None else {}, metrics=metrics)


def _as_dict(message: Any) -> dict[str, Any]:
    """A verifiers message as the chat template reads it (content as text)."""
    d = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
    content = d.get("content")
    if isinstance(content, list):  # content parts: their text
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    out = {"role": d["role"], "content": content or ""}
    for key in ("name", "tool_call_id"):
        if isinstance(d.get(key), str):
            out[key] = d[key]
    return out


_CLIENT: Any = None


def _no_client() -> Any:
    """A verifiers Client that refuses to be called: leangrpo generates the turns."""
    global _CLIENT
    if _CLIENT is None:
        vf = import_verifiers()

        class NoClient(vf.Client):
            def __init__(self):
                pass

            def setup_client(self, config):
                return None

            async def get_native_response(self, *args, **kwargs):
                raise RuntimeError("leangrpo generates the model's turns; verifiers must not call a model")

            async def to_native_prompt(self, messages):
                raise NotImplementedError

            async def raise_from_native_response(self, response):
                return None

            async def from_native_response(self, response):
                raise NotImplementedError

            async def to_native_tool(self, tool):
                raise NotImplementedError

            async def close(self):
                return None

        _CLIENT = NoClient()
    return _CLIENT


# -- the data -------------------------------------------------------------------------------


def dataset_rows(env: Any, evaluation: bool = False) -> list[dict[str, Any]]:
    """The environment's dataset as leangrpo prompt rows (prompt messages + columns)."""
    data = env.get_eval_dataset() if evaluation else env.get_dataset()
    rows = []
    for row in data:
        prompt = row["prompt"]
        out = {"prompt": [_as_dict(m) for m in prompt] if isinstance(prompt, list) else prompt}
        for key in ("answer", "info", "task", "example_id"):
            if row.get(key) is not None:
                out[key] = row[key]
        rows.append(out)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m leangrpo.environments.adapters.verifiers",
        description="Write a verifiers environment's dataset as leangrpo prompt rows (JSONL).",
    )
    parser.add_argument("--load", help="'path/to/file.py:load_environment' or 'pkg.module:function'")
    parser.add_argument("--env-id", help="an installed verifiers environment")
    parser.add_argument("--args", default="{}", help="keyword arguments as JSON")
    parser.add_argument("--eval", action="store_true", help="the eval dataset")
    parser.add_argument("--out", required=True)
    ns = parser.parse_args(argv)
    env = load_vf_environment(ns.load, ns.env_id, json.loads(ns.args))
    rows = dataset_rows(env, ns.eval)
    with open(ns.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row, default=str) + "\n")
    print(f"wrote {len(rows)} rows to {ns.out}")


if __name__ == "__main__":
    main()
