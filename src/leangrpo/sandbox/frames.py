"""The wire between the trainer and a worker: length-prefixed frames over a socket pair.

A frame is MAGIC (4 bytes), the payload's length (4 bytes, big-endian), then the payload.

- Trainer -> worker frames are pickles: trainer-made data (tasks, the start-up message), so
  data columns reach user code with the types a direct call would give them. A worker
  trusts its parent.
- Worker -> trainer frames are JSON, and the trainer decodes nothing else: user code runs
  in the worker, and it (or generated code it executes) can write any bytes to any
  descriptor the worker holds. The trainer reads with its own buffer (`FrameReader`, never
  blocking on a partial frame) and refuses a wrong magic or a payload over
  MAX_REPLY_BYTES (`ProtocolError`); each kind of worker checks the JSON against its own
  schema (rewards/protocol.py, environments/wire.py).
- `Channel` is a worker's end: moved to a high, close-on-exec descriptor, so processes that
  user code starts do not inherit it and code writing to "fd 3" misses it.
"""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import socket
import struct
from typing import Any

MAGIC = b"LGRW"
_HEADER = struct.Struct(">4sI")
MAX_REPLY_BYTES = 4 << 20  # a reply holds at most a chunk's values or one turn's messages
MAX_TEXT = 300  # characters of an error message kept (after the worker's own truncation)
CHANNEL_FD_MIN = 100  # user code writing to "fd 3" or "the first socket" misses it


class ProtocolError(Exception):
    """A worker's bytes are not a valid reply (garbage, oversized, wrong schema)."""


def one_line(text: str, limit: int = MAX_TEXT) -> str:
    """Whitespace collapsed to single spaces, cut to `limit` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def frame(payload: bytes) -> bytes:
    return _HEADER.pack(MAGIC, len(payload)) + payload


def pickle_frame(obj: Any) -> bytes:
    return frame(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"))  # made once: a box pays
# for every page it writes, and a new encoder per message wrote dozens


def json_payload(message: dict) -> bytes:
    return _ENCODER.encode(message).encode()


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

    def pending(self) -> bool:
        """Bytes of an unfinished frame are buffered."""
        return bool(self._buffer)


class Channel:
    """A worker's end of the socket pair: JSON frames out, pickled frames in."""

    def __init__(self, fd: int):
        try:
            high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, CHANNEL_FD_MIN)
            os.close(fd)
        except OSError:  # a low RLIMIT_NOFILE: stay where we are
            high = fd
        self.sock = socket.socket(fileno=high)
        self.sock.set_inheritable(False)

    def send(self, message: dict) -> None:
        """One JSON frame; ValueError (not sent) if it is larger than the trainer accepts."""
        payload = json_payload(message)
        if len(payload) > MAX_REPLY_BYTES:
            raise ValueError(
                f"a reply of {len(payload)} bytes, over the {MAX_REPLY_BYTES} the trainer accepts"
            )
        self.sock.sendall(frame(payload))

    def recv(self) -> bytes:
        return read_frame(self.sock)
