"""A reward worker: resolve the reward functions once, then score each call in a box.

Started by the pool like every worker (sandbox/launch.py: confined, split into a
supervisor that holds the channel and a zygote that imports; sandbox/box.py has the
picture). Two halves:

- `prepare(init, announce)`, in the zygote: import the functions, or unpickle those sent
  by value (registry.py `resolve`; announcing each first, so the trainer can name the one
  that hangs or exits), warm up the built-ins, report ready. A value crosses the
  supervisor as base64 text inside `init` and is unpickled only here, after confinement. In "check" mode it stops there (the start-up check of `check_rewards`). It
  returns what a box runs: one call, under the limits of sandbox/calls.py (`LimitedCall`:
  time, CPU, output; memory and processes are the box's cgroups and rlimits), any
  exception (SystemExit and KeyboardInterrupt included) one failed call, values checked
  per sample (`validate`).
- `supervise(channel, init, boxes)`, in the supervisor: a task is one chunk of samples
  for one or more functions; each function's call runs in a fresh box (a process of its
  own, forked from the zygote, that never saw another call; its inputs unpickled there),
  which is killed with its tree once it has answered. The supervisor accepts one reply,
  from the box's main process, and sends the trainer only its values, stamped with the
  task and function it asked for: a forged or late frame, a box that dies or runs past
  its time is that call's failure (the pool retries it sample by sample).
"""

from __future__ import annotations

import numbers
import pickle
import sys
import time
from collections.abc import Callable
from typing import Any

from leangrpo.rewards.protocol import CallError, Result, parse_reply
from leangrpo.rewards.registry import ResolvedReward, RewardSpecError, is_user_code, resolve
from leangrpo.sandbox.box import BoxConn, Boxes, Failed
from leangrpo.sandbox.calls import LimitedCall, message
from leangrpo.sandbox.frames import Channel, ProtocolError, one_line

GRACE_FRACTION = 0.125  # past timeout_s, how long a box may take to stop before it is killed


def prepare(init: dict, announce: Callable[[dict], None]) -> Callable[[BoxConn], None] | None:
    """The zygote's set-up: resolve the functions; what each box runs (None: stop)."""
    sys.path[:0] = [p for p in init["sys_path"] if p not in sys.path]
    specs = [ResolvedReward(**d) for d in init["specs"]]
    functions = _resolve_all(announce, specs, init["mode"] == "serve")
    if functions is None:
        return None

    def box_main(conn: BoxConn) -> None:
        fn, payload = conn.recv()
        call = conn.limited_call(init["timeout_s"], init.get("cpu_time_limit_s"))
        prompts, completions, columns = pickle.loads(payload)
        reply = score(call, functions[fn], prompts, completions, {**columns, **specs[fn].kwargs})
        try:
            conn.send(reply)
        except ValueError as e:  # too large for one frame
            conn.send({"t": "error", "kind": "bad return", "msg": one_line(str(e))})

    return box_main


def supervise(channel: Channel, init: dict, boxes: Boxes) -> None:
    """Forward the zygote's set-up reports, then answer tasks until the channel closes."""
    if boxes.forward_setup(channel, init["mode"] == "serve") is None:
        return
    limit_s = float(init["timeout_s"]) * (1 + GRACE_FRACTION) + 0.5
    while True:
        task_id, fns, payload = pickle.loads(channel.recv())
        for fn in fns:
            box = boxes.start()
            outcome = boxes.ask(box, (fn, payload), time.monotonic() + limit_s)
            boxes.end(box)
            channel.send({**_checked(outcome, init), "task": task_id, "fn": fn})


def _checked(outcome: Any, init: dict) -> dict:
    """What a box's reply may carry to the trainer: its values and errors, or one failure."""
    if isinstance(outcome, Failed):
        if outcome.kind == "timeout":
            msg = f"timed out after {init['timeout_s']:g} s and did not stop (its box was killed)"
            return {"t": "error", "kind": "timeout", "msg": msg}
        return {"t": "error", "kind": outcome.kind, "msg": outcome.msg or outcome.kind}
    reply = outcome.message
    try:
        parsed = parse_reply(_as_payload({**reply, "task": 0, "fn": 0}))
    except ProtocolError as e:
        return {"t": "error", "kind": "garbled reply", "msg": str(e)}
    if isinstance(parsed, Result):
        return {"t": "result", "values": parsed.values, "errors": [list(e) for e in parsed.errors]}
    if isinstance(parsed, CallError):
        return {"t": "error", "kind": parsed.kind, "msg": parsed.msg}
    return {"t": "error", "kind": "garbled reply", "msg": "a reply that is not a call's"}


def _as_payload(message: dict) -> bytes:
    import json

    return json.dumps(message, allow_nan=False).encode()


def _resolve_all(announce: Callable[[dict], None], specs: list[ResolvedReward],
                 warm_up: bool) -> list | None:  # fmt: skip
    functions = []
    for i, spec in enumerate(specs):
        announce({"t": "loading", "fn": i})
        try:
            functions.append(resolve(spec.name, spec.file, spec.value))
            if warm_up and not is_user_code(spec):
                from leangrpo.rewards import builtin

                builtin.warm_up(spec.name)
        except BaseException as e:  # SystemExit and KeyboardInterrupt at import included
            announce({"t": "init_error", "fn": i, "msg": _describe(e, spec)})
            return None
    for stream in (sys.stdout, sys.stderr):  # what the imports printed reaches the log first
        stream.flush()
    announce({"t": "ready"})
    return functions


def _describe(exc: BaseException, spec: ResolvedReward) -> str:
    where = spec.file or spec.name.rpartition(":")[0]
    if spec.value is not None:
        where = f"'{spec.name}' (passed by value)"
    if isinstance(exc, SystemExit):
        return f"{where} called sys.exit({exc.code!r}) at import; a reward file must not exit"
    if isinstance(exc, RewardSpecError):
        return message(exc)
    return f"importing {where} raised {type(exc).__name__}: {message(exc)}"


def score(call: LimitedCall, fn: Any, prompts: list, completions: list, kwargs: dict) -> dict:
    """One reward call under the limits: the reply to send."""
    n = len(completions)  # before the call: a reward may mutate its lists (they are its own)
    raw, error = call.invoke(fn, (prompts, completions), kwargs)
    if error is not None:
        return error
    try:
        values, errors = validate(raw, n)
    except BadReturn as e:
        return {"t": "error", "kind": e.kind, "msg": message(e)}
    except BaseException as e:  # a returned object whose tolist() raises
        return {"t": "error", "kind": type(e).__name__, "msg": message(e)}
    return {"t": "result", "values": values, "errors": errors}


class BadReturn(ValueError):
    """A reward returned something other than one value per sample: `kind` is "wrong
    length" (a list of another length: never retried, rewards/pool.py) or "bad return"."""

    def __init__(self, msg: str, kind: str = "bad return"):
        super().__init__(msg)
        self.kind = kind


def validate(raw: Any, n: int) -> tuple[list[float | None], list[list]]:
    """Per-sample values and errors ([position, kind, message]) from a reward's return.

    Accepted: a list or tuple of length n, or anything whose tolist() gives one (numpy
    arrays, tensors). Each item: None, or a real number float() accepts (int, float, bool,
    numpy scalars, 0-d arrays and tensors), finite. An unusable item is that sample's
    failure; a return of the wrong kind or length fails the whole call (BadReturn).
    """
    items = raw
    if not isinstance(raw, (list, tuple)) and callable(getattr(raw, "tolist", None)):
        items = raw.tolist()
    if not isinstance(items, (list, tuple)):
        raise BadReturn(f"returned a {type(raw).__name__} for {n} samples; return a list of {n}")
    if len(items) != n:
        raise BadReturn(
            f"returned {len(items)} values for {n} samples; return a list of {n}", "wrong length"
        )
    values: list[float | None] = []
    errors: list[list] = []
    for j, item in enumerate(items):
        try:
            values.append(_number(item))
        except Exception as e:
            values.append(None)
            errors.append([j, "bad value", one_line(str(e))])
    return values, errors


def _number(item: Any) -> float | None:
    if item is None:
        return None
    if not isinstance(item, numbers.Real) and getattr(item, "shape", None) != ():
        raise ValueError(
            f"returned {one_line(repr(item), 60)} ({type(item).__name__}); "
            "return a float or None per sample"
        )
    try:
        value = float(item)
    except OverflowError:
        raise ValueError("returned an integer too large for a float") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"returned {value}; rewards must be finite (or None)")
    return value
