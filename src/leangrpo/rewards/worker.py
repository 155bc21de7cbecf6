"""A reward worker: resolve the reward functions once, then score each call in a box.

Started by the pool like every worker (sandbox/launch.py: confined, split into a
supervisor that holds the channel and a zygote that imports; sandbox/box.py has the
picture). Two halves:

- `prepare(init, announce)`, in the zygote: import the functions, or unpickle those sent
  by value (registry.py `resolve`; announcing each first, so the trainer can name the one
  that hangs or exits), warm up the built-ins, report ready. A value crosses the
  supervisor as base64 text inside `init` and is unpickled only here, after confinement.
  In "check" mode it stops there (the start-up check of `check_rewards`). It returns what
  a box runs: one call, under the limits of sandbox/calls.py (`LimitedCall`: time, CPU;
  memory and processes are the box's cgroups and rlimits; its output is counted by the
  supervisor), any exception (SystemExit and KeyboardInterrupt included) one failed call,
  values checked per sample (`validate`). A spare box sets its limits up before its
  request arrives: a call then costs the request, the function and the reply.
- `supervise(channel, init, boxes)`, in the supervisor (`Calls`): a task is a list of
  calls, each one function on one chunk of samples (protocol.py); each call runs in a
  fresh box (a process of its own, forked from the zygote, that never saw another call;
  its inputs unpickled there), up to `init["parallel"]` boxes side by side (each then in
  a network namespace of its own: rewards/check.py `side_by_side`), and each box
  is killed with its tree once it has answered. The supervisor accepts one reply per
  box, from the box's main process, and sends the trainer only its values, stamped with
  the call and function it asked for, as soon as that call ends: a forged or late frame,
  a box that dies, prints past max_output_bytes or runs past its time is that call's
  failure alone (the pool retries it sample by sample). A call the pool cancels is
  dropped if it has not started and its box killed if it has.
- A box runs user code, and the program a reward runs can send the box's reply itself:
  nothing in a reply is trusted beyond that call (`_checked`). The supervisor counts the
  values against the call's samples (a mismatch: that call fails "wrong length"), takes
  per-sample errors only as "bad value" at a position of the call, and sets a failed
  call's kind itself: "timeout" only once the call has run for timeout_s by its own
  clock; an exception's name, "bad return", "wrong length" and the limits a call meets
  inside its box (CPU, memory, processes) as the box says (each labels that call, no
  more: no kind a box sends stops the run or gives a function up); anything else
  ("box died", "output limit", ...: the supervisor's or the pool's to set) "raised",
  the claim kept in its message.
"""

from __future__ import annotations

import numbers
import pickle
import re
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from leangrpo.rewards.protocol import WRONG_LENGTH, CallError, Result, box_limit_s, parse_reply
from leangrpo.rewards.registry import ResolvedReward, RewardSpecError, is_user_code, resolve
from leangrpo.sandbox.box import Box, BoxConn, Boxes, Failed, Outcome
from leangrpo.sandbox.calls import CPU, MEMORY, PROCESSES, TIMEOUT, LimitedCall, message
from leangrpo.sandbox.frames import Channel, ProtocolError, one_line


def prepare(init: dict, announce: Callable[[dict], None]) -> Callable[[BoxConn], None] | None:
    """The zygote's set-up: resolve the functions; what each box runs (None: stop)."""
    sys.path[:0] = [p for p in init["sys_path"] if p not in sys.path]
    specs = [ResolvedReward(**d) for d in init["specs"]]
    functions = _resolve_all(announce, specs, init["mode"] == "serve")
    if functions is None:
        return None

    def box_main(conn: BoxConn) -> None:
        # the limits (the watchdog's thread) first: a spare box waits for its request ready
        call = conn.limited_call(init["timeout_s"], init.get("cpu_time_limit_s"))
        fn, payload = conn.recv()
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
    Calls(channel, init, boxes).serve()


@dataclass
class _Running:
    call: int
    fn: int
    samples: int  # in the call's chunk: its reply must hold as many values
    started: float
    deadline: float


class Calls:
    """The supervisor's reward calls: each in a box of its own, up to `parallel` at once,
    answered as each ends."""

    def __init__(self, channel: Channel, init: dict, boxes: Boxes):
        self.channel = channel
        self.init = init
        self.boxes = boxes
        self.parallel = max(1, int(init.get("parallel", 1)))
        self.limit_s = box_limit_s(float(init["timeout_s"]))
        # (call, fn, chunk, samples) not started
        self.queue: deque[tuple[int, int, bytes, int]] = deque()
        self.running: dict[Box, _Running] = {}
        boxes.spare_metered = False  # a box holds one call: its output is counted here
        # side by side, each box has a loopback of its own where it can (check.py)
        boxes.spare_network = bool(init.get("own_network"))
        # spares for two rounds of calls: refilled in batches (box.py `refill`) while one
        # round's are still ready
        boxes.spare_count = max(boxes.spare_count, 2 * self.parallel)

    def serve(self) -> None:
        while True:
            if not self.queue and not self.running:
                self.boxes.refill()  # the next scoring's boxes, forked while the trainer works
                self._task(self.channel.recv())
            self._start_queued()
            deadlines = {box: running.deadline for box, running in self.running.items()}
            done, readable = self.boxes.wait_any(deadlines, channel=True)
            for box, outcome in done:
                self._answer(box, outcome)
            if readable:
                self._task(self.channel.recv())

    def _task(self, data: bytes) -> None:
        kind, items = pickle.loads(data)
        if kind == "calls":
            self.queue.extend(items)
            self.boxes.reserve(len(self.queue) + len(self.running))
        elif kind == "cancel":
            self._cancel(set(items))

    def _start_queued(self) -> None:
        while self.queue and len(self.running) < self.parallel:
            box = self.boxes.ready_spare()
            if box is None:  # the rest wait for their boxes (wait_any wakes at a delivery)
                self.boxes.reserve(len(self.queue))
                return
            call, fn, chunk, samples = self.queue.popleft()
            now = time.monotonic()
            self.running[box] = _Running(call, fn, samples, now, now + self.limit_s)
            failed = self.boxes.send(box, (fn, chunk))
            if failed is not None:
                self._answer(box, failed)

    def _answer(self, box: Box, outcome: Outcome) -> None:
        running = self.running.pop(box)
        self.boxes.end(box)
        elapsed = time.monotonic() - running.started
        reply = _checked(outcome, self.init, running.samples, elapsed)
        if reply["t"] == "result":
            reply["seconds"] = elapsed
        self.channel.send({**reply, "task": running.call, "fn": running.fn})

    def _cancel(self, calls: set[int]) -> None:
        """Drop the calls not started, kill those running; each answered "cancelled"."""
        for item in [item for item in self.queue if item[0] in calls]:
            self.queue.remove(item)
            self.channel.send({"t": "cancelled", "task": item[0], "fn": item[1]})
        for box, running in list(self.running.items()):
            if running.call in calls:
                del self.running[box]
                self.boxes.end(box)
                self.channel.send({"t": "cancelled", "task": running.call, "fn": running.fn})


def _checked(outcome: Any, init: dict, samples: int, elapsed: float) -> dict:
    """What a box's reply may carry to the trainer: its values and errors, or one failure
    of the call (module docstring: nothing in it is trusted beyond the call)."""
    if isinstance(outcome, Failed):  # the supervisor's own finding
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
        return _checked_result(parsed, samples)
    if isinstance(parsed, CallError):
        kind, msg = _checked_kind(parsed.kind, parsed.msg, float(init["timeout_s"]), elapsed)
        return {"t": "error", "kind": kind, "msg": msg}
    return {"t": "error", "kind": "garbled reply", "msg": "a reply that is not a call's"}


def _checked_result(parsed: Result, samples: int) -> dict:
    """A result with one value per sample of the call, its errors "bad value" at distinct
    positions of the call; else the call's failure."""
    if len(parsed.values) != samples:
        msg = f"returned {len(parsed.values)} values for {samples} samples; return a list of {samples}"
        return {"t": "error", "kind": WRONG_LENGTH, "msg": msg}
    positions = [e[0] for e in parsed.errors]
    if len(set(positions)) != len(positions) or not all(
        type(j) is int and 0 <= j < samples for j in positions
    ):
        return {"t": "error", "kind": "garbled reply", "msg": "errors at no sample of the call"}
    errors = [[j, "bad value", msg] for j, _, msg in parsed.errors]
    return {"t": "result", "values": parsed.values, "errors": errors}


# kinds a box may claim: the function's own failures, and the limits its call meets in
# the box (LimitedCall: they label that call only, and no more)
_CLAIMABLE = ("bad return", WRONG_LENGTH, CPU, MEMORY, PROCESSES)
_EXCEPTION_NAME = re.compile(r"[A-Z][A-Za-z0-9_]{0,99}")


def _checked_kind(kind: str, msg: str, timeout_s: float, elapsed: float) -> tuple[str, str]:
    """The kind of a failed call as the supervisor sets it (a box may send any): a claimed
    "timeout" only once the call ran for timeout_s (the box's own watchdog fires no
    sooner), an exception's name or a kind of _CLAIMABLE as claimed; the rest (a kind the
    supervisor or the pool sets: "box died", "output limit", ...) "raised", the claim kept
    in the message."""
    if kind == TIMEOUT and elapsed >= timeout_s:
        return kind, msg
    if kind in _CLAIMABLE or _EXCEPTION_NAME.fullmatch(kind):
        return kind, msg
    return "raised", f"{one_line(kind, 60)}: {msg}"


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
            f"returned {len(items)} values for {n} samples; return a list of {n}", WRONG_LENGTH
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
