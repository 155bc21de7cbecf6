"""Boxes: one confined process (and its PID namespace) per reward call, trajectory or
episode. The public API of the sandbox for the code a worker serves.

A worker is three kinds of process (launch.py starts them, confined):

- the **supervisor** holds the channel to the trainer and runs no user code at all: it
  reads tasks, asks the zygote for boxes, passes each its request, checks each box's one
  reply and sends the trainer what it may carry;
- the **zygote** imported the user's code (the entry's `prepare`, before any task) and only
  forks: each box is a copy of it that never saw a task;
- a **box** runs one call (rewards), one trajectory (environments) or one episode (agents),
  confined before it runs anything (zygote.py: its own PID, mount and IPC namespaces and,
  for trajectories and episodes, network namespace; a fresh HOME/TMPDIR and /dev/shm; its
  own memory and pids cgroup; no capabilities; the BOX system-call filter) and killed with
  its whole tree when it ends. It holds only a private socket to the supervisor and its
  output pipe.

Supervisor side (what an entry's `supervise(channel, init, boxes)` uses):

    box = boxes.start(network=False)           # (a) the entry's prepared callable, in a box
    outcome = boxes.ask(box, request, deadline) # Reply(message) | Failed(kind, msg)
    boxes.end(box)                              # killed with its tree; its scratch is gone
    box = boxes.command(argv, env={...}, forward="/run/endpoint.sock")  # (b) any command:
    box.stdin / box.stdout                      # its pipes (stderr goes to the log)

and, for calls side by side (rewards/worker.py): `reserve(n)` (n spares asked for at
once), `ready_spare()` (a spare already forked, or None), `send(box, request)`,
`wait_any({box: deadline}, channel)` (the boxes that replied, failed or ran out of time),
`refill()`.

`start` takes a box forked ahead of time when one is ready (`spares`), so a call does not
wait for the fork: a spare is set up whole (confined, its limits armed) and waits for its
request. Each call that still had to wait (a burst: one scoring's calls, many
trajectories reset at once) keeps one more spare, up to MAX_SPARES; `reserve` keeps as
many as a burst asked for. Spares are asked for in one message once fewer than half are
left (`refill`: the zygote forks them in one batch, zygote.py), while the trainer
generates and trains. `forward` (optional, a unix socket path the trainer listens on) is
the one address a box without network reaches: a forwarder process inside the box
listens on its own loopback and relays each connection there; the box's code finds the
address in `LEANGRPO_ENDPOINT` (http://127.0.0.1:PORT) or `conn.endpoint`.

What a box prints reaches the trainer's log through the supervisor, in whole lines (boxes
print side by side), at most FORWARD_BYTES per request. A box runs under an output meter
(output.py: a thread counting what each of its calls prints, a trajectory's tool calls)
unless `spare_metered` is false (a reward call's box, one call: its fd 1 and 2 are the
pipe to the supervisor, which counts every byte and fails the request past `max_output`).

A reply is accepted only from the box's own socket, only from its main process (the
kernel's SCM_CREDENTIALS: a forked child writing a well-formed frame is told apart), only
once per request: anything else is `Failed("forged reply")`, never a value.

Box side: the entry's callable gets a `BoxConn`: `recv()` the supervisor's request
(pickles: the supervisor is trusted), `send(dict)` one JSON reply, `limited_call(...)` the
limits of sandbox/calls.py, `endpoint`.
"""

from __future__ import annotations

import array
import contextlib
import math
import os
import pickle
import select
import signal
import socket
import struct
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from leangrpo.sandbox.calls import OUTPUT, LimitedCall
from leangrpo.sandbox.frames import (
    MAX_REPLY_BYTES,
    FrameReader,
    ProtocolError,
    frame,
    json_payload,
    pickle_frame,
    read_frame,
)
from leangrpo.sandbox.output import FORWARD_BYTES, OutputMeter

FORGED, DIED, TIMEOUT, MEMORY, GARBLED = (
    "forged reply",
    "box died",
    "timeout",
    "memory limit",
    "garbled reply",
)
EXIT_NOTICE_S = 1.0  # how long the zygote may take to report a dead box's end
RELAY_READS = 16  # reads of a box's output per wake-up (64 KiB each)
LINE_HELD = 4096  # the longest start of a line held back until its end arrives
MAX_SPARES = 16  # boxes forked ahead at most (a worker's calls of one scoring, at most)
_CRED = struct.Struct("iII")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class Reply:
    message: dict


@dataclass(frozen=True)
class Failed:
    kind: str
    msg: str


Outcome = Reply | Failed


class WorkerBroken(Exception):
    """The zygote is gone: the worker cannot make boxes any more (it exits)."""


@dataclass(eq=False)  # told apart by identity: a key of the calls waited on
class Box:
    """The supervisor's handle on one box."""

    id: int
    pid: int  # in the worker's PID namespace
    sock: socket.socket  # the supervisor's end of the box's private socket (SO_PASSCRED)
    out: int  # read end of what the box prints
    stdin: int | None = None  # a command's
    stdout: int | None = None
    metered: bool = True  # False: the supervisor counts what it prints (`max_output`)
    reader: FrameReader = field(default_factory=FrameReader)
    relayed: int = 0  # bytes of output passed on for the current request
    printed: int = 0  # bytes it printed since the current request (an unmetered box's)
    partial: bytes = b""  # the start of a line it has not finished printing
    out_open: bool = True  # until the output pipe's EOF (then not waited on)
    exit: dict | None = None  # the zygote's notice: {"code", "oom"}
    ended: bool = False


class Boxes:
    """The supervisor's side of the zygote (one per worker; single-threaded)."""

    def __init__(self, control: socket.socket, channel_fd: int, spares: int = 1,
                 network: bool = False, max_output: int = 1 << 20):  # fmt: skip
        self.control = control
        self.channel_fd = channel_fd  # watched for the trainer's hang-up while waiting
        self.reader = FrameReader(max_bytes=MAX_REPLY_BYTES)
        self.spare_count = spares
        self.spare_network = network
        self.spare_metered = True  # False: spares run without an output meter (one call each)
        self.max_output = max_output  # what an unmetered box may print per request
        self._spares: deque[int] = deque()  # requested ids, oldest first
        self._delivered: dict[int, Box] = {}
        self._live: dict[int, Box] = {}
        self._exits: dict[int, dict] = {}
        self._ids = 0
        self._pending: deque[dict] = deque()  # set-up messages read while waiting for boxes
        self._short = False  # `ready_spare` found none ready, and none has been taken since

    # -- set-up -----------------------------------------------------------------------------
    def setup_messages(self) -> Any:
        """The zygote's set-up reports (JSON payloads), until it closes or sends ready."""
        while True:
            while self._pending:
                yield self._pending.popleft()
            self._read_control(block=True)

    def forward_setup(self, channel: Any, serve: bool) -> dict | None:
        """Send the zygote's set-up reports down `channel` until ready or init_error; the
        ready report when the worker goes on to serve tasks (`serve`), else None."""
        report: dict = {}
        for report in self.setup_messages():
            channel.send(report)
            if report.get("t") in ("ready", "init_error"):
                break
        return report if report.get("t") == "ready" and serve else None

    # -- making boxes ---------------------------------------------------------------------------
    def start(self, network: bool | None = None, forward: str | None = None) -> Box:
        """A box running the entry's prepared callable (a spare one when ready); the spares
        are then refilled."""
        box = self.take(network, forward)
        self.refill()
        return box

    def take(self, network: bool | None = None, forward: str | None = None) -> Box:
        """As `start`, the spares left as they are (`refill` later: a burst's calls take
        theirs first, and the next burst's are forked after it)."""
        network = self.spare_network if network is None else network
        if forward is None and network == self.spare_network and self.spare_count:
            if not self._spares:
                self._request_spares(1)
            self._drain_control()
            if self._spares[0] not in self._delivered:  # a call waits for a fork: keep more
                self.spare_count = min(MAX_SPARES, self.spare_count + 1)
            return self._take(self._spares.popleft())
        request = {"network": network, "forward": forward, "meter": True}
        return self._take(self._request([request])[0])

    def ready_spare(self) -> Box | None:
        """A spare box already forked, without waiting (None: ask with `reserve`). Calls
        that find none ready (while spares are on their way) keep one more spare from
        then on, once per such wait, up to MAX_SPARES, as `start` does."""
        self._drain_control()
        if self._spares and self._spares[0] in self._delivered:
            self._short = False
            return self._take(self._spares.popleft())
        if not self._short:
            self._short = True
            self.spare_count = min(MAX_SPARES, self.spare_count + 1)
        return None

    def reserve(self, count: int) -> None:
        """`count` spare boxes asked for at once (a burst of calls about to start), and as
        many kept from now on, up to MAX_SPARES both (each holds descriptors, the
        supervisor's and the zygote's: a burst of hundreds of calls would run out of them;
        the rest are asked for as these are taken): the zygote forks those missing in one
        batch."""
        count = min(count, MAX_SPARES)
        self.spare_count = max(self.spare_count, count)
        self._request_spares(count - len(self._spares))

    def refill(self) -> None:
        """Ask for spares up to `spare_count` once fewer than half of them are left: in one
        message, so that the zygote forks them in one batch (zygote.py)."""
        if len(self._spares) * 2 < self.spare_count:
            self._request_spares(self.spare_count - len(self._spares))

    def _request_spares(self, count: int) -> None:
        kind = {"network": self.spare_network, "forward": None, "meter": self.spare_metered}
        self._spares.extend(self._request([dict(kind) for _ in range(count)]))

    def _drain_control(self) -> None:
        """Read what the zygote has sent so far (boxes delivered, exits), without waiting."""
        while self._poll([self.control], 0.0):
            self._read_control(block=True)

    def command(self, argv: list[str], *, network: bool = False, forward: str | None = None,
                env: dict[str, str] | None = None) -> Box:  # fmt: skip
        """A box running `argv` (exec'd once confined) with pipes for its stdin and stdout."""
        request = {"network": network, "forward": forward, "argv": list(argv), "env": env or {}}
        return self._take(self._request([request])[0])

    def _request(self, requests: list[dict]) -> list[int]:
        """Ask the zygote for boxes, in one write (it forks what arrives together in one
        batch); their ids."""
        ids = []
        frames = []
        for request in requests:
            self._ids += 1
            ids.append(self._ids)
            frames.append(pickle_frame({"t": "box", "id": self._ids, **request}))
        if frames:
            try:
                self.control.sendall(b"".join(frames))
            except OSError as e:
                raise WorkerBroken(f"the zygote is gone ({type(e).__name__})") from None
        return ids

    def _take(self, box_id: int) -> Box:
        while box_id not in self._delivered:
            self._read_control(block=True)
        box = self._delivered.pop(box_id)
        self._live[box.id] = box
        return box

    # -- talking to boxes -------------------------------------------------------------------
    def ask(self, box: Box, request: Any, deadline: float) -> Outcome:
        """Send `request`, then wait for the box's one reply until `deadline` (monotonic)."""
        failed = self.send(box, request)
        return failed if failed is not None else self.wait(box, deadline)

    def send(self, box: Box, request: Any) -> Failed | None:
        """Send `request` to the box (its reply: `wait`, `wait_any`); a failure instead when
        the box broke the protocol or died."""
        stale = self._unasked(box)
        if stale is not None:
            return stale
        box.relayed = box.printed = 0
        try:
            box.sock.sendall(pickle_frame(request))
        except OSError:
            return self._death(box)
        return None

    def _unasked(self, box: Box) -> Failed | None:
        """A box that wrote to its socket between requests broke the protocol."""
        try:
            data = box.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        except OSError:
            return self._death(box)
        if not data:
            return self._death(box)
        return Failed(FORGED, "the box wrote to its socket when nothing was asked of it")

    def wait(self, box: Box, deadline: float) -> Outcome:
        """The box's one reply, or why there is none; relays its output meanwhile. Raises
        EOFError when the trainer hangs up (the worker ends)."""
        watch = True  # the trainer's end of the channel: its hang-up
        while True:
            done, channel = self.wait_any({box: deadline}, watch)
            if done:
                return done[0][1]
            if channel:
                self._check_trainer()
                watch = False  # a message ahead of its time waits in the socket

    def wait_any(self, deadlines: dict[Box, float], channel: bool) -> tuple[list, bool]:
        """Wait until a box asked (`send`) replies, fails or reaches its deadline, the
        zygote reports (a box delivered: then nothing may be done yet), or, `channel`, the
        trainer's end of the channel is readable: ([(box, outcome), ...], whether the
        channel is). Relays what the boxes print meanwhile; a box that replied is read
        before its deadline is checked."""
        handles: list = [self.control]
        if channel:
            handles.append(self.channel_fd)
        for box in deadlines:
            handles += [box.sock, box.out] if box.out_open else [box.sock]
        soonest = min(deadlines.values(), default=math.inf)
        ready = self._poll(handles, max(0.0, soonest - time.monotonic()))
        if self.control.fileno() in ready:
            self._read_control(block=False)
        done = []
        for box in deadlines:
            if box.out in ready:
                self.relay(box)
            outcome = self._receive(box) if box.sock.fileno() in ready else None
            if outcome is not None:
                self.relay(box)  # what it printed before replying reaches the log first
            elif not box.metered and box.printed > self.max_output:
                outcome = Failed(OUTPUT, f"printed more than {self.max_output} bytes")
            if outcome is not None:
                done.append((box, outcome))
        now = time.monotonic()
        answered = {box for box, _ in done}
        done += [(box, Failed(TIMEOUT, "")) for box, deadline in deadlines.items()
                 if box not in answered and now >= deadline]  # fmt: skip
        return done, channel and self.channel_fd in ready

    def _receive(self, box: Box) -> Outcome | None:
        try:
            data, ancillary, _, _ = box.sock.recvmsg(1 << 16, socket.CMSG_SPACE(_CRED.size))
        except OSError:
            return self._death(box)
        if not data:
            return self._death(box)
        sender = _sender(ancillary)
        if sender != box.pid:
            return Failed(FORGED, f"a frame from another process of the box (pid {sender})")
        try:
            payloads = box.reader.feed(data)
        except ProtocolError as e:
            return Failed(GARBLED, str(e))
        if not payloads:
            return None
        if len(payloads) > 1 or box.reader.pending():
            return Failed(FORGED, "more than one reply to one request")
        try:
            return Reply(_json(payloads[0]))
        except ValueError as e:
            return Failed(GARBLED, f"a reply that is not JSON ({e})")

    def _check_trainer(self) -> None:
        with socket.socket(fileno=os.dup(self.channel_fd)) as sock:
            try:
                data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                raise EOFError from None
        if not data:
            raise EOFError

    def _death(self, box: Box) -> Failed:
        """The box closed its socket: it died (the zygote says how)."""
        deadline = time.monotonic() + EXIT_NOTICE_S
        while box.id not in self._exits and time.monotonic() < deadline:
            self._read_control(block=False, timeout=deadline - time.monotonic())
        notice = self._exits.get(box.id, {})
        if notice.get("oom"):
            return Failed(MEMORY, "was killed at the memory limit of its call")
        code = notice.get("code")
        return Failed(DIED, f"the call's process died (exit code {code})")

    def relay(self, box: Box) -> None:
        """Pass on what the box printed, at most FORWARD_BYTES per request, in whole lines
        (boxes print side by side into one log); at most RELAY_READS reads per wake-up, so
        that a box writing without pause (its processes may hold the pipe) cannot keep the
        supervisor from the call's deadline. An unmetered box's bytes are counted."""
        for _ in range(RELAY_READS):
            try:
                data = os.read(box.out, 1 << 16)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                box.out_open = False  # every writer closed it
                return
            box.printed += len(data)
            room = FORWARD_BYTES - box.relayed
            if room > 0:
                box.relayed += min(room, len(data))
                self._forward(box, data[:room])

    @staticmethod
    def _forward(box: Box, data: bytes) -> None:
        text = box.partial + data
        cut = text.rfind(b"\n") + 1
        if len(text) - cut > LINE_HELD:  # a line without end: passed on as it is
            cut = len(text)
        _write_all(1, text[:cut])
        box.partial = text[cut:]

    def end(self, box: Box) -> None:
        """Kill the box with its whole tree and close its descriptors (idempotent). The
        zygote reaps it (its SIGCHLD) and sweeps what it left."""
        if box.ended:
            return
        box.ended = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(box.pid, signal.SIGKILL)  # a session leader; PID 1 of its namespace
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(box.pid, signal.SIGKILL)
        if box.partial:
            _write_all(1, box.partial + b"\n")
        for fd in (box.out, box.stdin, box.stdout):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        box.sock.close()
        self._live.pop(box.id, None)
        self._exits.pop(box.id, None)

    def close(self) -> None:
        for box in list(self._live.values()) + list(self._delivered.values()):
            self.end(box)
        self.control.close()

    # -- the zygote's messages ------------------------------------------------------------------
    def _read_control(self, block: bool, timeout: float | None = None) -> None:
        if not block:
            ready = self._poll([self.control], 0.0 if timeout is None else max(0.0, timeout))
            if self.control.fileno() not in ready:
                return
        data, fds = _recv_fds(self.control)
        if not data:
            raise WorkerBroken("the zygote exited")
        try:
            payloads = self.reader.feed(data)
        except ProtocolError as e:
            raise WorkerBroken(f"the zygote sent garbage ({e})") from None
        for payload in payloads:
            message = _json(payload)
            kind = message.get("t")
            if kind == "box":
                self._delivered[message["id"]] = _box(message, fds)
            elif kind == "exit":
                if self._holds(message["id"]):
                    self._exits[message["id"]] = message  # until `end`
            else:
                self._pending.append(message)

    def _holds(self, box_id: int) -> bool:
        """Whether box `box_id` is live or delivered (not ended): the notice of an ended
        box, which usually arrives after `end` (the zygote reaps what it killed), is
        dropped, so `_exits` holds live boxes only."""
        box = self._live.get(box_id) or self._delivered.get(box_id)
        return box is not None and not box.ended

    @staticmethod
    def _poll(handles: list, timeout: float) -> set[int]:
        poller = select.poll()
        for h in handles:
            fd = h if isinstance(h, int) else h.fileno()
            poller.register(fd, select.POLLIN | getattr(select, "POLLRDHUP", 0))
        ms = -1 if timeout == math.inf else int(math.ceil(timeout * 1000))
        try:
            return {fd for fd, _ in poller.poll(ms)}
        except InterruptedError:
            return set()


def _box(message: dict, fds: list[int]) -> Box:
    sock = socket.socket(fileno=fds[0])
    os.set_blocking(fds[1], False)
    stdin = fds[2] if len(fds) > 2 else None
    stdout = fds[3] if len(fds) > 3 else None
    return Box(message["id"], message["pid"], sock, fds[1], stdin, stdout,
               metered=message.get("meter", True) is not False)  # fmt: skip


def _sender(ancillary: list) -> int | None:
    for level, kind, data in ancillary:
        if (
            level == socket.SOL_SOCKET
            and kind == socket.SCM_CREDENTIALS
            and len(data) >= _CRED.size
        ):
            return _CRED.unpack_from(data)[0]
    return None


def _json(payload: bytes) -> dict:
    import json

    message = json.loads(payload.decode("utf-8"), parse_constant=_no_constant)
    if type(message) is not dict:
        raise ValueError("not an object")
    return message


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a finite number")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    with contextlib.suppress(OSError):  # the trainer closed its end: nothing to show
        while view:
            view = view[os.write(fd, view) :]


def _recv_fds(sock: socket.socket) -> tuple[bytes, list[int]]:
    fds = array.array("i")
    data, ancillary, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(8 * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    return data, list(fds)


def send_fds(sock: socket.socket, message: dict, fds: list[int]) -> None:
    """The zygote's: one JSON frame with descriptors attached."""
    data = frame(json_payload(message))
    sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


# -- inside a box ---------------------------------------------------------------------------


class BoxConn:
    """A box's end: the supervisor's requests in, one JSON reply per request out."""

    def __init__(self, sock: socket.socket, spec: dict, meter: OutputMeter | None,
                 endpoint: str | None = None):  # fmt: skip
        self.sock = sock
        self.spec = spec
        self.meter = meter
        self.endpoint = endpoint

    def recv(self) -> Any:
        """The next request (EOFError when the supervisor ends the box)."""
        return pickle.loads(read_frame(self.sock))

    def send(self, message: dict) -> None:
        """One reply; ValueError (not sent) if it is larger than the trainer accepts."""
        payload = json_payload(message)
        if len(payload) > MAX_REPLY_BYTES:
            raise ValueError(
                f"a reply of {len(payload)} bytes, over the {MAX_REPLY_BYTES} the trainer accepts"
            )
        self.settle()  # what was printed reaches the supervisor first
        self.sock.sendall(frame(payload))

    def settle(self) -> None:
        """What the box printed so far is in the output pipe (through the meter, if any)."""
        if self.meter is not None:
            self.meter.settle()
            return
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # user code may have closed or replaced it
                stream.flush()

    def limited_call(self, timeout_s: float, cpu_time_limit_s: float | None) -> LimitedCall:
        return LimitedCall(timeout_s, cpu_time_limit_s, self.spec, self.meter)

    def linger(self) -> None:
        """Wait to be ended (the supervisor reads the reply from a live sender)."""
        with contextlib.suppress(EOFError, OSError):
            while True:
                read_frame(self.sock)
