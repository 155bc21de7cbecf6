"""The OpenAI-compatible endpoint: HTTP on loopback, served from the run's rollout engine.

`AgentEndpoint(tokenizer, config, template, eos_ids)` checks the chat template
(it must render turn by turn, as for environments) and `start()`s a uvicorn server on
127.0.0.1 (a free port) in a thread of its own. It serves:

    GET  /v1/models
    POST /v1/chat/completions   messages, tools, tool_choice ('auto'), temperature, top_p,
                                top_k, min_p (the run's own only), max_tokens /
                                max_completion_tokens, stop, n = 1, logprobs, stream,
                                stream_options.include_usage, return_token_ids
    POST /v1/completions        prompt: text or token ids; the same settings

under `/v1` with the session key as the API key (`Authorization: Bearer KEY`), and under
`/s/KEY/v1` (the key in the base URL, for clients that cannot set one). A request with no
known key is refused (401, counted in agent/foreign_keys): sessions exist only while the
trainer holds them open.

Requests are answered only inside `generating(engine, params, version)` (one at a time:
the producer's and the evaluator's calls take turns), which opens the engine's turn
stream at the run's sampling settings and policy version and drives it from one
thread (pump.py): every turn, of any session, joins the running batch as it arrives, each
segment keeping its KV cache (hf) or its server (vLLM servers) under its own key.
`open_session(prompt, seed, index)` makes an episode's session (sessions.py records it);
`end_session(key)` closes it (later requests: 404) and releases what the stream keeps for
it. With `open_keys` (`leangrpo serve-agent`, agents/serve.py) any key opens a session of
its own on its first request (the least recently used ended beyond that many). Metrics (`metrics()`): agent/requests, agent/refused, agent/foreign_keys,
agent/errors, agent/prefix_breaks, agent/abandoned (turns whose client disconnected before
the answer: never recorded), agent/latency_s (mean per answered request). A turn whose
session ended while it was generated is not recorded either (404).

A request body over `max_body_bytes(max_total_tokens)` (16 bytes per token of
agent.max_total_tokens, at least 1 MiB) is refused with 413 (code request_too_large) as
soon as its Content-Length or the bytes read so far pass it; rendering and tokenizing a
request, and cutting a turn at its stop strings, run in a worker thread, off the event
loop every session shares.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from leangrpo.agents.openai_api import (
    Answer,
    Refused,
    assistant_message,
    chat_chunks,
    chat_response,
    check_tool_choice,
    completion_response,
    sampling_limits,
    template_messages,
    tools_key,
)
from leangrpo.agents.pump import TurnPump
from leangrpo.agents.sessions import Session, SessionLimits
from leangrpo.config.agent import AgentConfig
from leangrpo.contracts import Prompt, SamplingParams, TurnEngine
from leangrpo.environments.rendering import Renderer
from leangrpo.environments.setup import check_renderer
from leangrpo.environments.tools import parse_hermes

log = logging.getLogger("leangrpo.agents")
HOST = "127.0.0.1"
START_TIMEOUT_S = 30.0
SWITCH_INTERVAL_S = 0.0005  # while generating (see `generating`)
BODY_BYTES_PER_TOKEN = 16  # a request body may hold this many bytes per token of context,
MIN_BODY_BYTES = 1 << 20  # and at least this many


def max_body_bytes(max_total_tokens: int) -> int:
    """The largest request body the endpoint reads (see the module docstring)."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * int(max_total_tokens))


class AgentEndpoint:
    """See the module docstring."""

    def __init__(self, tokenizer: Any, config: AgentConfig, template: str | None, eos_ids: set[int],
                 open_keys: int = 0):  # fmt: skip
        self.tokenizer, self.config = tokenizer, config
        # serve-agent: any key opens a session of its own (at most this many kept, the
        # least recently used ended first); 0: only the trainer's sessions are answered
        self.open_keys = open_keys
        self._generation = threading.Lock()  # one generation call at a time
        self.template, self.eos_ids = template, set(eos_ids)
        self.limits = SessionLimits(config.max_total_tokens, config.max_requests, config.max_episode_tokens)
        self._renderers: dict[str, Renderer] = {}
        check_renderer(self.renderer(None), ["tool", "user"], self.eos_ids)
        self.sessions: dict[str, Session] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._stream_keys = itertools.count()
        self._answers = itertools.count()
        self.stats: Counter[str] = Counter()
        self._pump: TurnPump | None = None
        self._params: SamplingParams | None = None
        self._server = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None
        self.base_url: str | None = None  # http://127.0.0.1:PORT/v1 once started
        self.unix_socket: str | None = None  # its path, when serving on one

    # -- life -------------------------------------------------------------------------------
    def start(self, port: int = 0, unix_socket: str | None = None) -> str:
        """Serve on 127.0.0.1 (`port` 0: a free one) and, when given, on the unix socket
        `unix_socket` (what agent boxes reach, forwarded); returns the base URL (`.../v1`)."""
        import uvicorn

        sockets = [socket.create_server((HOST, port))]
        if unix_socket is not None:
            sockets.append(socket.socket(socket.AF_UNIX))
            sockets[-1].bind(unix_socket)
            os.chmod(unix_socket, 0o600)
            self.unix_socket = unix_socket
        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off", access_log=False,
                                timeout_graceful_shutdown=1)  # fmt: skip
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": sockets},
                                        name="leangrpo-agent-endpoint", daemon=True)  # fmt: skip
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent endpoint did not start on {HOST}:{port}")
            time.sleep(0.01)
        self.port = sockets[0].getsockname()[1]
        self.base_url = f"http://{HOST}:{self.port}/v1"
        return self.base_url

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None

    @contextlib.contextmanager
    def generating(self, engine: TurnEngine, params: SamplingParams, version: int) -> Iterator[AgentEndpoint]:
        """Answer requests with `engine`'s turns at `params` and policy `version`."""
        with self._generation, engine.open_turns(params, version) as stream:
            self._params, self._version = params, version
            self._pump = TurnPump(stream)
            # the pump's decode loop holds the GIL between kernels: a shorter switch interval
            # lets the server thread answer within a fraction of a millisecond, not 5 ms a hop
            interval = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_INTERVAL_S)
            try:
                yield self
            finally:
                sys.setswitchinterval(interval)
                pump, self._pump = self._pump, None
                pump.close()

    # -- sessions ---------------------------------------------------------------------------
    def open_session(self, prompt: Prompt | None = None, seed: int | None = None, index: int = 0) -> Session:
        """A new episode's session; turn k is seeded derive_seed(seed, version, index, k)."""
        if self._pump is None:
            raise RuntimeError("sessions are opened inside AgentEndpoint.generating(...)")
        key = "lg-" + secrets.token_urlsafe(24)
        seed = seed if seed is not None else secrets.randbits(62)
        session = Session(key, prompt, seed, self._version, index, self.limits, lambda: next(self._stream_keys))
        self.sessions[key] = session
        return session

    def _open_for(self, key: str) -> Session:
        """serve-agent: a session for a key not seen before (the oldest ended past
        `open_keys`), seeded at random."""
        while len(self.sessions) >= self.open_keys:
            self.end_session(next(iter(self.sessions)))
        session = self.open_session()
        self.sessions[key] = self.sessions.pop(session.key)
        session.key = key
        return session

    def end_session(self, key: str) -> Session:
        """Close a session: later requests are refused; its counts join the endpoint's."""
        session = self.sessions.pop(key)
        self._locks.pop(key, None)
        session.closed = True
        self.stats.update(session.stats)
        if self._pump is not None:
            for segment in session.segments:
                self._pump.release(segment.key)
        return session

    def url(self, session: Session) -> str:
        """The session's base URL (its key in the path)."""
        return f"http://{HOST}:{self.port}/s/{session.key}/v1"

    def metrics(self) -> dict[str, float]:
        """Counts since the last call (sessions still open counted when they end)."""
        stats, self.stats = self.stats, Counter()
        answered = stats.pop("answered", 0)
        latency = stats.pop("latency_s", 0.0)
        out = {f"agent/{k}": float(v) for k, v in stats.items()}
        for key in ("requests", "refused", "foreign_keys", "errors", "prefix_breaks", "abandoned"):
            out.setdefault(f"agent/{key}", 0.0)
        out["agent/latency_s"] = latency / answered if answered else 0.0
        return out

    def renderer(self, tools: Any) -> Renderer:
        key = tools_key(tools)
        if key not in self._renderers:
            self._renderers[key] = Renderer(self.tokenizer, tools, self.template)
        return self._renderers[key]

    # -- HTTP -------------------------------------------------------------------------------
    def app(self):
        from starlette.applications import Starlette
        from starlette.routing import Route

        routes = []
        for prefix in ("/v1", "/s/{key}/v1"):
            routes += [
                Route(prefix + "/models", self._models, methods=["GET"]),
                Route(prefix + "/chat/completions", self._chat, methods=["POST"]),
                Route(prefix + "/completions", self._completions, methods=["POST"]),
            ]
        return Starlette(routes=routes)

    async def _models(self, request):
        from starlette.responses import JSONResponse

        model = {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "leangrpo"}
        return JSONResponse({"object": "list", "data": [model]})

    async def _chat(self, request):
        return await self._serve(request, chat=True)

    async def _completions(self, request):
        return await self._serve(request, chat=False)

    async def _serve(self, request, chat: bool):
        from starlette.responses import JSONResponse, StreamingResponse

        start = time.perf_counter()
        try:
            session = self._session(request)
            body = await _json_body(request, max_body_bytes(self.config.max_total_tokens))
            lock = self._locks.setdefault(session.key, asyncio.Lock())
            async with lock:
                session.stats["requests"] += 1
                answer = await (self._chat_turn if chat else self._text_turn)(session, body, request)
        except Refused as e:
            self.stats["refused" if e.status < 500 else "errors"] += 1
            if e.code == "invalid_api_key":
                self.stats["foreign_keys"] += 1
            return JSONResponse(e.body(), status_code=e.status)
        self.stats["answered"] += 1
        self.stats["latency_s"] += time.perf_counter() - start
        if not body.get("stream"):
            return JSONResponse(chat_response(answer) if chat else completion_response(answer))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunks = chat_chunks(answer, include_usage) if chat else [completion_response(answer)]
        return StreamingResponse(_sse(chunks), media_type="text/event-stream")

    def _session(self, request) -> Session:
        key = request.path_params.get("key")
        if key is None:
            auth = request.headers.get("authorization", "")
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        session = self.sessions.get(key) if key else None
        if session is None and key and self.open_keys and self._pump is not None:
            session = self._open_for(key)
        elif session is not None and self.open_keys:
            self.sessions[key] = self.sessions.pop(key)  # the most recently used last
        if session is None:
            raise Refused("no session has this key: use the base URL and API key the trainer gave this episode",
                          code="invalid_api_key", status=401)  # fmt: skip
        return session

    async def _chat_turn(self, session: Session, body: dict, request=None) -> Answer:
        limits = sampling_limits(body, self._params)
        check_tool_choice(body)
        messages = template_messages(body.get("messages"))
        tools = body.get("tools") or None
        plan = await _off_loop(session.plan_chat, messages, tools, self.renderer(tools), limits)
        completion = await self._generate(plan)
        segment, text, finish = await self._commit(session, plan, completion, request)
        parsed = parse_hermes(text)
        message = assistant_message(parsed, session.turns - 1)
        session.record_view(segment, plan, message)
        if finish == "stop" and message.get("tool_calls"):
            finish = "tool_calls"
        return self._answer(plan, segment, message, finish, body)

    async def _text_turn(self, session: Session, body: dict, request=None) -> Answer:
        limits = sampling_limits(body, self._params)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # one prompt in a list
        if not (isinstance(prompt, str) and prompt) and not (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            raise Refused("prompt must be one non-empty string or one list of token ids", "prompt")
        if isinstance(prompt, list) and (max(prompt) >= len(self.tokenizer) or min(prompt) < 0):
            raise Refused(f"prompt holds token ids outside the vocabulary (0..{len(self.tokenizer) - 1})", "prompt")
        plan = await _off_loop(session.plan_tokens, prompt, self.renderer(None), limits)
        completion = await self._generate(plan)
        segment, text, finish = await self._commit(session, plan, completion, request)
        return self._answer(plan, segment, {"text": text}, finish, body)

    async def _commit(self, session: Session, plan, completion, request=None):
        """Record the turn unless its session ended meanwhile (refused 404, what the stream
        kept for a new segment released) or its client is gone (never trained: refused,
        counted in agent/abandoned)."""
        if request is not None and await request.is_disconnected():
            self.stats["abandoned"] += 1
            self._release_unrecorded(session, plan)
            raise Refused("the client disconnected before its turn was answered; the turn is not recorded",
                          code="client_disconnected", status=499)  # fmt: skip
        try:
            return await _off_loop(session.commit, plan, completion, self.eos_ids)
        except Refused:
            self._release_unrecorded(session, plan)
            raise

    def _release_unrecorded(self, session: Session, plan) -> None:
        if (plan.segment is None or session.closed) and self._pump is not None:
            self._pump.release(plan.request.key)

    async def _generate(self, plan):
        pump = self._pump
        if pump is None:
            raise Refused("the trainer is not generating now", code="not_generating", status=503)
        try:
            return await asyncio.wrap_future(pump.submit(plan.request))
        except Exception as e:  # noqa: BLE001  the engine failed this turn
            log.warning("a turn failed in the engine: %s", e)
            raise Refused(f"generation failed: {type(e).__name__}: {e}", status=500) from None

    def _answer(self, plan, segment, message: dict, finish: str, body: dict) -> Answer:
        n = segment.conversation.segments[-1][0]
        ids = segment.conversation.ids[-n:]
        logprobs = segment.logprobs[-n:]
        pieces = [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
        return Answer(
            id=f"chatcmpl-{next(self._answers)}",
            model=str(body.get("model") or self.config.model_name),
            message=message,
            finish_reason=finish,
            prompt_ids=list(plan.request.ids),
            ids=list(ids),
            logprobs=list(logprobs),
            pieces=pieces,
            return_prompt_ids=bool(body.get("return_token_ids")),
            with_logprobs=plan.limits.logprobs,
        )


async def _off_loop(fn, *args):
    """fn(*args) in a worker thread: the event loop serves the other sessions meanwhile."""
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn, *args)


async def _json_body(request, limit: int) -> dict:
    """The request's JSON object, read only while it stays within `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise Refused("the request body is not JSON") from None
    except RecursionError:
        raise Refused("the request body nests JSON too deeply: send an OpenAI request object") from None
    if not isinstance(body, dict):
        raise Refused("the request body must be a JSON object")
    return body


def _too_large(size: int, limit: int) -> Refused:
    return Refused(f"the request body passes {limit} bytes ({size} so far; 16 bytes per token of agent.max_total_tokens, "
                   "at least 1 MiB): send a shorter conversation", code="request_too_large", status=413)  # fmt: skip


async def _sse(chunks: list[dict]):
    for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n".encode()
    yield b"data: [DONE]\n\n"
