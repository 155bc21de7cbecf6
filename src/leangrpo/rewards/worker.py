"""A reward worker: resolve the reward functions, then score chunks until EOF.

Started by the pool like every worker (sandbox/launch.py: confined first, output metered,
its tree killed if the trainer dies), which then calls `serve(channel, init, sandbox)`.

Set-up: import the functions (announcing each first, so the trainer can name the one that
hangs or exits), warm up the built-ins, report ready. In "check" mode it stops there (the
start-up check of `check_rewards`).

A task is one chunk of samples for one or more functions; the inputs are unpickled afresh
for every function, so a function that mutates its arguments cannot affect another. Each
call runs under the limits of sandbox/calls.py (`LimitedCall`: time, CPU, output; memory
and processes are the sandbox's), and the processes it started end with it. A call
interrupted while importing modules retires the worker after the task. Any exception,
SystemExit and KeyboardInterrupt included, is one failed call, reported as one line.
Values are checked per sample (`validate`).
"""

from __future__ import annotations

import numbers
import pickle
import sys
from typing import Any

from leangrpo.rewards.registry import ResolvedReward, RewardSpecError, is_user_code, resolve
from leangrpo.sandbox.calls import LimitedCall, message
from leangrpo.sandbox.frames import Channel, one_line


def serve(channel: Channel, init: dict, sandbox: Any) -> None:
    """Resolve the functions, then answer tasks until the channel closes (EOFError)."""
    sys.path[:0] = [p for p in init["sys_path"] if p not in sys.path]
    specs = [ResolvedReward(**d) for d in init["specs"]]
    functions = _resolve_all(channel, specs, init["mode"] == "serve", sandbox.meter.settle)
    if functions is None or init["mode"] != "serve":
        return
    call = sandbox.limited_call(init["timeout_s"], init.get("cpu_time_limit_s"))
    while True:
        task_id, fns, payload = pickle.loads(channel.recv())
        retire = False
        for k, fn in enumerate(fns):
            prompts, completions, columns = pickle.loads(payload)  # a fresh copy each
            kwargs = {**columns, **specs[fn].kwargs}
            reply = score(call, functions[fn], prompts, completions, kwargs)
            retire |= call.interrupted_import
            if retire and k == len(fns) - 1:
                reply["retire"] = True  # the trainer replaces this worker once it has read this
            channel.send({**reply, "task": task_id, "fn": fn})
        if retire:
            return


def _resolve_all(
    channel: Channel, specs: list[ResolvedReward], warm_up: bool, settle: Any
) -> list | None:
    functions = []
    for i, spec in enumerate(specs):
        channel.send({"t": "loading", "fn": i})
        try:
            functions.append(resolve(spec.name, spec.file, spec.value))
            if warm_up and not is_user_code(spec):
                from leangrpo.rewards import builtin

                builtin.warm_up(spec.name)
        except BaseException as e:  # SystemExit and KeyboardInterrupt at import included
            channel.send({"t": "init_error", "fn": i, "msg": _describe(e, spec)})
            return None
    settle()  # what the imports printed reaches the log before the check ends the worker
    channel.send({"t": "ready"})
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
