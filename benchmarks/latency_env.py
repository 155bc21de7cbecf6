"""benchmarks/multiturn.py's environment: asks for another turn until `turns` turns are done,
each step taking a latency drawn from a heavy-tailed mix (one step in `slow_every` takes
`slow_s`, the others `fast_s`). The draw is a hash of the turn's text and index, so a
trajectory meets the same latencies whichever scheduler runs it. Imported by the
environment workers (stdlib only, so they start fast)."""

from __future__ import annotations

import time
import zlib

from leangrpo.environments import Environment, ModelTurn, StepResult


class HeavyTail(Environment):
    def __init__(
        self, turns: int = 6, fast_s: float = 0.005, slow_s: float = 0.5, slow_every: int = 10
    ):
        self.turns, self.fast_s, self.slow_s, self.slow_every = turns, fast_s, slow_s, slow_every

    def step(self, turn: ModelTurn) -> StepResult:
        draw = zlib.crc32(f"{turn.index}:{turn.text}".encode())
        if self.slow_s or self.fast_s:
            time.sleep(self.slow_s if draw % self.slow_every == 0 else self.fast_s)
        if turn.index + 1 >= self.turns:
            return StepResult(done=True)
        return StepResult([{"role": "user", "content": "and again?"}])
