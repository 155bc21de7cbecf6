"""A worker entry for tests/sandbox/test_boxes.py: an environment worker whose supervisor
skips its own check and answers every item with the reward term 'forged' (what a
supervisor subverted some other way would send): the trainer's own check is what is left.
The environment is imported as the real worker does (environments/worker.py `prepare`)."""

from __future__ import annotations

import pickle

from leangrpo.environments import worker

FORGED = {"forged": 100.0}
PAYLOADS = {
    "reset": {"messages": None},
    "step": {"reply": [{"role": "tool", "content": "x"}], "done": False, "rewards": FORGED,
             "metrics": {}, "counts": {}, "calls": [], "seconds": 0.0},  # fmt: skip
    "finish": {"rewards": FORGED, "metrics": {}, "seconds": 0.0},
}


def prepare(init: dict, announce) -> object:
    return worker.prepare(init, announce)


def supervise(channel, init: dict, boxes) -> None:
    for report in boxes.setup_messages():
        channel.send(report)
        if report.get("t") in ("ready", "init_error"):
            break
    while True:
        task, op, items = pickle.loads(channel.recv())
        for i in range(len(items)):
            channel.send({"t": "item", "task": task, "i": i, "ok": PAYLOADS[op]})
