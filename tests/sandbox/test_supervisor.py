"""The supervisor's side of the zygote (sandbox/box.py `Boxes`) over a long run: what it
keeps per box is gone with the box, whenever the zygote's notices arrive."""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import threading
import time

from leangrpo.sandbox.box import MAX_SPARES, Boxes, send_fds
from leangrpo.sandbox.frames import FrameReader

BOXES = 200


def test_the_supervisor_keeps_nothing_of_an_ended_box():
    """The zygote reports a box's exit after the supervisor has ended it (it kills the
    box, the zygote reaps it): that late notice used to stay in `_exits` for good, one
    entry per box of the run."""
    pid = os.fork()
    if pid == 0:  # a box's stand-in: a session of its own, a zombie until the end
        os.setsid()
        os._exit(0)
    supervisor, zygote = socket.socketpair()
    channel, trainer = socket.socketpair()
    boxes = Boxes(supervisor, channel.fileno(), spares=0)
    requests = FrameReader()
    held = []
    try:
        for n in range(1, BOXES + 1):
            box_end, ours = socket.socketpair()
            out_read, out_write = os.pipe()
            send_fds(zygote, {"t": "box", "id": n, "pid": pid}, [box_end.fileno(), out_read])
            box = boxes.start()
            assert box.id == n
            boxes.end(box)
            requests.feed(zygote.recv(1 << 16))  # its requests ("box", "ended")
            send_fds(zygote, {"t": "exit", "id": n, "code": -9, "oom": False}, [])
            box_end.close()
            os.close(out_read)
            held.append((ours, out_write))
        boxes._read_control(block=False, timeout=1.0)  # the last notice
        assert (len(boxes._exits), len(boxes._pending)) == (0, 0)
    finally:
        for sock, fd in held:
            sock.close()
            os.close(fd)
        for sock in (supervisor, zygote, channel, trainer):
            sock.close()
        os.waitpid(pid, 0)


class HeldZygote:
    """The zygote's side of the control socket, its forks held back: a box asked for is
    delivered (fresh descriptors, `pid`: a zombie) only once the supervisor waits for one
    (`gate`), or at once after `free()`."""

    def __init__(self, sock: socket.socket, pid: int):
        self.sock, self.pid = sock, pid
        self.gate = threading.Semaphore(0)
        self.free_all = False
        self.asked = self.delivered = 0
        self.held: list = []
        threading.Thread(target=self._serve, daemon=True).start()

    def free(self) -> None:
        self.free_all = True
        self.gate.release(1 << 20)

    def _serve(self) -> None:
        reader = FrameReader()
        with contextlib.suppress(OSError):
            while data := self.sock.recv(1 << 16):
                for payload in reader.feed(data):
                    request = pickle.loads(payload)
                    if request["t"] == "box":
                        self.asked += 1
                        self.gate.acquire()
                        self._deliver(request["id"])

    def _deliver(self, box_id: int) -> None:
        box_end, ours = socket.socketpair()
        out_read, out_write = os.pipe()
        send_fds(self.sock, {"t": "box", "id": box_id, "pid": self.pid},
                 [box_end.fileno(), out_read])  # fmt: skip
        box_end.close()
        os.close(out_read)
        self.held.append((ours, out_write))
        self.delivered += 1


def test_spare_boxes_grow_with_calls_that_wait_for_a_fork_and_stay_bounded():
    """A call whose spare box is not forked yet waits for the fork: the supervisor then
    keeps one more spare (a burst of calls, one scoring's, finds them ready next time),
    never more than MAX_SPARES; a call that finds its spare ready changes nothing."""
    pid = os.fork()
    if pid == 0:
        os.setsid()
        os._exit(0)
    supervisor, zygote_end = socket.socketpair()
    channel, trainer = socket.socketpair()
    boxes = Boxes(supervisor, channel.fileno(), spares=1)
    zygote = HeldZygote(zygote_end, pid)
    read = boxes._read_control

    def waiting(block: bool, timeout: float | None = None) -> None:
        if block and not zygote.free_all:  # the supervisor waits: one fork completes
            zygote.gate.release()
        read(block, timeout)

    boxes._read_control = waiting
    try:
        counts = []
        for _ in range(MAX_SPARES + 4):  # back to back: each waits for a fork
            boxes.end(boxes.start())
            counts.append(boxes.spare_count)
        assert counts == [min(MAX_SPARES, n) for n in range(2, MAX_SPARES + 6)], counts
        zygote.free()  # idle: every spare asked for is forked
        deadline = time.monotonic() + 30
        while zygote.delivered < zygote.asked and time.monotonic() < deadline:
            time.sleep(0.01)
        boxes.spare_count = 3
        boxes.end(boxes.start())
        assert boxes.spare_count == 3
    finally:
        for sock in (supervisor, zygote_end, channel, trainer):
            sock.close()
        for sock, fd in zygote.held:
            sock.close()
            os.close(fd)
        os.waitpid(pid, 0)


def test_a_call_that_finds_no_spare_ready_keeps_one_more_once():
    """The reward supervisor takes spares without waiting (`ready_spare`, calls side by
    side): a call that finds none ready keeps one more spare from then on, once per wait,
    so that the spares refilled in batches are there before the calls that need them."""
    pid = os.fork()
    if pid == 0:
        os.setsid()
        os._exit(0)
    supervisor, zygote_end = socket.socketpair()
    channel, trainer = socket.socketpair()
    boxes = Boxes(supervisor, channel.fileno(), spares=2)
    zygote = HeldZygote(zygote_end, pid)
    try:
        boxes.reserve(2)
        assert boxes.ready_spare() is None and boxes.spare_count == 3  # not forked yet
        assert boxes.ready_spare() is None and boxes.spare_count == 3  # the same wait
        zygote.free()
        deadline = time.monotonic() + 30  # a hang guard
        box = None
        while box is None and time.monotonic() < deadline:
            box = boxes.ready_spare()
            time.sleep(0.01)
        assert box is not None and boxes.spare_count == 3
        boxes.end(box)
        assert boxes.ready_spare() is not None and boxes.spare_count == 3  # ready: no more
    finally:
        for sock in (supervisor, zygote_end, channel, trainer):
            sock.close()
        for sock, fd in zygote.held:
            sock.close()
            os.close(fd)
        os.waitpid(pid, 0)


def test_a_burst_of_calls_asks_for_at_most_max_spares_at_once():
    """A scoring of hundreds of calls on one worker reserved a spare box per call: each
    holds descriptors in the supervisor and the zygote, and a batch of 256 ran out of them
    (the worker exited). The spares asked for at once stay within MAX_SPARES."""
    supervisor, zygote_end = socket.socketpair()
    channel, trainer = socket.socketpair()
    boxes = Boxes(supervisor, channel.fileno(), spares=0)
    try:
        boxes.reserve(256)
        boxes.reserve(256)  # the same burst: nothing more until spares are taken
        zygote_end.setblocking(False)
        reader, requests = FrameReader(), []
        with contextlib.suppress(BlockingIOError):
            while data := zygote_end.recv(1 << 16):
                requests += reader.feed(data)
        kinds = [pickle.loads(r)["t"] for r in requests]
        assert kinds == ["box"] * MAX_SPARES and boxes.spare_count == MAX_SPARES
    finally:
        for sock in (supervisor, zygote_end, channel, trainer):
            sock.close()
