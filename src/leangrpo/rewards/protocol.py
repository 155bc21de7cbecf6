"""The reward workers' messages: the frames of sandbox/frames.py (pickles from the
trainer, length-prefixed JSON back), with this schema. The trainer decodes nothing but
JSON from a worker and refuses NaN/Infinity and every message that does not match
(`ProtocolError`): the pool counts that as a failure of the worker's calls and replaces
the worker.

Tasks (trainer -> worker, pickles): `("calls", [(k, i, chunk), ...])`, calls k of
function i on a chunk of samples (`chunk`: the pickled prompts, completions and columns,
unpickled only in the call's box), one scoring's share of a worker in one message, each
call in a box of its own and several side by side (worker.py); `("cancel", [k, ...])`,
calls the pool gave up on (their function timed out on every call of the scoring).

Replies (worker -> trainer), one JSON object each:

    {"t": "loading", "fn": i}                     about to import function i
    {"t": "ready"}                                every function resolved
    {"t": "init_error", "fn": i, "msg": s}        function i could not be resolved
    {"t": "result", "task": k, "fn": i, "values": [x | null, ...], "errors": [[j, kind, msg], ...],
     "seconds": s}
    {"t": "error", "task": k, "fn": i, "kind": s, "msg": s}   the call failed as a whole
    {"t": "cancelled", "task": k, "fn": i}        a call cancelled before it answered

A `result` carries one finite number or null per sample of the call; `errors` names the
samples whose returned value was unusable (their value is null); `seconds` is how long the
call took in its box (its function's speed: the pool sizes chunks by it). Each call of a
task is answered once, in the order the calls end.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from leangrpo.sandbox.frames import ProtocolError, one_line

GRACE_FRACTION = 0.125  # past timeout_s, how long a box may take to stop before it is killed


def box_limit_s(timeout_s: float) -> float:
    """How long a call's box lives before the supervisor kills it (its function was
    interrupted at timeout_s and did not stop): the call then fails as timed out."""
    return timeout_s * (1 + GRACE_FRACTION) + 0.5


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


WRONG_LENGTH = "wrong length"  # a failed call's kind: its values do not fit its samples


@dataclass(frozen=True)
class Result:
    task: int  # the call
    fn: int
    values: list[float | None]
    errors: list[tuple[int, str, str]]  # (position in the call's chunk, kind, message)
    seconds: float = 0.0


@dataclass(frozen=True)
class CallError:
    task: int
    fn: int
    kind: str
    msg: str


@dataclass(frozen=True)
class Cancelled:
    task: int
    fn: int


Reply = Loading | Ready | InitError | Result | CallError | Cancelled


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
    return Result(_int(m["task"]), _int(m["fn"]), values, errors, _seconds(m.get("seconds", 0.0)))


def _seconds(value: Any) -> float:
    if type(value) not in (float, int) or not 0 <= value < math.inf:
        raise ProtocolError(f"invalid message from the worker: {value!r} is not a duration")
    return float(value)


_REPLIES = {
    "loading": lambda m: Loading(_int(m["fn"])),
    "ready": lambda m: Ready(),
    "init_error": lambda m: InitError(_int(m["fn"]), _text(m["msg"])),
    "result": _result,
    "error": lambda m: CallError(_int(m["task"]), _int(m["fn"]), _text(m["kind"]), _text(m["msg"])),
    "cancelled": lambda m: Cancelled(_int(m["task"]), _int(m["fn"])),
}
