"""The zygote's cost measures (sandbox/zygote.py, pages.py) keep a box what it was: its
descriptors where they belong however many the zygote holds while it forks a batch, and
the zygote's memory moved into huge pages where the kernel has them."""

from __future__ import annotations

import ast
import subprocess
import sys

import psutil
import pytest
from support.configs import rewards_section

from leangrpo.contracts import Completion, Prompt, RolloutSample
from leangrpo.rewards import RewardPool
from leangrpo.sandbox.frames import CHANNEL_FD_MIN

SETTLE_IN_A_FULL_TABLE = f"""
import os
from leangrpo.sandbox.zygote import _settle_descriptors
report = os.dup(1)  # the test's pipe
sock_r, sock_w = os.pipe()
out_r, out_w = os.pipe()
while os.open(os.devnull, os.O_RDONLY) < {CHANNEL_FD_MIN} - 1:  # every place below 100 taken
    pass
placed = _settle_descriptors({{"sock": sock_w, "out": out_w, "report": report}})
ino = {{name: os.fstat(fd).st_ino for name, fd in placed.items()}}
line = repr([placed, ino["out"] == os.fstat(1).st_ino, len(set(ino.values())),
             sorted(int(fd) for fd in os.listdir("/proc/self/fd"))])
os.write(placed["report"], line.encode())
"""


def test_a_boxs_descriptors_are_placed_whatever_the_zygote_holds():
    """A zygote forking a batch holds each box's descriptors at once (16 boxes: about 100):
    a box's `dup` then landed on the places its descriptors were moved to, so that moving
    one overwrote another (its socket became its output pipe) or dup3 onto itself failed
    (EINVAL: the box died before its call, counted as the call's failure)."""
    done = subprocess.run([sys.executable, "-c", SETTLE_IN_A_FULL_TABLE], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    placed, out_is_1, distinct, held = ast.literal_eval(done.stdout)
    low = CHANNEL_FD_MIN
    assert placed == {"out": low, "report": low + 1, "sock": low + 2}, done.stdout
    assert out_is_1 and distinct == 3, done.stdout
    others = [fd for fd in held if fd not in (low, low + 1, low + 2)]
    assert others[:3] == [0, 1, 2] and len(others) <= 4, done.stdout  # and the listing's own


def make_samples() -> list[RolloutSample]:
    question = Prompt(0, "1+2=", [1], columns={"answer": "3"})
    return [RolloutSample(0, question, Completion([1], "3", [0.0], "stop", 0))]


HUGE_PAGES = """
from leangrpo.sandbox.pages import collapse
block = bytearray(32 << 20)
block[::4096] = b"x" * len(block[::4096])  # every page touched: 32 MiB held
moved = collapse()
huge = [l for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages:")]
print(moved, int(huge[0].split()[1]) << 10)
"""


def huge_pages_here() -> tuple[int, int]:
    done = subprocess.run([sys.executable, "-c", HUGE_PAGES], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    moved, huge = done.stdout.split()
    return int(moved), int(huge)


def test_collapse_moves_memory_into_huge_pages():
    moved, huge = huge_pages_here()
    if moved == 0:
        pytest.skip("this kernel moves no memory into huge pages (MADV_COLLAPSE: Linux >= 6.1, THP)")
    assert moved >= 16 << 20 and huge >= 16 << 20, (moved, huge)


def test_a_zygote_forks_from_huge_pages():
    """A fork copied one page-table entry per 4 KiB of the zygote (math-verify's: 50 MB),
    most of a call's cost; the zygote now serves from huge pages where there are any."""
    if huge_pages_here()[0] == 0:
        pytest.skip("this kernel moves no memory into huge pages (MADV_COLLAPSE: Linux >= 6.1, THP)")
    cfg = rewards_section(("math", 1.0, {"answer_column": "answer"}), sandbox={"level": "process"})
    with RewardPool(cfg) as pool:
        pool.score(make_samples())  # the worker ready
        (zygote,) = psutil.Process(pool._workers[0].pid).children()
        try:
            with open(f"/proc/{zygote.pid}/smaps_rollup") as f:
                rollup = f.read()
        except PermissionError:  # a non-dumpable process of another user's namespace
            pytest.skip("the zygote's memory map is not readable here (not root)")
    huge = [line for line in rollup.splitlines() if line.startswith("AnonHugePages:")]
    assert int(huge[0].split()[1]) > 0, rollup
