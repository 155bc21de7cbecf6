"""An environment worker process: the trajectories' environments and their tools.

Started by pool.py like every worker (sandbox/launch.py: confined to its sandbox first,
output metered, its tree killed if the trainer dies), which then calls
`serve(channel, init, sandbox)`.

Set-up: import the environment (an Environment subclass), its tools (functions, no two
with one name) and the tool parser, build one environment to read its tools' schemas
(schema.py), reply roles, reward terms and `max_tool_calls` (which bounds a step's time in
the pool), report ready (or one init_error line). "check" mode stops there (the start-up
check, before the model loads).

Then tasks: (task id, operation, items), each item answered as soon as it is done:
- reset (session, messages, row, seed): a new environment for the session, `reset` run;
- step (session, text, turn index): the turn parsed by the tool parser (a parser that
  raises or times out on the turn gives it one parse error), then `step`;
- finish (session, finish reason): `finish`, and the session is gone.
Limits, one per call of user code and never nested (sandbox/calls.py `LimitedCall`): a
`ToolEnvironment`'s own step is leangrpo's, so each tool call runs under
environment.tool_timeout_s, its result converted to text within that call and cut to
environment.max_tool_result_chars (a failure, or a sandbox limit reached, is an
`error: ...` tool message, counted as `tool_limit/<kind>`); any other environment's reset,
step and finish run whole under environment.timeout_s, as does the parser. A call that
fails or times out fails its item and ends the session (the trajectory ends with finish
reason 'error'). Processes a tool call or the parser starts end with the call; those an
environment's own calls start end with its trajectory. A reply too large for one frame
fails its item only.
"""

from __future__ import annotations

import math
import os
import pickle
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
    as_text,
    one_line,
    parsed_turn,
)
from leangrpo.environments.wire import MAX_TOOL_CALLS
from leangrpo.sandbox.calls import LIMIT_KINDS, message
from leangrpo.sandbox.frames import Channel
from leangrpo.sandbox.proctree import is_live, kill_descendants, kill_pids

MESSAGE_KEYS = ("role", "content", "name", "tool_call_id")


def serve(channel: Channel, init: dict, sandbox: Any) -> None:
    """The worker's life after the launcher's set-up (sandbox/launch.py)."""
    Worker(channel, init, sandbox).serve()


def environment_class(spec: EnvironmentSpec) -> type[Environment]:
    """The Environment subclass that makes one environment per trajectory: a built-in
    (registry.BUILTIN_ENVIRONMENTS) or the user's, imported here, in the worker."""
    if spec.name == "tools" and spec.value is None:
        return ToolEnvironment
    if spec.name == "verifiers" and spec.value is None:
        from leangrpo.environments.adapters.verifiers import VerifiersEnvironment

        return VerifiersEnvironment
    cls = load(spec.name, "environment.name", spec.value)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        what = f"the class {cls.__name__}" if isinstance(cls, type) else f"a {type(cls).__name__}"
        raise EnvironmentSpecError(
            f"environment.name = {spec.name!r} is {what}, not a subclass of leangrpo.environments.Environment; subclass it (from leangrpo.environments import Environment) and implement step(turn)"
        )
    return cls


class Worker:
    def __init__(self, channel: Channel, init: dict, sandbox: Any):
        self.channel = channel
        self.init = init
        self.sessions: dict[int, Environment] = {}
        self.processes: dict[int, list[int]] = {}  # session -> processes its calls kept
        self.limits = sandbox.limited_call(init["timeout_s"], init.get("cpu_time_limit_s"))
        self.settle_output = sandbox.meter.settle
        self.counts: Counter = Counter()  # the step's counts (a tool's limits add to them)
        self.retire = False

    def serve(self) -> None:
        sys.path[:0] = [p for p in self.init["sys_path"] if p not in sys.path]
        spec = dict(self.init["spec"])
        spec["tools"] = tuple(tuple(t) for t in spec["tools"])
        if not self._set_up(EnvironmentSpec(**spec)) or self.init["mode"] != "serve":
            return
        while not self.retire:
            task, op, items = pickle.loads(self.channel.recv())
            handle = {"reset": self._reset, "step": self._step, "finish": self._finish}[op]
            for i, item in enumerate(items):
                try:
                    reply = {"ok": handle(*item)}
                except Exception as e:  # the item's call failed: its trajectory ends
                    reply = {"error": one_line(str(e)) or type(e).__name__}
                    self._end_session(item[0])
                last = i == len(items) - 1
                head = {"t": "item", "task": task, "i": i, "retire": self.retire and last}
                self._send(head, reply, item[0])

    def _send(self, head: dict, reply: dict, session: int) -> None:
        try:
            self.channel.send({**head, **reply})
        except (TypeError, ValueError) as e:  # a payload JSON cannot hold, or too large
            self._end_session(session)
            self.channel.send({**head, "error": f"the environment's reply: {one_line(str(e))}"})

    def _end_session(self, key: int) -> None:
        """The trajectory is over: its environment and the processes its calls kept go."""
        self.sessions.pop(key, None)
        for pid in self.processes.pop(key, []):
            if is_live(pid):
                kill_descendants(pid)
                kill_pids([pid])

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
            calls = _max_tool_calls(probe, spec)
        except BaseException as e:  # SystemExit at import included
            self.channel.send({"t": "init_error", "msg": _setup_error(e, spec)})
            return False
        kill_descendants(os.getpid())  # what building the probe started
        terms = None if self.reward_terms is None else list(self.reward_terms)
        ready = {"t": "ready", "tools": schemas, "replies": replies, "reward_terms": terms, "max_tool_calls": calls}
        self.settle_output()  # what the imports printed reaches the log before a check ends it
        self.channel.send(ready)
        return True

    def _new_environment(self) -> Environment:
        try:
            env = self.factory(**self.kwargs)
        except TypeError as e:
            raise TypeError(f"building it with environment.kwargs failed: {e}") from None
        if not callable(getattr(env, "step", None)):
            raise TypeError(f"{type(env).__name__} has no step(turn) method")
        env.configured_tools = list(self.tools)
        env.max_tool_result_chars = self.init["max_tool_result_chars"]
        return env

    # -- operations -----------------------------------------------------------------------
    def _call(self, fn: Any, *args: Any, session: int | None = None) -> Any:
        """fn(*args) under environment.timeout_s; raises with one line on failure. With a
        `session`, the processes the call starts live on until that trajectory ends."""
        value, error = self.limits.invoke(fn, args, {}, keep_processes=session is not None)
        if session is not None:
            self.processes.setdefault(session, []).extend(self.limits.started)
        self.retire |= self.limits.interrupted_import
        if error is not None:
            name = getattr(fn, "__qualname__", "the environment")
            raise RuntimeError(f"{name}: {error['kind']}: {error['msg']}")
        return value

    def _reset(self, key: int, messages: list[dict], row: dict, seed: int) -> dict:
        env = self._call(self._new_environment, session=key)
        self.sessions[key] = env
        start = self._call(env.reset, messages, row, seed, session=key)
        return {"messages": None if start is None else _messages(start, "reset")}

    def _step(self, key: int, text: str, index: int) -> dict:
        env = self._session(key)
        t0 = time.perf_counter()
        parsed = self._parse(text)
        turn = ModelTurn(text, parsed.calls, parsed.errors, parsed.content, index)
        counts = self.counts = env.__dict__.setdefault("tool_counts", Counter())
        counts.clear()
        if type(env).step is ToolEnvironment.step:  # leangrpo's own step: limit each tool
            env.call_tool = self._limited_tool
            result = env.step(turn)
        else:
            result = self._call(env.step, turn, session=key)
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
        t0 = time.perf_counter()
        try:
            result = _step_result(self._call(env.finish, finish_reason, session=key))
        finally:
            self._end_session(key)
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

    def _limited_tool(self, fn: Any, arguments: dict) -> str:
        """One tool call under environment.tool_timeout_s, its result made text within it
        (converting a huge return is the tool's time too)."""
        value, error = self.limits.invoke(
            lambda: as_text(fn(**arguments)), (), {}, self.init["tool_timeout_s"]
        )
        self.retire |= self.limits.interrupted_import
        if error is None:
            return value
        if error["kind"] in LIMIT_KINDS:
            self.counts[f"tool_limit/{error['kind'].split()[0]}"] += 1
            raise ToolCallFailed(f"the tool {error['msg']}")
        raise ToolCallFailed(f"{error['kind']}: {error['msg']}")


def _max_tool_calls(env: Environment, spec: EnvironmentSpec) -> int:
    calls = getattr(env, "max_tool_calls", Environment.max_tool_calls)
    if type(calls) is not int or not 0 <= calls <= MAX_TOOL_CALLS:
        raise ToolError(
            f"environment.name = {spec.name!r}: max_tool_calls = {calls!r} must be an integer "
            f"from 0 to {MAX_TOOL_CALLS}"
        )
    return calls


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

