"""The supervisor's side of the zygote (sandbox/box.py `Boxes`) over a long run: what it
keeps per box is gone with the box, whenever the zygote's notices arrive."""

from __future__ import annotations

import os
import socket

from leangrpo.sandbox.box import Boxes, send_fds
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
    channel, _trainer = socket.socketpair()
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
        os.waitpid(pid, 0)
