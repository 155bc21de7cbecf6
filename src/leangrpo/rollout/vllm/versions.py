"""Policy identity on the vLLM side: a policy is (run id, version).

The client engine draws a run id (uuid) at construction and sends (run id, version) with
every update and generation; until its run has pushed weights it reports `NO_VERSION`.
`VersionGate` holds one (run, version) for an in-process LLM (colocated or behind
`leangrpo serve`) and enforces the rules:

- generation is admitted only for the (run, version) held;
- an update from another run always loads; within a run versions only move forward:
  the same version again is a retried update (nothing to do), an older one is refused.

See docs/rollout.md ("Policy identity").
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from leangrpo.contracts import EngineVersionError

NO_VERSION = -1  # an engine's version before this run has pushed any weights to it


class VersionGate:
    """Admits requests for the held (run, version); an update waits for them and swaps.

    Requests admitted before an update always complete on the version they were admitted
    under; requests arriving during an update wait for it, then are checked. `run` None
    stands for the weights loaded from disk at start-up, which no client run can claim.
    """

    def __init__(self, version: int = 0, run: str | None = None):
        self._cond = threading.Condition()
        self._inflight: Counter[tuple[str | None, int]] = Counter()
        self._updating = False
        self.run = run
        self.version = version

    @property
    def held(self) -> tuple[str | None, int]:
        with self._cond:
            return self.run, self.version

    @contextmanager
    def admit(self, version: int, run: str | None = None) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._updating)
            if (run, version) != (self.run, self.version):
                raise EngineVersionError(self._refusal(run, version))
            self._inflight[run, version] += 1
        try:
            yield
        finally:
            with self._cond:
                self._inflight[run, version] -= 1
                self._cond.notify_all()

    def _refusal(self, run: str | None, version: int) -> str:
        if run == self.run:
            return (
                f"generation requested for policy version {version}, but the engine holds "
                f"version {self.version}; sync the weights first (update_weights/load_adapter)"
            )
        held = "no run's weights" if self.run is None else f"run {self.run}'s weights"
        return (
            f"generation requested for run {run} version {version}, but the engine holds {held}; "
            "the trainer pushes its weights at start, so another run has used this server since "
            "(never share a `leangrpo serve` between two runs)"
        )

    def check_update(self, version: int, run: str | None) -> bool:
        """Whether an update to (run, version) loads anything; refuses going backwards."""
        if version < 0:
            raise ValueError(f"policy versions are >= 0, got {version}")
        with self._cond:
            if run != self.run:
                return True  # a new run's weights always load
            if version < self.version:
                raise EngineVersionError(
                    f"update of run {run} to version {version} refused: the engine already holds "
                    f"version {self.version} of this run, and versions never go backwards"
                )
            return version > self.version  # the same version again: a retried update

    @contextmanager
    def update(self, new_version: int, drain: bool, run: str | None = None) -> Iterator[bool]:
        """Hold new requests back, optionally wait for in-flight ones, then hold `new_version`.

        Yields whether there is anything to load (False: this run already holds it)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._updating)
            needed = self.check_update(new_version, run)
            self._updating = needed
            if needed and drain:
                self._cond.wait_for(lambda: sum(self._inflight.values()) == 0)
        if not needed:
            yield False
            return
        done = False
        try:
            yield True
            done = True
        finally:
            with self._cond:
                if done:
                    self.run, self.version = run, new_version
                self._updating = False
                self._cond.notify_all()

    @property
    def in_flight(self) -> int:
        with self._cond:
            return sum(self._inflight.values())

    def in_use(self, key: tuple[str | None, int]) -> bool:
        with self._cond:
            return self._inflight[key] > 0
