"""The reward workers' wire format: length-prefixed frames over a socket pair.

A frame is MAGIC (4 bytes), the payload's length (4 bytes, big-endian), then the payload.

- Trainer -> worker frames are pickles: trainer-made data (tasks, the start-up message), so
  data columns reach the function with the types a direct call would give them. A worker
  trusts its parent.
- Worker -> trainer frames are JSON, and the trainer decodes nothing else: user reward code
  runs in the worker, and it (or generated code it executes) can write any bytes to any
  descriptor the worker holds. The trainer reads with its own buffer (never blocking on a
  partial frame), and refuses a wrong magic, a payload over MAX_REPLY_BYTES, invalid JSON,
  NaN/Infinity and every message that does not match the schema below (`ProtocolError`).
  The pool counts that as a failure of the worker's task and replaces the worker.

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
import pickle
import socket
import struct
from dataclasses import dataclass
from typing import Any

MAGIC = b"LGRW"
_HEADER = struct.Struct(">4sI")
MAX_REPLY_BYTES = 4 << 20  # a reply holds at most a chunk's values and short messages
MAX_TEXT = 300  # characters of an error message kept (after the worker's own truncation)


class ProtocolError(Exception):
    """A worker's bytes are not a valid reply (garbage, oversized, wrong schema)."""


def one_line(text: str, limit: int = MAX_TEXT) -> str:
    """Whitespace collapsed to single spaces, cut to `limit` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


# ---- frames ------------------------------------------------------------------------------


def frame(payload: bytes) -> bytes:
    return _HEADER.pack(MAGIC, len(payload)) + payload


def pickle_frame(obj: Any) -> bytes:
    return frame(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def json_frame(message: dict) -> bytes:
    return frame(json.dumps(message, allow_nan=False, separators=(",", ":")).encode())


def read_frame(sock: socket.socket) -> bytes:
    """Blocking read of one frame (worker side: its parent is trusted). EOFError at EOF."""
    magic, size = _HEADER.unpack(_read_exact(sock, _HEADER.size))
    if magic != MAGIC:
        raise EOFError("bad frame from the trainer")
    return _read_exact(sock, size)


def _read_exact(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class FrameReader:
    """Trainer side: accumulates received bytes and cuts them into payloads."""

    def __init__(self, max_bytes: int = MAX_REPLY_BYTES):
        self.max_bytes = max_bytes
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        payloads = []
        while len(self._buffer) >= _HEADER.size:
            magic, size = _HEADER.unpack_from(self._buffer)
            if magic != MAGIC:
                raise ProtocolError(f"garbled message from the worker (starts {bytes(magic)!r})")
            if size > self.max_bytes:
                raise ProtocolError(f"oversized message from the worker ({size} bytes)")
            end = _HEADER.size + size
            if len(self._buffer) < end:
                break
            payloads.append(bytes(self._buffer[_HEADER.size : end]))
            del self._buffer[:end]
        return payloads


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
