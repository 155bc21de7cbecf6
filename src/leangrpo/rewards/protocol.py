"""The reward workers' replies: the frames of sandbox/frames.py (pickles from the
trainer, length-prefixed JSON back), with this schema. The trainer decodes nothing but
JSON from a worker and refuses NaN/Infinity and every message that does not match
(`ProtocolError`): the pool counts that as a failure of the worker's task and replaces the
worker.

Replies (worker -> trainer), one JSON object each:

    {"t": "loading", "fn": i}                     about to import function i
    {"t": "ready"}                                every function resolved
    {"t": "init_error", "fn": i, "msg": s}        function i could not be resolved
    {"t": "result", "task": k, "fn": i, "values": [x | null, ...], "errors": [[j, kind, msg], ...]}
    {"t": "error", "task": k, "fn": i, "kind": s, "msg": s}   the call failed as a whole

A `result` carries one finite number or null per sample of the task; `errors` names the
samples whose returned value was unusable (their value is null). A worker answers a task
with one reply per function, in the task's order; `"retire": true` on the last one says
the worker exits after it (a call was stopped mid-import).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from leangrpo.sandbox.frames import ProtocolError, one_line

# ---- replies (worker -> trainer) ---------------------------------------------------------


@dataclass(frozen=True)
class Loading:
    fn: int


@dataclass(frozen=True)
class Ready:
    pass


@dataclass(frozen=True)
class InitError:
    fn: int
    msg: str


@dataclass(frozen=True)
class Result:
    task: int
    fn: int
    values: list[float | None]
    errors: list[tuple[int, str, str]]  # (position in the task, kind, message)
    retire: bool = False


@dataclass(frozen=True)
class CallError:
    task: int
    fn: int
    kind: str
    msg: str
    retire: bool = False


Reply = Loading | Ready | InitError | Result | CallError


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a finite number")


def parse_reply(payload: bytes) -> Reply:
    """Decode and validate one reply; ProtocolError for anything else."""
    try:
        message = json.loads(payload.decode("utf-8"), parse_constant=_no_constants)
        return _REPLIES[message["t"]](message)
    except ProtocolError:
        raise
    except Exception as e:  # any malformed input, including RecursionError and KeyError
        raise ProtocolError(f"invalid message from the worker: {one_line(repr(e), 120)}") from None


def _int(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise ProtocolError(f"invalid message from the worker: {value!r} is not an index")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ProtocolError("invalid message from the worker: text expected")
    return one_line(value)


def _values(raw: Any) -> list[float | None]:
    if type(raw) is not list:
        raise ProtocolError("invalid message from the worker: values must be a list")
    for v in raw:  # float, int or None only (bool is not a reward); finite
        if v is not None and (type(v) not in (float, int) or not math.isfinite(v)):
            raise ProtocolError(f"invalid message from the worker: value {one_line(repr(v), 60)}")
    return [v if v is None else float(v) for v in raw]


def _result(m: dict) -> Result:
    values = _values(m["values"])
    errors = []
    for item in m["errors"]:
        j, kind, msg = item
        if _int(j) >= len(values) or values[j] is not None:
            raise ProtocolError("invalid message from the worker: error for a scored sample")
        errors.append((j, _text(kind), _text(msg)))
    return Result(_int(m["task"]), _int(m["fn"]), values, errors, m.get("retire") is True)


_REPLIES = {
    "loading": lambda m: Loading(_int(m["fn"])),
    "ready": lambda m: Ready(),
    "init_error": lambda m: InitError(_int(m["fn"]), _text(m["msg"])),
    "result": _result,
    "error": lambda m: CallError(
        _int(m["task"]), _int(m["fn"]), _text(m["kind"]), _text(m["msg"]), m.get("retire") is True
    ),
}
