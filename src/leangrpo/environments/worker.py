"""An environment worker process: the trajectories' environments and their tools.

Started by pool.py like a reward worker (rewards/process.py: a fresh interpreter in its own
session, the channel on a high descriptor, output relayed line by line), with the reward
worker's set-up (SIGINT ignored, child subreaper, exit with the trainer) and its limits
(rewards/worker.py `LimitedCall`: a watchdog signal at the time limit, processes the call
started killed, RLIMIT_CPU, RLIMIT_AS for the whole worker).

Set-up: import the environment (an Environment subclass), its tools (functions, no two
with one name) and the tool parser, build one environment to read its tools' schemas
(schema.py), reply roles and reward terms, report ready (or one init_error line). "check"
mode stops there (the start-up check, before the model loads).

Then tasks: (task id, operation, items), each item answered as soon as it is done:
- reset (session, messages, row, seed): a new environment for the session, `reset` run;
- step (session, text, turn index): the turn parsed by the tool parser (a parser that
  raises or times out on the turn gives it one parse error), then `step`;
- finish (session, finish reason): `finish`, and the session is gone.
Limits, one per call of user code and never nested: a `ToolEnvironment`'s own step is
leangrpo's, so each tool call runs under environment.tool_timeout_s (a failure is a tool
message); any other environment's reset, step and finish run whole under
environment.timeout_s, as does the parser. A call of the environment that fails or times
out fails its item and ends the session (the trajectory ends with finish reason 'error').
"""

from __future__ import annotations

import math
import os
import pickle
import resource
import signal
import sys
import time
from collections import Counter
from typing import Any

from leangrpo.environments.protocol import (
    Environment,
    ModelTurn,
    StepResult,
    ToolEnvironment,
    environment_rewards,
)
from leangrpo.environments.registry import (
    EnvironmentSpec,
    EnvironmentSpecError,
    load,
    offered_tools,
    tool_functions,
    tool_parser,
)
from leangrpo.environments.schema import tool_schema
from leangrpo.environments.tools import (
    ParsedTurn,
    ToolCallFailed,
    ToolError,
    one_line,
    parsed_turn,
)
from leangrpo.rewards.proctree import become_subreaper
from leangrpo.rewards.worker import Channel, LimitedCall, exit_with_parent, message

MESSAGE_KEYS = ("role", "content", "name", "tool_call_id")


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = 0
    try:
        channel = Channel(int(sys.argv[1]))
        become_subreaper()
        exit_with_parent()
        Worker(channel, pickle.loads(channel.recv())).serve()
    except (EOFError, OSError):  # the pool closed, or user code broke the channel
        code = 3
    os._exit(code)


def environment_class(spec: EnvironmentSpec) -> type[Environment]:
    """The Environment subclass that makes one environment per trajectory: a built-in
    (registry.BUILTIN_ENVIRONMENTS) or the user's, imported here, in the worker."""
    if spec.name == "tools":
        return ToolEnvironment
    if spec.name == "verifiers":
        from leangrpo.environments.adapters.verifiers import VerifiersEnvironment

        return VerifiersEnvironment
    cls = load(spec.name, "environment.name")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        what = f"the class {cls.__name__}" if isinstance(cls, type) else f"a {type(cls).__name__}"
        raise EnvironmentSpecError(
            f"environment.name = {spec.name!r} is {what}, not a subclass of leangrpo.environments.Environment; subclass it (from leangrpo.environments import Environment) and implement step(turn)"
        )
    return cls


class Worker:
    def __init__(self, channel: Channel, init: dict):
        self.channel = channel
        self.init = init
        self.sessions: dict[int, Environment] = {}
        self.limits = LimitedCall(init["timeout_s"], init.get("cpu_time_limit_s"))
        self.retire = False

    def serve(self) -> None:
        init = self.init
        sys.path[:0] = [p for p in init["sys_path"] if p not in sys.path]
        if init.get("memory_limit_mb"):
            limit = int(init["memory_limit_mb"]) << 20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        if not self._set_up(EnvironmentSpec(**init["spec"])) or init["mode"] != "serve":
            return
        while not self.retire:
            task, op, items = pickle.loads(self.channel.recv())
            handle = {"reset": self._reset, "step": self._step, "finish": self._finish}[op]
            for i, item in enumerate(items):
                try:
                    reply = {"ok": handle(*item)}
                except Exception as e:  # the item's call failed: its trajectory ends
                    reply = {"error": one_line(str(e)) or type(e).__name__}
                    self.sessions.pop(item[0], None)
                last = i == len(items) - 1
                self._send({"t": "item", "task": task, "i": i, **reply,
                            "retire": self.retire and last})  # fmt: skip

    def _send(self, reply: dict) -> None:
        try:
            self.channel.send(reply)
        except (TypeError, ValueError) as e:  # a payload JSON cannot hold
            bad = {k: reply[k] for k in ("t", "task", "i", "retire")}
            self.channel.send({**bad, "error": f"the environment returned {one_line(str(e))}"})

    # -- set-up ---------------------------------------------------------------------------
    def _set_up(self, spec: EnvironmentSpec) -> bool:
        try:
            self.factory = environment_class(spec)
            self.tools = tool_functions(spec)
            self.parser = tool_parser(spec)
            self.kwargs = dict(spec.kwargs)
            probe = self._new_environment()
            schemas = [tool_schema(fn) for fn in offered_tools(probe, self.tools, spec)]
            replies = [str(r) for r in getattr(probe, "replies", ("user",))]
            self.reward_terms = environment_rewards(self.factory)
        except BaseException as e:  # SystemExit at import included
            self.channel.send({"t": "init_error", "msg": _setup_error(e, spec)})
            return False
        terms = None if self.reward_terms is None else list(self.reward_terms)
        self.channel.send({"t": "ready", "tools": schemas, "replies": replies, "reward_terms": terms})
        return True

    def _new_environment(self) -> Environment:
        try:
            env = self.factory(**self.kwargs)
        except TypeError as e:
            raise TypeError(f"building it with environment.kwargs failed: {e}") from None
        if not callable(getattr(env, "step", None)):
            raise TypeError(f"{type(env).__name__} has no step(turn) method")
        env.configured_tools = list(self.tools)
        return env

    # -- operations -----------------------------------------------------------------------
    def _call(self, fn: Any, *args: Any) -> Any:
        """fn(*args) under environment.timeout_s; raises with one line on failure."""
        value, error = self.limits.invoke(fn, args, {})
        self.retire |= self.limits.interrupted_import
        if error is not None:
            name = getattr(fn, "__qualname__", "the environment")
            raise RuntimeError(f"{name}: {error['kind']}: {error['msg']}")
        return value

    def _reset(self, key: int, messages: list[dict], row: dict, seed: int) -> dict:
        env = self._call(self._new_environment)
        self.sessions[key] = env
        start = self._call(env.reset, messages, row, seed)
        return {"messages": None if start is None else _messages(start, "reset")}

    def _step(self, key: int, text: str, index: int) -> dict:
        env = self._session(key)
        t0 = time.perf_counter()
        parsed = self._parse(text)
        turn = ModelTurn(text, parsed.calls, parsed.errors, parsed.content, index)
        counts = env.__dict__.setdefault("tool_counts", Counter())
        counts.clear()
        if type(env).step is ToolEnvironment.step:  # leangrpo's own step: limit each tool
            env.call_tool = self._limited_tool
            result = env.step(turn)
        else:
            result = self._call(env.step, turn)
        result = _step_result(result)
        return {
            "reply": _messages(result.reply, "step"),
            "done": bool(result.done),
            "rewards": self._rewards(result.rewards, "step"),
            "metrics": _numbers(result.metrics, "metrics"),
            "counts": {k: float(v) for k, v in counts.items()},
            "calls": [{"name": c.name, "arguments": c.arguments} for c in parsed.calls],
            "seconds": time.perf_counter() - t0,
        }

    def _parse(self, text: str) -> ParsedTurn:
        """The tool parser's reading of a turn; whatever it raises on the model's text (or
        returns off the contract) is the turn's one parse error, never the item's failure."""
        try:
            return parsed_turn(self._call(self.parser, text))
        except Exception as e:  # noqa: BLE001  model-written input: a failure is a message
            return ParsedTurn(text.strip(), [], [one_line(f"the tool parser failed on this turn: {e}")])

    def _finish(self, key: int, finish_reason: str) -> dict:
        env = self._session(key)
        del self.sessions[key]
        t0 = time.perf_counter()
        result = _step_result(self._call(env.finish, finish_reason))
        return {
            "rewards": self._rewards(result.rewards, "finish"),
            "metrics": _numbers(result.metrics, "metrics"),
            "seconds": time.perf_counter() - t0,
        }

    def _rewards(self, value: Any, where: str) -> dict[str, float]:
        rewards = _numbers(value, "rewards")
        declared = self.reward_terms
        undeclared = sorted(set(rewards) - set(declared)) if declared is not None else []
        if undeclared:
            raise ValueError(
                f"{self.factory.__name__}.{where} returned the reward term {undeclared[0]!r}, which its reward_terms {tuple(declared)} do not list"
            )
        return rewards

    def _session(self, key: int) -> Environment:
        env = self.sessions.get(key)
        if env is None:
            raise RuntimeError("the environment worker holds no such trajectory (it was restarted)")
        return env

    def _limited_tool(self, fn: Any, arguments: dict) -> Any:
        value, error = self.limits.invoke(fn, (), arguments, self.init["tool_timeout_s"])
        self.retire |= self.limits.interrupted_import
        if error is None:
            return value
        if error["kind"] in ("timeout", "cpu time limit"):
            raise ToolCallFailed(f"the tool {error['msg']}")
        raise ToolCallFailed(f"{error['kind']}: {error['msg']}")


def _setup_error(exc: BaseException, spec: EnvironmentSpec) -> str:
    if isinstance(exc, SystemExit):
        return f"environment.name = {spec.name!r}: its code called sys.exit({exc.code!r}) at import"
    if isinstance(exc, ToolError) or type(exc).__name__ == "EnvironmentSpecError":
        return message(exc)
    return f"environment.name = {spec.name!r}: {type(exc).__name__}: {message(exc)}"


def _step_result(value: Any) -> StepResult:
    if isinstance(value, StepResult):
        return value
    if isinstance(value, tuple) and 1 <= len(value) <= 4:  # (reply, done, rewards, metrics)
        return StepResult(*value)
    raise TypeError(f"the environment returned {type(value).__name__}; return a StepResult")


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    if isinstance(value, str):  # plain text: a user message
        return [{"role": "user", "content": value}]
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{where} returned {type(value).__name__}; return a list of messages")
    out = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TypeError(f"{where} returned a message that is not {{'role': ..., 'content': ...}}")
        kept = {k: m[k] for k in MESSAGE_KEYS if m.get(k) is not None}
        kept["content"] = "" if m.get("content") is None else str(m["content"])
        out.append({k: str(v) for k, v in kept.items()})
    return out


def _numbers(value: Any, where: str) -> dict[str, float]:
    out = {}
    for name, number in dict(value or {}).items():
        x = float(number)
        if not math.isfinite(x):
            raise ValueError(f"the environment's {where} {name!r} is {x}, not a finite number")
        out[str(name)] = x
    return out

