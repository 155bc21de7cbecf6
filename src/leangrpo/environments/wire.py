"""The environment workers' replies: the frames of sandbox/frames.py (pickles from the
trainer, length-prefixed JSON back), with this schema. Environments and tools run model-written input, so the trainer decodes nothing but
JSON from a worker and refuses anything off this schema (`ProtocolError`: the worker is
replaced and the trajectories it held end with an error).

    {"t": "ready", "tools": [schema, ...], "replies": [role, ...],
     "reward_terms": [name, ...] | null, "max_tool_calls": n}         set up
    {"t": "init_error", "msg": s}                                    could not set up
    {"t": "item", "task": k, "i": j, "ok": {...}}                    item j of task k done
    {"t": "item", "task": k, "i": j, "error": s}                     item j failed
  (`"retire": true` on a task's last item: the worker exits after it)

An item's "ok" payload, by the task's operation:

    reset   {"messages": [message, ...] | null}
    step    {"reply": [message, ...], "done": bool, "rewards": {name: x}, "metrics": {...},
             "counts": {name: x}, "calls": [{"name": s, "arguments": {...}}], "seconds": x}
    finish  {"rewards": {...}, "metrics": {...}, "seconds": x}

A message is {"role": s, "content": s} with optional "name" and "tool_call_id" strings.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from leangrpo.sandbox.frames import ProtocolError, one_line

MESSAGE_KEYS = {"role", "content", "name", "tool_call_id"}
MAX_NAMES = 256  # reward terms, metrics or counts in one item
MAX_TOOL_CALLS = 4096  # per turn: the most an environment class may declare


@dataclass(frozen=True)
class Ready:
    tools: list[dict[str, Any]]
    replies: list[str]
    reward_terms: tuple[str, ...] | None  # None: the environment does not say
    max_tool_calls: int  # the environment class's (0 if it offers no tool): bounds a step's time


@dataclass(frozen=True)
class InitError:
    msg: str


@dataclass(frozen=True)
class Item:
    task: int
    index: int
    ok: dict[str, Any] | None  # the payload, checked; None when the item failed
    error: str | None
    retire: bool = False


EnvReply = Ready | InitError | Item


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a finite number")


def parse_env_reply(payload: bytes) -> EnvReply:
    """Decode and check one reply (the operation's payload is checked by `checked`)."""
    try:
        message = json.loads(payload.decode("utf-8"), parse_constant=_no_constants)
        kind = message["t"]
        if kind == "ready":
            terms = message["reward_terms"]
            calls = _index(message["max_tool_calls"])
            if calls > MAX_TOOL_CALLS:
                raise ProtocolError(f"max_tool_calls {calls} is over {MAX_TOOL_CALLS}")
            return Ready(
                _schemas(message["tools"]),
                [_text(r) for r in _list(message["replies"])],
                None if terms is None else tuple(_text(t) for t in _list(terms)),
                calls,
            )
        if kind == "init_error":
            return InitError(_text(message["msg"]))
        if kind == "item":
            ok, error = message.get("ok"), message.get("error")
            if (ok is None) == (error is None) or (ok is not None and type(ok) is not dict):
                raise ProtocolError("invalid message from the environment worker: bad item")
            return Item(
                _index(message["task"]),
                _index(message["i"]),
                ok,
                None if error is None else _text(error),
                message.get("retire") is True,
            )
        raise ProtocolError(f"invalid message from the environment worker: kind {kind!r}")
    except ProtocolError:
        raise
    except Exception as e:  # any malformed input, including RecursionError and KeyError
        raise ProtocolError(
            f"invalid message from the environment worker: {one_line(repr(e), 120)}"
        ) from None


def checked(op: str, ok: dict[str, Any]) -> dict[str, Any]:
    """An item's payload for operation `op`, checked against the schema (ProtocolError)."""
    try:
        if op == "reset":
            messages = ok["messages"]
            return {"messages": None if messages is None else _messages(messages)}
        out = {
            "rewards": _numbers(ok["rewards"]),
            "metrics": _numbers(ok["metrics"]),
            "seconds": _number(ok["seconds"]),
        }
        if op == "finish":
            return out
        if type(ok["done"]) is not bool:
            raise ProtocolError("done must be true or false")
        calls = [_call(c) for c in _list(ok["calls"])]
        return {**out, "reply": _messages(ok["reply"]), "done": ok["done"],
                "counts": _numbers(ok["counts"]), "calls": calls}  # fmt: skip
    except ProtocolError as e:
        raise ProtocolError(f"invalid {op} reply from the environment worker: {e}") from None
    except Exception as e:
        raise ProtocolError(
            f"invalid {op} reply from the environment worker: {one_line(repr(e), 120)}"
        ) from None


def undeclared_term(
    ok: dict[str, Any], reward_terms: tuple[str, ...] | set[str] | None
) -> str | None:
    """The first reward term of a checked payload the environment did not declare (None:
    all declared, or the environment does not say). Checked by the supervisor and again by
    the trainer: a term nobody declared is never a score."""
    if reward_terms is None:
        return None
    undeclared = sorted(set(ok.get("rewards", {})) - set(reward_terms))
    return undeclared[0] if undeclared else None


def _list(value: Any) -> list:
    if type(value) is not list:
        raise ProtocolError("a list was expected")
    return value


def _index(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise ProtocolError(f"{value!r} is not an index")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ProtocolError("text was expected")
    return one_line(value)


def _number(value: Any) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ProtocolError(f"{one_line(repr(value), 60)} is not a finite number")
    return float(value)


def _numbers(value: Any) -> dict[str, float]:
    if type(value) is not dict or len(value) > MAX_NAMES:
        raise ProtocolError("a mapping of names to numbers was expected")
    out = {}
    for key, number in value.items():
        if not key or len(key) > 100:
            raise ProtocolError(f"bad name {one_line(repr(key), 60)}")
        out[key] = _number(number)
    return out


def _messages(value: Any) -> list[dict[str, str]]:
    out = []
    for message in _list(value):
        if type(message) is not dict or not set(message) <= MESSAGE_KEYS:
            raise ProtocolError(f"a message has keys other than {sorted(MESSAGE_KEYS)}")
        if not {"role", "content"} <= set(message):
            raise ProtocolError("a message needs a role and a content")
        if not all(isinstance(v, str) for v in message.values()):
            raise ProtocolError("a message's role, content and name must be strings")
        out.append(dict(message))
    return out


def _call(value: Any) -> dict[str, Any]:
    if type(value) is not dict or not isinstance(value.get("name"), str):
        raise ProtocolError('a call must be {"name": str, "arguments": {...}}')
    if type(value.get("arguments")) is not dict:
        raise ProtocolError("a call's arguments must be an object")
    return {"name": value["name"], "arguments": value["arguments"]}


def _schemas(value: Any) -> list[dict[str, Any]]:
    schemas = _list(value)
    if not all(type(s) is dict for s in schemas):
        raise ProtocolError("tool schemas must be objects")
    return schemas
