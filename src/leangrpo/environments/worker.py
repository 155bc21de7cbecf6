"""An environment worker: the environment imported once, each trajectory in a box.

Started by pool.py like every worker (sandbox/launch.py: confined, split into a
supervisor that holds the channel and a zygote that imports; sandbox/box.py has the
picture). Two halves:

- `prepare(init, announce)`, in the zygote: import the environment (an Environment
  subclass), its tools (functions, no two with one name) and the tool parser, or unpickle
  those sent by value (registry.py `load`, through rewards/registry.py `resolve`: a value
  crosses the supervisor as base64 text inside `init`, unpickled only here), build one
  environment to read its tools' schemas (schema.py), reply roles, reward terms and
  `max_tool_calls` (which bounds a step's time in the pool), report ready (or one
  init_error line). "check" mode stops there (the start-up check, before the model
  loads). It returns what a trajectory's box runs (`Trajectory`).
- `supervise(channel, init, boxes)`, in the supervisor: tasks are (task id, operation,
  items), each item answered as soon as it is done. `reset` starts the session's box (a
  process of its own, its own PID, mount, IPC and network namespaces, forked from the
  zygote: it never saw another trajectory) where the environment lives until `finish`
  (or a failure) ends the box with its tree. The supervisor accepts one reply per item,
  from the box's main process, checks it against the schema and the environment's
  declared reward terms, and passes nothing else on: a forged or late frame, a reply off
  the schema, an undeclared reward term, a box that dies or runs past the item's budget
  fail the item and end the trajectory.

In the box (`Trajectory`): reset (messages, row, seed): a new environment, `reset` run;
step (text, turn index): the turn parsed by the tool parser (a parser that raises or
times out on the turn gives it one parse error), then `step`; finish (finish reason):
`finish`. Limits, one per call of user code and never nested (sandbox/calls.py
`LimitedCall`): a `ToolEnvironment`'s own step is leangrpo's, so each tool call runs under
environment.tool_timeout_s, its result converted to text within that call and cut to
environment.max_tool_result_chars (a failure, or a sandbox limit reached, is an
`error: ...` tool message, counted as `tool_limit/<kind>`); any other environment's reset,
step and finish run whole under environment.timeout_s, as does the parser. A call that
fails or times out fails its item and ends the trajectory. Processes a tool call or the
parser starts end with the call; those an environment's own calls start end with its
box. A reply too large for one frame fails its item only.
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
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
from leangrpo.environments.wire import MAX_TOOL_CALLS, checked, undeclared_term
from leangrpo.sandbox.box import Box, BoxConn, Boxes, Failed
from leangrpo.sandbox.calls import LIMIT_KINDS, message
from leangrpo.sandbox.frames import Channel, ProtocolError

MESSAGE_KEYS = ("role", "content", "name", "tool_call_id")


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


# -- the zygote: set-up ---------------------------------------------------------------------


@dataclass
class Setup:
    """What every trajectory's box starts from (built once, in the zygote)."""

    init: dict
    factory: type[Environment]
    tools: list
    parser: Callable[[str], Any]
    kwargs: dict
    reward_terms: tuple[str, ...] | None

    def new_environment(self) -> Environment:
        try:
            env = self.factory(**self.kwargs)
        except TypeError as e:
            raise TypeError(f"building it with environment.kwargs failed: {e}") from None
        if not callable(getattr(env, "step", None)):
            raise TypeError(f"{type(env).__name__} has no step(turn) method")
        env.configured_tools = list(self.tools)
        env.max_tool_result_chars = self.init["max_tool_result_chars"]
        return env


def prepare(init: dict, announce: Callable[[dict], None]) -> Callable[[BoxConn], None] | None:
    """The zygote's set-up; what each trajectory's box runs (None: stop)."""
    sys.path[:0] = [p for p in init["sys_path"] if p not in sys.path]
    fields = {**init["spec"], "tools": tuple(tuple(t) for t in init["spec"]["tools"])}
    spec = EnvironmentSpec(**fields)  # tools: (name, value) pairs
    try:
        factory = environment_class(spec)
        setup = Setup(init, factory, tool_functions(spec), tool_parser(spec), dict(spec.kwargs),
                      environment_rewards(factory))  # fmt: skip
        probe = setup.new_environment()
        schemas = [tool_schema(fn) for fn in offered_tools(probe, setup.tools, spec)]
        replies = [str(r) for r in getattr(probe, "replies", ("user",))]
        calls = _max_tool_calls(probe, spec)  # checked even where no tool is offered
        calls = calls if schemas else 0  # an environment without tools makes no call
    except BaseException as e:  # SystemExit at import included
        announce({"t": "init_error", "msg": _setup_error(e, spec)})
        return None
    terms = None if setup.reward_terms is None else list(setup.reward_terms)
    for stream in (sys.stdout, sys.stderr):  # what the imports printed reaches the log first
        stream.flush()
    announce({"t": "ready", "tools": schemas, "replies": replies, "reward_terms": terms,
              "max_tool_calls": calls})  # fmt: skip
    return lambda conn: Trajectory(setup, conn).run()


# -- the supervisor -------------------------------------------------------------------------


def supervise(channel: Channel, init: dict, boxes: Boxes) -> None:
    """Forward the zygote's set-up report, then answer tasks until the channel closes."""
    report = boxes.forward_setup(channel, init["mode"] == "serve")
    if report is None:
        return
    Sessions(init, boxes, report).serve(channel)


class Sessions:
    """The supervisor's trajectories: a box per session, from reset to finish."""

    def __init__(self, init: dict, boxes: Boxes, ready: dict):
        self.boxes = boxes
        terms = ready.get("reward_terms")
        self.reward_terms = None if terms is None else set(terms)
        grace = max(1.0, 0.25 * init["timeout_s"])  # the pool's; it kills the worker after
        self.budget_s = (2 * init["timeout_s"] + ready["max_tool_calls"] * init["tool_timeout_s"]
                         + 0.5 * grace)  # fmt: skip
        self.live: dict[int, Box] = {}
        boxes.spare_network = True  # trajectories reach each other by no network either

    def serve(self, channel: Channel) -> None:
        import pickle

        while True:
            task, op, items = pickle.loads(channel.recv())
            for i, item in enumerate(items):
                reply = self.item(op, item)
                channel.send({"t": "item", "task": task, "i": i, **reply})

    def item(self, op: str, item: tuple) -> dict:
        key, *args = item
        box = self.live.get(key)
        if op == "reset":
            if box is not None:
                self.end(key)
            box = self.live[key] = self.boxes.start(network=True)
        elif box is None:
            return {"error": "the environment worker holds no such trajectory (it was restarted)"}
        outcome = self.boxes.ask(box, (op, *args), time.monotonic() + self.budget_s)
        reply = self._checked(op, outcome)
        if op == "finish" or "error" in reply:
            self.end(key)
        return reply

    def _checked(self, op: str, outcome: Any) -> dict:
        if isinstance(outcome, Failed):
            if outcome.kind == "timeout":
                return {"error": f"the environment did not answer within {self.budget_s:g} s (its box was killed)"}  # fmt: skip
            return {"error": f"the environment's box ({outcome.kind}): {outcome.msg}"}
        reply = outcome.message
        if set(reply) == {"error"} and isinstance(reply["error"], str):
            return {"error": one_line(reply["error"]) or "error"}
        if set(reply) != {"ok"} or type(reply["ok"]) is not dict:
            return {"error": "the environment's box sent a reply off the schema"}
        try:
            ok = checked(op, reply["ok"])
        except ProtocolError as e:
            return {"error": str(e)}
        term = undeclared_term(ok, self.reward_terms)
        if term is not None:
            return {"error": f"the environment returned the reward term {term!r}, which its reward_terms {tuple(sorted(self.reward_terms))} do not list"}  # fmt: skip
        return {"ok": ok}

    def end(self, key: int) -> None:
        box = self.live.pop(key, None)
        if box is not None:
            self.boxes.end(box)


# -- a trajectory's box -----------------------------------------------------------------------


class Trajectory:
    """One trajectory, in its box: the environment from reset to finish."""

    def __init__(self, setup: Setup, conn: BoxConn):
        self.setup = setup
        self.conn = conn
        self.env: Environment | None = None
        init = setup.init
        self.limits = conn.limited_call(init["timeout_s"], init.get("cpu_time_limit_s"))
        self.counts: Counter = Counter()  # the step's counts (a tool's limits add to them)

    def run(self) -> None:
        handle = {"reset": self._reset, "step": self._step, "finish": self._finish}
        while True:
            op, *args = self.conn.recv()
            try:
                reply = {"ok": handle[op](*args)}
            except Exception as e:  # the call failed: the trajectory ends
                reply = {"error": one_line(str(e)) or type(e).__name__}
            try:
                self.conn.send(reply)
            except (TypeError, ValueError) as e:  # a payload JSON cannot hold, or too large
                reply = {"error": f"the environment's reply: {one_line(str(e))}"}
                self.conn.send(reply)
            if op == "finish" or "error" in reply:
                return

    def _call(self, fn: Any, *args: Any) -> Any:
        """fn(*args) under environment.timeout_s; raises with one line on failure. The
        processes it starts live on until the trajectory ends (with its box)."""
        value, error = self.limits.invoke(fn, args, {}, keep_processes=True)
        if error is not None:
            name = getattr(fn, "__qualname__", "the environment")
            raise RuntimeError(f"{name}: {error['kind']}: {error['msg']}")
        return value

    def _reset(self, messages: list[dict], row: dict, seed: int) -> dict:
        self.env = env = self._call(self.setup.new_environment)
        start = self._call(env.reset, messages, row, seed)
        return {"messages": None if start is None else _messages(start, "reset")}

    def _step(self, text: str, index: int) -> dict:
        env = self._environment()
        t0 = time.perf_counter()
        parsed = self._parse(text)
        turn = ModelTurn(text, parsed.calls, parsed.errors, parsed.content, index)
        counts = self.counts = env.__dict__.setdefault("tool_counts", Counter())
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
            return parsed_turn(self._call(self.setup.parser, text))
        except Exception as e:  # noqa: BLE001  model-written input: a failure is a message
            return ParsedTurn(text.strip(), [], [one_line(f"the tool parser failed on this turn: {e}")])

    def _finish(self, finish_reason: str) -> dict:
        env = self._environment()
        t0 = time.perf_counter()
        result = _step_result(self._call(env.finish, finish_reason))
        return {
            "rewards": self._rewards(result.rewards, "finish"),
            "metrics": _numbers(result.metrics, "metrics"),
            "seconds": time.perf_counter() - t0,
        }

    def _rewards(self, value: Any, where: str) -> dict[str, float]:
        rewards = _numbers(value, "rewards")
        declared = self.setup.reward_terms
        undeclared = sorted(set(rewards) - set(declared)) if declared is not None else []
        if undeclared:
            raise ValueError(
                f"{self.setup.factory.__name__}.{where} returned the reward term {undeclared[0]!r}, which its reward_terms {tuple(declared)} do not list"
            )
        return rewards

    def _environment(self) -> Environment:
        if self.env is None:
            raise RuntimeError("the trajectory was not reset")
        return self.env

    def _limited_tool(self, fn: Any, arguments: dict) -> str:
        """One tool call under environment.tool_timeout_s, its result made text within it
        (converting a huge return is the tool's time too)."""
        value, error = self.limits.invoke(
            lambda: as_text(fn(**arguments)), (), {}, self.setup.init["tool_timeout_s"]
        )
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
