"""Which `leangrpo serve` a request goes to, when the engine has several (`rollout.vllm.urls`).

`Router` keeps, per server: healthy or down, the (run, version) this client committed there,
its requests in flight and the requests it served. The rules (client.py applies them):

- a trajectory's first turn goes to the least-loaded healthy server holding the version
  asked for (fewest requests in flight, then fewest served, then the lowest index); its
  later turns stay on that server (sticky: its prefix is in that server's cache) while it
  is healthy and holds the version;
- a single-turn call spreads its prompt groups (a prompt's n samples stay together) over
  the eligible servers, each group to the one with the fewest assigned so far;
- a server that fails a request (refused or reset connection, timeout, 5xx) is marked
  down: it gets nothing until a weight sync reaches it again (a served teacher's, which
  takes no weights: until it answers a health probe, `back`); the request is re-routed
  (`reroute`), counted in `retries`;
- a request goes to a server whose committed (run, version) is the one asked for while
  one exists; a server that missed a sync is never chosen over one that took it, and the
  server's own version gate refuses (409) whatever it does not hold, so stale weights
  never serve;
- a server that refuses (409) a version this client committed there lost those weights
  (it restarted, or another run pushed to it): it is marked down holding nothing known
  (`lost_weights`), so the next weight sync reaches it, and the request is re-routed to a
  server that holds the version.

Thread-safe: the turn stream's request threads and the caller share one router. A turn
stream keys its trajectories by (stream, key), so two streams at once (training and
evaluation) never share a trajectory's server by accident.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass

from leangrpo.rollout.vllm.versions import NO_VERSION


class NoServerLeft(RuntimeError):
    """No healthy server holds the version a request asks for."""


@dataclass
class Server:
    index: int
    url: str
    healthy: bool = True
    held: tuple[str | None, int] = (None, NO_VERSION)  # what this client committed there
    in_flight: int = 0
    served: int = 0
    failures: int = 0
    last_error: str = ""


class Router:
    def __init__(self, urls: list[str], key: str = "rollout.vllm.urls"):
        self.servers = [Server(i, url) for i, url in enumerate(urls)]
        self.key = key  # the config key that lists the servers, for messages
        self._sticky: dict[Hashable, int] = {}  # trajectory key -> server index
        self._lock = threading.Lock()
        self.retries = 0

    def eligible(self, run: str | None, version: int) -> list[Server]:
        """Healthy servers holding (run, version)."""
        return [s for s in self.servers if s.healthy and s.held == (run, version)]

    def for_turn(self, key: Hashable | None, run: str | None, version: int, requests: int = 1) -> Server:
        """The trajectory's server (sticky), else the least loaded; `requests` counted in
        flight there."""
        with self._lock:
            candidates = self._candidates(run, version)
            chosen = None
            if key is not None and key in self._sticky:
                sticky = self.servers[self._sticky[key]]
                chosen = sticky if sticky in candidates else None
            if chosen is None:
                chosen = min(candidates, key=_load)
                if key is not None:
                    self._sticky[key] = chosen.index
            chosen.in_flight += requests
            return chosen

    def spread(self, groups: int, run: str | None, version: int) -> list[Server]:
        """A server for each of `groups` prompt groups, evenly over the eligible ones
        (the least loaded first); each assignment counted in flight."""
        with self._lock:
            candidates = self._candidates(run, version)
            assigned = {s.index: 0 for s in candidates}
            out = []
            for _ in range(groups):
                chosen = min(candidates, key=lambda s: (assigned[s.index], *_load(s)))
                assigned[chosen.index] += 1
                chosen.in_flight += 1  # `done` / `failed` count it back
                out.append(chosen)
            return out

    def done(self, server: Server, requests: int = 1) -> None:
        """`requests` of the server's in flight came back."""
        with self._lock:
            server.in_flight -= requests
            server.served += requests

    def failed(self, server: Server, error: str, requests: int = 1) -> None:
        """The server failed: it is marked down; its request is the caller's to re-route."""
        with self._lock:
            server.in_flight -= requests
            server.failures += 1
            server.healthy = False
            server.last_error = error

    def lost_weights(self, server: Server, error: str, requests: int = 1) -> None:
        """The server no longer holds what this client committed there: down, holding
        nothing known, until a weight sync reaches it; its request is the caller's to
        re-route."""
        with self._lock:
            server.in_flight -= requests
            server.failures += 1
            server.healthy = False
            server.held = (None, NO_VERSION)
            server.last_error = error

    def reroute(self, key: Hashable | None, run: str | None, version: int, requests: int = 1) -> Server:
        """Another server for `requests` whose server failed (counted as retries)."""
        with self._lock:
            self.retries += requests
            if key is not None:
                self._sticky.pop(key, None)
        return self.for_turn(key, run, version, requests)

    def server_of(self, key: Hashable) -> int | None:
        """The index of the server a trajectory's turns go to (None: none yet)."""
        with self._lock:
            return self._sticky.get(key)

    def forget(self, key: Hashable) -> None:
        with self._lock:
            self._sticky.pop(key, None)

    def back(self, server: Server) -> None:
        """A teacher's server marked down answered its health probe: it serves again
        (holding what it held; a rollout server comes back by a weight sync instead)."""
        with self._lock:
            server.healthy = True

    def committed(self, server: Server, held: tuple[str | None, int]) -> None:
        """A weight sync reached the server: it holds `held` and serves again."""
        with self._lock:
            server.held = held
            server.healthy = True

    def _candidates(self, run: str | None, version: int) -> list[Server]:
        """The healthy servers known to hold (run, version); none known (a pool that never
        pushed): every healthy server, whose version gate answers (409 when it holds
        other weights)."""
        candidates = self.eligible(run, version) or [s for s in self.servers if s.healthy]
        if not candidates:
            raise NoServerLeft(self._why_none(run, version))
        return candidates

    def _why_none(self, run: str | None, version: int) -> str:
        down = "; ".join(f"{s.url} ({s.last_error})" for s in self.servers)
        return (
            f"every vLLM server failed: {down}; check the `leangrpo serve` processes in "
            f"{self.key}"
        )


def _load(server: Server) -> tuple[int, int, int]:
    return server.in_flight, server.served, server.index
