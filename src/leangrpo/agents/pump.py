"""The thread that drives a turn stream for the endpoint's requests.

A `contracts.TurnStream` is driven by one thread (hf's continuous batch is not
thread-safe); the endpoint's requests arrive on the HTTP server's event loop. `TurnPump`
is that one thread: `submit(request)` hands it a turn and returns a future of the turn's
`Completion`; the thread submits what arrived, advances the stream while anything is
pending (each turn joins the running batch as it comes: per-trajectory scheduling), and
sleeps on its inbox when nothing is. `release(key)` lets the stream drop what it keeps for
a segment that ended (a KV cache, a sticky server). A failure of the stream fails the
turns in flight (their requests answer 500), never the thread; `close` fails the rest.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future

from leangrpo.contracts import Completion, TurnRequest, TurnStream

log = logging.getLogger("leangrpo.agents")
IDLE_WAIT_S = 0.05  # how long the thread sleeps on its inbox with nothing pending
SERVER_WAIT_S = 0.01  # a stream waiting on servers waits at most this long per advance


class TurnPump:
    def __init__(self, stream: TurnStream):
        self.stream = stream
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: dict[int, Future] = {}
        self._thread = threading.Thread(target=self._run, name="leangrpo-agent-turns", daemon=True)
        self._thread.start()

    def submit(self, request: TurnRequest) -> Future[Completion]:
        future: Future[Completion] = Future()
        self._inbox.put(("turn", request, future))
        return future

    def release(self, key: int) -> None:
        self._inbox.put(("release", key, None))

    def close(self) -> None:
        self._inbox.put(("close", None, None))
        self._thread.join()

    # -- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._take(block=not self.stream.pending()):
                if self.stream.pending():
                    self._advance()
        finally:
            self._fail_all(RuntimeError("the endpoint stopped generating (the generation call ended)"))
            while True:  # turns that arrived after the close
                try:
                    _, _, future = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if future is not None:
                    future.set_exception(RuntimeError("the endpoint is not generating"))

    def _take(self, block: bool) -> bool:
        """Submit what arrived (waiting a little for it when `block`); False at close."""
        try:
            item = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            op, value, future = item
            if op == "close":
                return False
            if op == "release":
                self.stream.release(value)
            else:
                try:
                    self.stream.submit(value)
                except Exception as e:  # noqa: BLE001  the turn's request fails, not the thread
                    future.set_exception(e)
                else:
                    self._waiting[value.key] = future
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _advance(self) -> None:
        try:
            done = self.stream.advance(SERVER_WAIT_S)
        except Exception as e:  # noqa: BLE001
            log.warning("the turn stream failed; its turns in flight fail: %s", e)
            self._fail_all(e)
            return
        for request, completion in done:
            future = self._waiting.pop(request.key, None)
            if future is not None:
                future.set_result(completion)

    def _fail_all(self, error: BaseException) -> None:
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(error)
