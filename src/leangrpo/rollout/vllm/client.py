"""`ServerPool`: the vLLM engine's client for one or more `leangrpo serve` processes.

Requests go where `router.Router` says: a single-turn call's prompt groups spread evenly,
a trajectory's turns to its sticky server (`turn`, used by turns.py's stream, many in
flight at once on the pool's threads). Every request carries the shared-secret token
(`Authorization: Bearer`, from `rollout.vllm.token_file` or `$LEANGRPO_SERVE_TOKEN`), and
every push and generation the run id of the engine that owns the pool (see
`versions.VersionGate` for the rules). The pool's `held` is what this client pushed:
(run id, version), or (None, NO_VERSION) before its first push, whatever an earlier run
left on the servers.

Failures: with one server, connection errors, timeouts and 5xx are retried with
exponential backoff, then raise one error naming the URL and `rollout.vllm.urls`. With
several, a generation request that fails so marks its server down and goes to another
server holding the version (counted, `router.retries`); only when none is left does the
call fail. Weight sync is two-phase (every server stages the buckets, then every server
commits): a server that fails either phase is marked down and skipped until the next
sync reaches it; the sync fails only when no server took it. 409 (another version or
run) becomes `EngineVersionError`, other 4xx one error with the server's reason: neither
is a server failure, except a 409 from a server this client committed the version to: it
lost those weights (restarted, or another run pushed to it), so it is marked for the next
sync (router.py `lost_weights`) and the request goes to a server that holds the version;
with none left, the `EngineVersionError` says what happened. A served teacher's pool
(`score`: servers that take no weights) brings a server marked down back by a health probe
before each call instead, checks every reply (`checked_scores`), and with none left waits
for one within `patience_s`.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from leangrpo.contracts import Completion, EngineVersionError, SamplingParams, TurnRequest
from leangrpo.rollout.vllm.files import adapter_files
from leangrpo.rollout.vllm.router import NoServerLeft, Router, Server
from leangrpo.rollout.vllm.versions import NO_VERSION

log = logging.getLogger(__name__)

TOKEN_ENV = "LEANGRPO_SERVE_TOKEN"
MIN_TOKEN_CHARS = 16
TURNS_IN_FLIGHT = 64  # per server: threads of a turn stream's requests
# a scoring request's tokens: its JSON body well within a server's 64 MiB, its reply's
# floats a few MB
SCORE_REQUEST_TOKENS = 1 << 18
PROBE_TIMEOUT_S = 10.0  # a health probe of a server marked down (at most the pool's timeout)
MAX_PAUSE_S = 30.0  # the longest back-off step while waiting for a teacher server
LOGPROB_ROUNDING = 1e-3  # how far above 0 a served log-prob may round


def one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


class VLLMServerError(RuntimeError):
    """A rollout server could not be reached, or failed a request."""


class ServerUnreachable(VLLMServerError):
    """Connection errors, timeouts or 5xx, after the retries: the server failed."""


def read_token(token_file: str | os.PathLike | None, what: str) -> str | None:
    """The token in `token_file` if given, else `$LEANGRPO_SERVE_TOKEN`, else None."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as err:
            raise ValueError(f"{what}={token_file} cannot be read: {err.strerror}") from None
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
    if token and len(token) < MIN_TOKEN_CHARS:
        source = f"{what}={token_file}" if token_file else f"${TOKEN_ENV}"
        raise ValueError(
            f"the token in {source} has {len(token)} characters; use at least "
            f"{MIN_TOKEN_CHARS} random ones, e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
        )
    return token or None


def client_token(token_file: str | None) -> str | None:
    return read_token(token_file, "rollout.vllm.token_file")


class ServerPool:
    """Client for one or more `leangrpo serve` processes; see the module docstring."""

    def __init__(
        self,
        urls: list[str],
        timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        process: subprocess.Popen | None = None,
        token: str | None = None,
        key: str = "rollout.vllm.urls",
        patience_s: float | None = None,
    ):
        if not urls:
            raise ValueError(
                "no vLLM server URLs; set rollout.vllm.urls or leave it empty to start one locally"
            )
        self.key = key  # the config key that lists the servers, for messages
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        # a teacher pool: how long a scoring call waits for a server while none is healthy
        self.patience_s = timeout_s if patience_s is None else patience_s
        self.process = process
        self.token = token
        self.held: tuple[str | None, int] = (None, NO_VERSION)
        self.router = Router(self.urls, key)
        self._refused_now: set[int] = set()  # a scoring call's servers not to wait for
        self._pool = ThreadPoolExecutor(
            max_workers=max(2, 2 * len(self.urls)), thread_name_prefix="vllm-client"
        )
        # a trajectory's turn is one request; many are in flight at once
        self.turn_threads = ThreadPoolExecutor(
            max_workers=TURNS_IN_FLIGHT * len(self.urls), thread_name_prefix="vllm-turn"
        )
        health = [self.request(url, "GET", "/health") for url in self.urls]
        self.max_body_bytes = min(h.get("max_body_bytes", 1 << 62) for h in health)
        served = [h.get("lora_modules") for h in health]
        # what every server serves LoRA on; None when one does not say
        self._lora_modules = (
            None if any(m is None for m in served) else sorted(set.intersection(*map(set, served)))
        )
        # routing replay: every server returns each token's routed experts
        self.without_routes = [
            u for u, h in zip(self.urls, health) if h.get("routed_experts") is not True
        ]

    def lora_modules(self) -> list[str] | None:
        """The module names every server serves LoRA on (their /health replies); None
        when a server does not say."""
        return self._lora_modules

    @property
    def version(self) -> int:
        return self.held[1]

    def request(
        self,
        url: str,
        method: str,
        path: str,
        body: bytes | Path | None = None,
        content_type: str = "application/json",
        retries: int | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """One HTTP call with retries (default `max_retries`), each attempt bounded by
        `timeout_s` (default the pool's); returns the decoded JSON reply. A Path body
        streams."""
        retries = self.max_retries if retries is None else retries
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        last: Exception | None = None
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            headers = {"Content-Type": content_type}
            if self.token:
                headers["Authorization"] = f"Bearer {self.token}"
            try:
                with _open_body(body) as (data, length):
                    if length is not None:
                        headers["Content-Length"] = str(length)
                    req = urllib.request.Request(url + path, data, headers, method=method)
                    with urllib.request.urlopen(req, timeout=timeout_s) as reply:
                        return json.loads(reply.read())
            except urllib.error.HTTPError as err:
                if err.code < 500:
                    raise _client_error(err, url, path) from None
                last = VLLMServerError(f"{err.code}: {_error_message(err)}")
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
                last = err
        raise ServerUnreachable(
            f"vLLM server {url} did not answer {method} {path} after {retries + 1} attempts "
            f"(last error: {last}); check that `leangrpo serve` runs there and that {self.key} is right"
        )

    def _post_json(self, url: str, path: str, payload: dict, retries: int | None = None) -> Any:
        return self.request(url, "POST", path, json.dumps(payload).encode(), retries=retries)

    def _broadcast(self, fn: Any) -> list[Any]:
        return list(self._pool.map(fn, self.urls))

    # -- generation -------------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        n: int,
        version: int,
        seeds: list[int] | None = None,
        *,
        run: str,
    ) -> list[list[Completion]]:
        """n completions per prompt; prompt groups spread evenly over the servers, a failed
        server's share re-sent to another."""
        servers = self.router.spread(len(prompt_ids), run, version)
        shares: dict[int, list[int]] = {}  # server index -> prompt indices
        for i, server in enumerate(servers):
            shares.setdefault(server.index, []).append(i)
        wire_params = asdict(params) | {"stop": list(params.stop)}

        def call(first: int) -> list[list[dict]]:
            indices = shares[first]
            payload = {
                "prompts": [prompt_ids[i] for i in indices],
                "params": wire_params,
                "n": n,
                "run": run,
                "version": version,
                "seeds": None if seeds is None else [seeds[i] for i in indices],
            }
            reply = self._with_failover(
                self.router.servers[first], None, run, version, len(indices), payload
            )
            return reply["completions"]

        results: list[list[Completion]] = [[] for _ in prompt_ids]
        futures = {first: self._pool.submit(call, first) for first in shares}
        for first, future in futures.items():
            for i, group in zip(shares[first], future.result()):
                results[i] = [completion_of(c) for c in group]
        return results

    def turn(
        self,
        request: TurnRequest,
        params: SamplingParams,
        version: int,
        *,
        run: str,
        route: Hashable | None = None,
    ) -> Completion:
        """One turn on the trajectory's server (sticky by `route`, default the request's key;
        re-routed if it fails)."""
        route = request.key if route is None else route
        server = self.router.for_turn(route, run, version)
        payload = {
            "prompts": [list(request.ids)],
            "params": asdict(params) | {"stop": list(params.stop)},
            "n": 1,
            "run": run,
            "version": version,
            "seeds": None if request.seed is None else [request.seed],
        }
        reply = self._with_failover(server, route, run, version, 1, payload)
        return completion_of(reply["completions"][0][0])

    def _with_failover(
        self,
        server: Server,
        key: Hashable | None,
        run: str,
        version: int,
        requests: int,
        payload: dict,
    ) -> dict:
        """POST /generate on `server` (counted in flight by the router); a server that
        fails, or lost the weights committed there, is marked down and the request goes to
        another one."""
        while True:
            alone = len(self.router.eligible(run, version)) <= 1
            committed = server.held == (run, version)  # as sent (a peer's 409 may reset it)
            try:
                reply = self._post_json(server.url, "/generate", payload, None if alone else 0)
            except EngineVersionError as err:
                if not committed:  # never known to hold it: the caller's version is wrong
                    self.router.done(server, requests)
                    raise
                server = self._lost_weights(server, err, key, run, version, requests)
                continue
            except ServerUnreachable as err:
                self.router.failed(server, one_line(err), requests)
                log.warning(
                    "vLLM server %s failed (%s); its requests go to another server",
                    server.url,
                    one_line(err),
                )
                try:
                    server = self.router.reroute(key, run, version, requests)
                except NoServerLeft as gone:
                    raise ServerUnreachable(str(gone)) from None
                continue
            except BaseException:
                self.router.done(server, requests)
                raise
            self.router.done(server, requests)
            return reply

    def _lost_weights(
        self,
        server: Server,
        err: EngineVersionError,
        key: Hashable | None,
        run: str,
        version: int,
        requests: int,
    ) -> Server:
        """A 409 from a server this client committed (run, version) to: it lost those
        weights. Marked for the next sync; another server holding the version, or one
        error saying what happened."""
        why = (
            f"it refused version {version} of run {run}, which this trainer pushed there "
            f"({one_line(err)}): it restarted, or another run pushed its weights to it, since"
        )
        self.router.lost_weights(server, f"{why} the last weight sync", requests)
        log.warning("vLLM server %s lost its weights (%s); marked for the next weight sync, "
                    "its requests go to another server", server.url, one_line(err))  # fmt: skip
        if not self.router.eligible(run, version):
            raise EngineVersionError(
                f"vLLM server {server.url} {why} the last weight sync; it gets the next one, "
                f"but no other server holds version {version}: "
                + "; ".join(f"{s.url} ({s.last_error or 'holds other weights'})" for s in self.router.servers)
            ) from None
        return self.router.reroute(key, run, version, requests)

    # -- a served distillation teacher (distill/served.py) -----------------------------------
    def score(
        self, sequences: list[list[int]], starts: list[int], temperature: float = 1.0
    ) -> list[list[float]]:
        """Each sequence's log-probs from its start on (POST /score, servers of a served
        teacher, which hold the model they loaded: no run, no version). The servers marked
        down are probed first (`revive`: back when GET /health answers and they hold no
        run's weights); the sequences spread evenly over the healthy ones, each server's
        share sent in requests of at most SCORE_REQUEST_TOKENS tokens. A server fails a
        request by not answering it (connection, timeout, 5xx), by refusing it (409: it no
        longer holds the teacher) or by a reply that is not log-probs of what was asked
        (`checked_scores`: a row per sequence of len(ids) - start finite values <= 0);
        it is marked down and its requests go to another. With none left, the share waits
        for one to come back (`patience_s`, probing the ones that did not answer; a server
        that refused or answered wrongly is probed again before the next call only), then
        raises one `ServerUnreachable` naming every server's error. `temperature`: 1 (a
        server refuses any other: vLLM's prompt log-probs are of the unscaled
        distribution)."""
        if not sequences:
            return []
        self.revive(self.router.servers)
        self._refused_now = set()  # this call's servers that refused or answered wrongly
        first_servers = self._teacher_servers(len(sequences), _Patience(self))
        shares: dict[int, list[int]] = {}  # server index -> sequence indices
        for i, server in enumerate(first_servers):
            shares.setdefault(server.index, []).append(i)

        def call(first: int) -> list[tuple[int, list[float]]]:
            out, server, patience = [], self.router.servers[first], _Patience(self)
            for chunk in _chunks(shares[first], [len(sequences[i]) for i in shares[first]]):
                payload = {
                    "sequences": [sequences[i] for i in chunk],
                    "starts": [starts[i] for i in chunk],
                    "temperature": temperature,
                }
                asked = [len(sequences[i]) - starts[i] for i in chunk]
                server, rows = self._score_with_failover(server, payload, asked, patience)
                out += zip(chunk, rows, strict=True)
            return out

        results: list[list[float]] = [[] for _ in sequences]
        for future in [self._pool.submit(call, first) for first in shares]:
            for i, row in future.result():
                results[i] = row
        return results

    def revive(self, servers: list[Server], at_once: bool = True) -> None:
        """Probe each of `servers` marked down (GET /health, once, within PROBE_TIMEOUT_S;
        `at_once` on the pool's threads, else one after the other): back in rotation when
        it answers and holds no run's weights (a teacher's server serves the model it
        loaded)."""
        down = [s for s in servers if not s.healthy]
        answers = self._pool.map(self._probe, down) if at_once else map(self._probe, down)
        for server, why in zip(down, answers):
            if why is None:
                self.router.back(server)
                log.warning("teacher server %s answers again; back in rotation", server.url)
            else:
                server.last_error = why

    def _probe(self, server: Server) -> str | None:
        """None when the server answers its health probe and holds no run's weights; else
        what is wrong."""
        try:
            health = self.request(server.url, "GET", "/health", retries=0,
                                  timeout_s=min(self.timeout_s, PROBE_TIMEOUT_S))  # fmt: skip
        except VLLMServerError as err:
            return one_line(err)
        if health.get("run") is not None:
            return (f"it holds run {health['run']}'s weights (a trainer pushed them there), not "
                    "the teacher it loaded; restart it")  # fmt: skip
        return None

    def _teacher_servers(self, groups: int, patience: _Patience) -> list[Server]:
        """`router.spread` over the healthy teacher servers, waiting for one while none is."""
        while True:
            try:
                return self.router.spread(groups, None, NO_VERSION)
            except NoServerLeft as gone:
                self._wait_for_a_server(gone, patience)

    def _score_with_failover(
        self, server: Server, payload: dict, asked: list[int], patience: _Patience
    ) -> tuple[Server, list[list[float]]]:
        """POST /score on `server` (its requests counted in flight there), else on the
        next healthy one; the server that answered, and its checked rows."""
        requests = len(asked)
        while True:
            try:
                if not server.healthy:  # it failed an earlier request of this share
                    raise ServerUnreachable(server.last_error)
                alone = len(self.router.eligible(None, NO_VERSION)) <= 1
                reply = self._post_json(server.url, "/score", payload, None if alone else 0)
                rows = checked_scores(reply, asked)
            except (ServerUnreachable, EngineVersionError, WrongScores) as err:
                if not isinstance(err, ServerUnreachable):
                    self._refused_now.add(server.index)
                why = one_line(err) if server.healthy else server.last_error
                if server.healthy:
                    log.warning("teacher server %s failed (%s); its sequences go to another "
                                "server", server.url, why)  # fmt: skip
                self.router.failed(server, why, requests)
                server = self._next_teacher_server(requests, patience)
                continue
            except BaseException:
                self.router.done(server, requests)
                raise
            self.router.done(server, requests)
            return server, rows

    def _next_teacher_server(self, requests: int, patience: _Patience) -> Server:
        """Another healthy server for `requests` of a failed one (counted as retries),
        waiting for one to come back while none is."""
        try:
            return self.router.reroute(None, None, NO_VERSION, requests)
        except NoServerLeft as gone:
            self._wait_for_a_server(gone, patience)
        while True:
            try:
                return self.router.for_turn(None, None, NO_VERSION, requests)
            except NoServerLeft as gone:
                self._wait_for_a_server(gone, patience)

    def _wait_for_a_server(self, gone: NoServerLeft, patience: _Patience) -> None:
        """Sleep a back-off step, then probe the servers that did not answer (not those
        that refused or answered wrongly in this call); raise `ServerUnreachable` when
        none of them may come back or `patience` has run out."""
        waiting = [s for s in self.router.servers if s.index not in self._refused_now]
        if not waiting or not patience.pause():
            raise ServerUnreachable(
                f"{gone}" + ("" if not waiting else f" (none answered within {patience.seconds:g} s)")
            ) from None
        self.revive(waiting, at_once=False)  # on a call's thread: not on the pool's again

    # -- weights ----------------------------------------------------------------------------
    def load_weight_files(self, paths: list[Path], version: int, *, run: str) -> None:
        """Two phases: every server stages the buckets, then every server commits; a server
        that fails is marked down (skipped until a later sync reaches it)."""
        too_big = [p for p in paths if p.stat().st_size > self.max_body_bytes]
        if too_big:
            raise ValueError(
                f"weight bucket {too_big[0]} has {too_big[0].stat().st_size} bytes, more than a "
                f"server accepts ({self.max_body_bytes}); raise `leangrpo serve --max-body-mb` "
                "(rollout.vllm.max_body_mb for a server the trainer starts)"
            )

        def stage(server: Server) -> None:
            for index, path in enumerate(paths):
                self.request(
                    server.url,
                    "PUT",
                    f"/weights/{run}/{version}/{index}",
                    path,
                    "application/octet-stream",
                    retries=self._sync_retries(server),
                )

        def commit(server: Server) -> None:
            body = {"num_buckets": len(paths)}
            path = f"/weights/{run}/{version}/commit"
            self._post_json(server.url, path, body, self._sync_retries(server))

        staged = self._on_every_server(stage, self.router.servers, "stage")
        committed = self._on_every_server(commit, staged, "commit")
        self._took_version(committed, run, version)

    def load_adapter(self, source: Path, version: int, *, run: str) -> None:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for item in adapter_files(source):  # config + safetensors: all a server accepts
                tar.add(item, arcname=item.name)
        body = buffer.getvalue()

        def load(server: Server) -> None:
            path, retries = f"/adapter/{run}/{version}", self._sync_retries(server)
            self.request(server.url, "PUT", path, body, "application/x-tar", retries=retries)

        self._took_version(self._on_every_server(load, self.router.servers, "load"), run, version)

    def _on_every_server(self, fn, servers: list[Server], phase: str) -> list[Server]:
        """`fn(server)` on every server at once; the ones it failed on are marked down (a
        refusal, 4xx or a version conflict, is raised as it is: a bug, not a failure)."""

        def attempt(server: Server) -> bool:
            try:
                fn(server)
            except ServerUnreachable as err:
                self.router.failed(server, f"weight sync ({phase}) failed: {one_line(err)}", 0)
                log.warning(
                    "vLLM server %s missed a weight sync (%s): marked down",
                    server.url,
                    one_line(err),
                )
                return False
            return True

        ok = list(self._pool.map(attempt, servers))
        return [server for server, good in zip(servers, ok) if good]

    def _sync_retries(self, server: Server) -> int | None:
        """A server marked down is probed once per sync (it may be back), not retried."""
        return None if server.healthy else 0

    def _took_version(self, servers: list[Server], run: str, version: int) -> None:
        if not servers:
            raise ServerUnreachable(
                f"no vLLM server took version {version} of the weights: "
                + "; ".join(f"{s.url} ({s.last_error})" for s in self.router.servers)
            )
        for server in servers:
            self.router.committed(server, (run, version))
        self.held = (run, version)

    def sleep(self, level: int = 1) -> None:
        self._broadcast(lambda url: self._post_json(url, "/sleep", {"level": level}))

    def wake_up(self) -> None:
        self._broadcast(lambda url: self._post_json(url, "/wake_up", {}))

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self.turn_threads.shutdown(wait=False)
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process = None


@contextmanager
def _open_body(body: bytes | Path | None) -> Iterator[tuple[Any, int | None]]:
    """(data, Content-Length) for urllib: bytes as they are, a Path as an open file."""
    if not isinstance(body, Path):
        yield body, None
        return
    with body.open("rb") as file:
        yield file, body.stat().st_size


def _chunks(indices: list[int], lengths: list[int]) -> Iterator[list[int]]:
    """`indices` in order, in runs of at most SCORE_REQUEST_TOKENS tokens (a longer
    sequence alone)."""
    chunk, tokens = [], 0
    for i, n in zip(indices, lengths):
        if chunk and tokens + n > SCORE_REQUEST_TOKENS:
            yield chunk
            chunk, tokens = [], 0
        chunk.append(i)
        tokens += n
    if chunk:
        yield chunk


class WrongScores(VLLMServerError):
    """A teacher server's /score reply is not log-probs of what was asked."""


def checked_scores(reply: Any, asked: list[int]) -> list[list[float]]:
    """The rows of a /score reply, each `asked[k]` finite log-probs (at most
    LOGPROB_ROUNDING above 0: a certain token rounds there); `WrongScores` saying what is
    wrong otherwise."""
    rows = reply.get("logprobs") if isinstance(reply, dict) else None
    if not isinstance(rows, list) or len(rows) != len(asked):
        got = f"{len(rows)} rows" if isinstance(rows, list) else "no 'logprobs' list"
        raise WrongScores(f"it returned {got} for {len(asked)} sequences")
    for k, (row, n) in enumerate(zip(rows, asked)):
        if not isinstance(row, list) or len(row) != n:
            got = f"{len(row)} log-probs" if isinstance(row, list) else "no list"
            raise WrongScores(f"it returned {got} for the {n} scored tokens of sequence {k} "
                              "of its request")  # fmt: skip
        wrong = None if _plausible(row) else next(
            ((j, v) for j, v in enumerate(row) if not _a_logprob(v)), None
        )
        if wrong is not None:
            raise WrongScores(f"it returned {wrong[1]!r} for token {wrong[0]} of sequence {k} "
                              "of its request, where a log-prob is a finite number <= 0")  # fmt: skip
    return rows


def _plausible(row: list) -> bool:
    """Every value a log-prob, checked at C speed (max and sum; `_a_logprob` finds the
    culprit when not)."""
    try:
        return not row or (max(row) <= LOGPROB_ROUNDING and math.isfinite(sum(row)))
    except TypeError:  # not numbers
        return False


def _a_logprob(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and value <= LOGPROB_ROUNDING


class _Patience:
    """How long a share of a scoring call waits for a teacher server to come back: the
    pool's `patience_s` from the first moment none was left (not restarted when one comes
    back and fails again), in back-off steps from `backoff_s` doubling to MAX_PAUSE_S."""

    def __init__(self, pool: ServerPool):
        self.seconds, self._step = pool.patience_s, pool.backoff_s
        self._deadline: float | None = None

    def pause(self) -> bool:
        """Sleep the next step (never past the deadline); False once the time is up."""
        now = time.monotonic()
        if self._deadline is None:
            self._deadline = now + self.seconds
        left = self._deadline - now
        if left <= 0:
            return False
        time.sleep(min(self._step, left))
        self._step = min(2 * self._step, MAX_PAUSE_S)
        return True


def _error_message(err: urllib.error.HTTPError) -> str:
    try:
        return json.loads(err.read()).get("error", err.reason)
    except Exception:
        return str(err.reason)


def _client_error(err: urllib.error.HTTPError, url: str, path: str) -> Exception:
    message = _error_message(err)
    if err.code == 409:
        return EngineVersionError(f"{url}: {message}")
    if err.code == 401:
        return VLLMServerError(
            f"{url} refused the token ({message}); set rollout.vllm.token_file or ${TOKEN_ENV} "
            "to the token the server was started with"
        )
    return VLLMServerError(f"{url}{path} refused the request ({err.code}): {message}")


# --------------------------------------------------------------------------- a local server


def completion_of(reply: dict) -> Completion:
    """A completion a server sent (its route record decoded and size-checked)."""
    from leangrpo.model.moe.routes import routes_from_wire  # torch: not for the checks

    routes = reply.get("routes")
    fields = {k: v for k, v in reply.items() if k != "routes"}
    return Completion(**fields, routes=None if routes is None else routes_from_wire(routes))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_server(
    model_path: str,
    settings: Any,
    *,
    enable_lora: bool = False,
    max_lora_rank: int = 16,
    seed: int = 0,
    token: str | None = None,
    startup_timeout_s: float = 600.0,
) -> tuple[subprocess.Popen, str]:
    """Start `leangrpo serve` on a free loopback port; returns (process, url) once healthy.
    `token` reaches the server through its environment (never the command line)."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "leangrpo.rollout.vllm.server",
        model_path,
        "--port",
        str(port),
        "--dtype",
        settings.dtype,
        "--kv-cache-dtype",
        settings.kv_cache_dtype,
        "--seed",
        str(seed),
        "--max-lora-rank",
        str(max_lora_rank),
        "--max-body-mb",
        str(settings.max_body_mb),
        "--engine-kwargs",
        json.dumps(settings.engine_kwargs),
    ]
    if settings.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(settings.gpu_memory_utilization)]
    if settings.max_model_len is not None:
        cmd += ["--max-model-len", str(settings.max_model_len)]
    cmd += [
        flag
        for flag, on in [
            ("--enforce-eager", settings.enforce_eager),
            ("--enable-lora", enable_lora),
            ("--enable-sleep-mode", settings.enable_sleep_mode),
            ("--routed-experts", settings.routed_experts),
        ]
        if on
    ]
    env = dict(os.environ)
    if token:
        env[TOKEN_ENV] = token
    process = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    _wait_until_ready(process, url, model_path, startup_timeout_s)
    return process, url


def _wait_until_ready(
    process: subprocess.Popen, url: str, model_path: str, startup_timeout_s: float
) -> None:
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise VLLMServerError(
                f"local `leangrpo serve {model_path}` exited with code {process.returncode} "
                "before it was ready; see its log above"
            )
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return
        except urllib.error.HTTPError:
            return  # it answers (401 without the token): ready
        except OSError:
            time.sleep(0.5)
    process.terminate()
    raise VLLMServerError(
        f"local `leangrpo serve {model_path}` was not ready after {startup_timeout_s:.0f} s"
    )
