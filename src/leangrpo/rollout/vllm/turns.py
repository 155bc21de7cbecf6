"""The vLLM engine's turn streams (`contracts.TurnStream`, made by `VLLMEngine.open_turns`).

- `LocalTurnStream` (colocated): each turn is added to the in-process engine when it is
  submitted (`LocalVLLM.enqueue`, n = 1, its own seed and budget) and every `advance` is
  one engine step (`LocalVLLM.step`): vLLM's scheduler batches the turns continuously,
  and its prefix cache (on) holds each trajectory's earlier turns, so a turn prefills
  only what the cache misses (`RequestOutput.num_cached_tokens`: "saved"). The stream is
  admitted at its version for its whole life (a full-weight update waits for it); turns
  still pending at `close` are aborted.
- `ServerTurnStream` (servers): each turn is one request to its trajectory's server
  (`ServerPool.turn`: sticky, least-loaded first, re-routed if the server fails) on the
  pool's threads, so many are in flight; `advance` waits at most its timeout for the
  next replies. Turns still in flight at `close` finish on their servers unheard.
"""

from __future__ import annotations

import queue
from collections import Counter
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

from leangrpo.contracts import Completion, SamplingParams, TurnRequest
from leangrpo.rollout.vllm.client import ServerPool
from leangrpo.rollout.vllm.local import LocalVLLM, completion_from_output, to_vllm_sampling_params


def turn_params(params: SamplingParams, request: TurnRequest) -> SamplingParams:
    """The call's sampling settings with the turn's own budget and seed."""
    return replace(params, max_new_tokens=request.max_new_tokens, seed=request.seed)


class LocalTurnStream:
    def __init__(self, local: LocalVLLM, params: SamplingParams, version: int, run: str | None):
        self.local, self.params, self.version, self.run = local, params, version, run
        self._admission: AbstractContextManager = local.gate.admit(version, run)
        self._admission.__enter__()
        self._pending: dict[str, TurnRequest] = {}
        self.stats: Counter[str] = Counter()
        self._closed = False

    def submit(self, request: TurnRequest) -> None:
        if self._closed:
            raise RuntimeError("this turn stream is closed")
        start = len(request.ids) - 1 if self.local.routes else None  # routing replay
        sampling = to_vllm_sampling_params(turn_params(self.params, request), 1, start)
        (request_id,) = self.local.enqueue(
            [request.ids], [sampling], run=self.run, version=self.version
        )
        self._pending[request_id] = request

    def pending(self) -> int:
        return len(self._pending)

    def advance(self, timeout_s: float = 0.0) -> list[tuple[TurnRequest, Completion]]:
        done = []
        for request_id, output in self.local.step(self._pending).items():
            request = self._pending.pop(request_id)
            cached = output.num_cached_tokens or 0
            self.stats["prefill_tokens"] += len(request.ids) - cached
            self.stats["prefill_tokens_saved"] += cached
            completion = completion_from_output(output.outputs[0], self.version, self.local.routes)
            done.append((request, completion))
        return done

    def release(self, key: int) -> None:
        pass  # vLLM's prefix cache evicts on its own

    def metrics(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.stats.items()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._pending:
                self.local.abort(list(self._pending))
                self._pending.clear()
        finally:
            self._admission.__exit__(None, None, None)

    def __enter__(self) -> LocalTurnStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ServerTurnStream:
    def __init__(self, pool: ServerPool, params: SamplingParams, version: int, run: str):
        self.pool, self.params, self.version, self.run = pool, params, version, run
        self._replies: queue.Queue[tuple[TurnRequest, Any]] = queue.Queue()
        self._pending = 0
        self._served_before = [s.served for s in pool.router.servers]
        self._retries_before = pool.router.retries
        self._closed = False

    def submit(self, request: TurnRequest) -> None:
        if self._closed:
            raise RuntimeError("this turn stream is closed")
        self._pending += 1
        self.pool.turn_threads.submit(self._run, request)

    def route(self, key: int | None) -> tuple | None:
        """The router's key for a trajectory of this stream (None: no stickiness)."""
        return None if key is None else (id(self), key)

    def _run(self, request: TurnRequest) -> None:
        try:
            reply: Any = self.pool.turn(
                request,
                turn_params(self.params, request),
                self.version,
                run=self.run,
                route=self.route(request.key),
            )
        except BaseException as err:  # raised by advance, in the driving thread
            reply = err
        self._replies.put((request, reply))

    def pending(self) -> int:
        return self._pending

    def advance(self, timeout_s: float = 0.0) -> list[tuple[TurnRequest, Completion]]:
        try:
            got = [
                self._replies.get(timeout=timeout_s)
                if timeout_s > 0
                else self._replies.get_nowait()
            ]
        except queue.Empty:
            return []
        while True:
            try:
                got.append(self._replies.get_nowait())
            except queue.Empty:
                break
        self._pending -= len(got)
        for _, reply in got:
            if isinstance(reply, BaseException):
                raise reply
        return got

    def release(self, key: int) -> None:
        self.pool.router.forget(self.route(key))

    def metrics(self) -> dict[str, float]:
        out = {
            f"server/{s.index}/requests": float(s.served - before)
            for s, before in zip(self.pool.router.servers, self._served_before)
        }
        out["server_retries"] = float(self.pool.router.retries - self._retries_before)
        out["servers_down"] = float(sum(not s.healthy for s in self.pool.router.servers))
        return out

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> ServerTurnStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
