"""The multi-turn rollout's event loop: model turns through a `TurnStream`, environment
calls through the pool, released as `environment.scheduling` says.

`Scheduler(stream, pool, mode, trajectories).run()` drives every trajectory of a
generation call from its reset to its finish. The trajectories' own logic (what a turn
asks for, what an outcome means) is the driver's (`Trajectories`, driver.py); this module
decides only when things are submitted and waits for whichever side answers next:

- `per_trajectory`: a reset, a model turn, an environment step or a finish is submitted
  the moment its trajectory is ready for it; a slow environment call holds up only its
  own trajectory (and the sessions queued behind it on its worker).
- `rounds`: turns are held until no environment call is in flight and the engine has
  nothing pending, environment steps until the engine has nothing pending (every turn of
  the round is back), finishes until every trajectory has ended: the lockstep of the
  rounds, whatever the timing.

Held items are released in trajectory order. Waiting: an engine that computes
(`advance` does a step) is advanced and the pool polled without waiting; when the engine
has nothing to do, the loop blocks on the pool (that time is `env_wait_s`); when the pool
has nothing in flight it blocks on the engine. Both busy, on servers: short alternating
waits (POLL_S).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from leangrpo.contracts import Completion, TurnRequest, TurnStream

Mode = Literal["per_trajectory", "rounds"]
POLL_S = 0.002  # engine and pool both busy: how long each wait lasts in turn
WAIT_S = 1.0  # one side idle: the longest single wait on the other


class Trajectories(Protocol):
    """What the scheduler asks of the trajectories of a call (driver.py's `_Call`); `t` is
    a trajectory's index in the call. Each handler returns what the trajectory needs next:
    "turn" (a model turn), "step" (an environment step of the turn's text), "finish"
    (its environment's closing call) or "done"."""

    def count(self) -> int: ...

    def reset_item(self, t: int) -> tuple: ...

    def on_reset(self, t: int, outcome: Any) -> str: ...

    def turn_request(self, t: int) -> TurnRequest: ...

    def on_turn(self, t: int, completion: Completion) -> str: ...

    def step_item(self, t: int) -> tuple: ...

    def on_step(self, t: int, outcome: Any) -> str: ...

    def finish_item(self, t: int) -> tuple | None: ...

    def on_finish(self, t: int, outcome: Any) -> None: ...


@dataclass
class LoopStats:
    generation_s: float = 0.0  # in the engine's advance
    env_wait_s: float = 0.0  # blocked on the environments with the engine idle
    in_flight_s: float = 0.0  # integral of live trajectories over time
    in_flight_max: int = 0
    elapsed_s: float = 0.0

    def metrics(self) -> dict[str, float]:
        mean = self.in_flight_s / self.elapsed_s if self.elapsed_s > 0 else 0.0
        return {
            "generation_s": self.generation_s,
            "env_wait_s": self.env_wait_s,
            "in_flight_mean": mean,
            "in_flight_max": float(self.in_flight_max),
        }


@dataclass
class _Held:
    """What `rounds` holds back: trajectories waiting for a turn, a step, a finish."""

    turn: list[int] = field(default_factory=list)
    step: list[int] = field(default_factory=list)
    finish: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(self, stream: TurnStream, pool: Any, mode: Mode, trajectories: Trajectories):
        if mode not in ("per_trajectory", "rounds"):
            raise ValueError(
                f"environment.scheduling must be per_trajectory or rounds, got {mode!r}"
            )
        self.stream, self.pool, self.mode, self.calls = stream, pool, mode, trajectories
        self.held = _Held()
        self.tickets: dict[int, tuple[str, int]] = {}  # pool ticket -> (op, trajectory)
        self.live = set(range(trajectories.count()))
        self.stats = LoopStats()

    def run(self) -> LoopStats:
        start = last = time.perf_counter()
        for t in sorted(self.live):
            self._call("reset", t, self.calls.reset_item(t))
        while self.live:
            self._release()
            if not self.stream.pending() and not self.pool.in_flight():
                raise RuntimeError(
                    f"the multi-turn scheduler stalled with {len(self.live)} trajectories live "
                    "and nothing in flight (a bug: please report it)"
                )
            self._wait_once()
            now = time.perf_counter()
            self.stats.in_flight_s += len(self.live) * (now - last)
            self.stats.in_flight_max = max(self.stats.in_flight_max, len(self.live))
            last = now
        self.stats.elapsed_s = time.perf_counter() - start
        return self.stats

    # -- waiting ----------------------------------------------------------------------------
    def _wait_once(self) -> None:
        engine_busy, env_busy = self.stream.pending() > 0, self.pool.in_flight() > 0
        if engine_busy:
            t0 = time.perf_counter()
            done = self.stream.advance(POLL_S if env_busy else WAIT_S)
            self.stats.generation_s += time.perf_counter() - t0
            for request, completion in done:
                self._next(request.key, self.calls.on_turn(request.key, completion))
        if env_busy:
            engine_busy = self.stream.pending() > 0
            t0 = time.perf_counter()
            answered = self.pool.poll(0.0 if engine_busy else WAIT_S)
            if not engine_busy:
                self.stats.env_wait_s += time.perf_counter() - t0
            for ticket, outcome in answered:
                self._answered(*self.tickets.pop(ticket), outcome)

    def _answered(self, op: str, t: int, outcome: Any) -> None:
        if op == "reset":
            self._next(t, self.calls.on_reset(t, outcome))
        elif op == "step":
            self._next(t, self.calls.on_step(t, outcome))
        else:
            self.calls.on_finish(t, outcome)
            self._done(t)

    # -- what comes next ------------------------------------------------------------------
    def _next(self, t: int, need: str) -> None:
        if need == "done":
            self._done(t)
        elif self.mode == "rounds":
            getattr(self.held, need).append(t)
        else:
            self._submit(need, t)

    def _submit(self, need: str, t: int) -> None:
        if need == "turn":
            self.stream.submit(self.calls.turn_request(t))
        elif need == "step":
            self._call("step", t, self.calls.step_item(t))
        else:
            item = self.calls.finish_item(t)
            if item is None:  # no session to end (its reset or a call failed)
                self._done(t)
            else:
                self._call("finish", t, item)

    def _call(self, op: str, t: int, item: tuple) -> None:
        self.tickets[self.pool.submit(op, item)] = (op, t)

    def _done(self, t: int) -> None:
        self.live.discard(t)
        self.stream.release(t)

    def _release(self) -> None:
        """rounds: the held items whose phase has come, in trajectory order."""
        if self.mode != "rounds":
            return
        engine_idle = not self.stream.pending()
        env_idle = not self.pool.in_flight()
        if engine_idle and self.held.step:
            self._release_all("step", self.held.step)
        elif engine_idle and env_idle and self.held.turn:
            self._release_all("turn", self.held.turn)
        elif engine_idle and env_idle and len(self.held.finish) == len(self.live):
            self._release_all("finish", self.held.finish)

    def _release_all(self, need: str, held: list[int]) -> None:
        ready = sorted(held)
        held.clear()
        for t in ready:
            self._submit(need, t)
