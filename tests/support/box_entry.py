"""A worker entry for tests/sandbox/test_boxes.py: the box API's (b) half, an arbitrary
command per episode with stdin/stdout pipes and one forwarded endpoint (what the agents'
episodes use). `prepare` imports nothing; `supervise` runs init["argv"] in a box and
sends the trainer what it printed."""

from __future__ import annotations

import os
import time


def prepare(init: dict, announce) -> object:
    announce({"t": "ready"})
    return lambda conn: None


def supervise(channel, init: dict, boxes) -> None:
    for report in boxes.setup_messages():
        channel.send(report)
        break
    box = boxes.command(init["argv"], network=True, forward=init.get("forward"))
    os.write(box.stdin, init.get("stdin", "").encode())
    os.close(box.stdin)
    box.stdin = None
    chunks, deadline = [], time.monotonic() + 30
    while time.monotonic() < deadline:
        data = os.read(box.stdout, 1 << 16)
        if not data:
            break
        chunks.append(data)
    channel.send({"t": "result", "out": b"".join(chunks).decode()})
    boxes.end(box)
    channel.recv()  # until the trainer closes
