"""The HTTP side of `leangrpo serve`: request handling, routes, weight staging, adapter uploads.

The command itself, its checks and the engine start are in `server.py`; the client,
`ServerPool`, is in `client.py`. The server is a small stdlib HTTP server (threads) in
front of one `LocalVLLM`, so it has exactly the colocated engine's semantics: (run id,
version) checked on admission, versions monotonic within a run and a new run's weights
always loaded, weight updates drain the requests in flight, adapters served under names and
ids never reused. Our own server rather than vLLM's OpenAI one: it returns token ids and
processed log-probs directly, and weight sync needs no dev-mode endpoints. Wire format (JSON
unless noted):

    GET  /health                          -> {"run", "version", "model", "in_flight", "max_body_bytes",
                                              "lora_modules", "routed_experts"}
    POST /generate {prompts, params, n, run, version, seeds} -> {"completions": [[Completion...]]}
    POST /score {sequences, starts, temperature}  -> {"logprobs": [[float...]]}: a served
                                          distillation teacher's log-probs of given ids
                                          (vLLM's prompt log-probs, positions start.. of each
                                          sequence; temperature must be 1: vLLM applies none)
    GET  /teacher                         -> {"model", "tokens", "vocab_size", "specials",
                                              "chat_template", "max_model_len"}: what a
                                          trainer checks a served teacher by (distill/check.py)
    PUT  /weights/{run}/{version}/{index} body: one safetensors bucket (binary, streamed to disk)
    POST /weights/{run}/{version}/commit  {num_buckets}
    PUT  /adapter/{run}/{version}         body: uncompressed tar of adapter_config.json + *.safetensors
    POST /sleep {level}, POST /wake_up

Security (the weights decide what the trainer learns from, so writes must be trusted):
- a shared-secret token (`$LEANGRPO_SERVE_TOKEN` or `--token-file`), required on every
  request when set (`Authorization: Bearer`, compared in constant time) and required to
  start at all when binding beyond loopback;
- bodies need a Content-Length within `--max-body-mb` (JSON bodies within 64 MiB):
  missing -> 411, malformed or negative -> 400, too large -> 413, before reading a byte;
- staging is emptied at start; staged buckets are deleted once a newer commit supersedes
  them or after `--staging-timeout-s` without activity;
- adapter archives may hold only regular files named `adapter_config.json` or
  `*.safetensors` (no paths, links or pickles).

Version or run mismatch -> 409 (EngineVersionError on the client), as is /score on a
server a run has pushed its weights to (it no longer holds the teacher); bad input -> 4xx.
"""

from __future__ import annotations

import argparse
import hmac
import io
import json
import logging
import os
import re
import shutil
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, BinaryIO

from leangrpo.contracts import Completion, EngineVersionError, SamplingParams
from leangrpo.distill.check import tokenizer_report
from leangrpo.model.files import check_model_files
from leangrpo.model.moe.routes import routes_to_wire

log = logging.getLogger("leangrpo.rollout.vllm.server")  # the name `leangrpo serve` logs under

DEFAULT_MAX_BODY_MB = 8192  # a weight bucket is ~1 GiB plus at most one tensor
MAX_JSON_BYTES = 64 << 20
STAGING_TIMEOUT_S = 3600.0
RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
NUMBER = re.compile(r"[0-9]{1,12}")
ADAPTER_FILE = re.compile(r"adapter_config\.json|[A-Za-z0-9_-][A-Za-z0-9_.-]*\.safetensors")
STAGED = re.compile(r"weights-([A-Za-z0-9_-]+)-v([0-9]+)")
MAX_BUCKETS = 100_000


@dataclass
class ServerState:
    """What every request handler shares."""

    local: Any  # a LocalVLLM (or a test double with the same methods)
    staging: Path
    model: str
    token: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_MB << 20
    staging_timeout_s: float = STAGING_TIMEOUT_S
    teacher: dict | None = None  # the GET /teacher reply, read once


class Refused(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class Body:
    """A request body of a checked length, read at most once."""

    def __init__(self, stream: BinaryIO, length: int):
        self.stream, self.remaining = stream, length

    def read(self) -> bytes:
        data = self.stream.read(self.remaining)
        if len(data) < self.remaining:
            raise ValueError(f"the body ended after {len(data)} of {self.remaining} bytes")
        self.remaining = 0
        return data

    def json(self) -> dict:
        payload = json.loads(self.read() or b"{}")
        if not isinstance(payload, dict):
            raise ValueError("the body must be a JSON object")
        return payload

    def save(self, path: Path) -> int:
        size = self.remaining
        with path.open("wb") as out:
            while self.remaining:
                chunk = self.stream.read(min(self.remaining, 1 << 20))
                if not chunk:
                    raise ValueError(f"the body ended {self.remaining} bytes early")
                out.write(chunk)
                self.remaining -= len(chunk)
        return size


def make_handler(
    local: Any,
    staging: Path,
    model: str,
    *,
    token: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_MB << 20,
    staging_timeout_s: float = STAGING_TIMEOUT_S,
) -> type[BaseHTTPRequestHandler]:
    """An HTTP handler class bound to one `LocalVLLM` and a staging directory."""
    state = ServerState(local, staging, model, token, max_body_bytes, staging_timeout_s)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 300  # seconds a silent connection may hold a thread

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s " + fmt, self.address_string(), *args)

        def _reply(self, code: int, payload: dict, close: bool = False) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if close:  # an unread body would be taken for the next request
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def _handle(self, method: str) -> None:
            body = None
            try:
                _authorize(self.headers.get("Authorization"), state.token)
                body = _open_body(self.headers, self.rfile, method, state.max_body_bytes)
                code, payload = 200, _route(method, self.path, body, state)
            except Refused as err:
                code, payload = err.code, {"error": str(err)}
            except EngineVersionError as err:
                code, payload = 409, {"error": str(err)}
            except (ValueError, TypeError, KeyError, FileNotFoundError, tarfile.TarError) as err:
                code, payload = 400, {"error": f"{type(err).__name__}: {err}"}
            except Exception as err:  # the server must outlive one bad request
                log.exception("request %s failed", self.path)
                code, payload = 500, {"error": f"{type(err).__name__}: {err}"}
            self._reply(code, payload, close=body is None or body.remaining > 0)

        def do_GET(self) -> None:
            self._handle("GET")

        def do_POST(self) -> None:
            self._handle("POST")

        def do_PUT(self) -> None:
            self._handle("PUT")

    return Handler


def _authorize(header: str | None, token: str | None) -> None:
    if token is None:
        return
    scheme, _, given = (header or "").partition(" ")
    if scheme != "Bearer" or not hmac.compare_digest(given.encode(), token.encode()):
        raise Refused(401, "missing or wrong token (Authorization: Bearer <token>)")


def _open_body(headers: Any, stream: BinaryIO, method: str, max_body_bytes: int) -> Body:
    """The body, once its declared length is known to be acceptable (nothing read yet)."""
    if method == "GET":
        return Body(stream, 0)
    if headers.get("Transfer-Encoding"):
        raise Refused(411, "chunked bodies are not accepted; send a Content-Length")
    lengths = headers.get_all("Content-Length") or []
    if not lengths:
        raise Refused(411, "a Content-Length is required")
    if len(lengths) > 1 or not NUMBER.fullmatch(lengths[0].strip()):
        raise Refused(400, f"malformed Content-Length {lengths}")
    length = int(lengths[0])
    limit = max_body_bytes if method == "PUT" else min(MAX_JSON_BYTES, max_body_bytes)
    if length > limit:
        raise Refused(
            413, f"a body of {length} bytes exceeds this server's limit of {limit} (--max-body-mb)"
        )
    return Body(stream, length)


def _route(method: str, path: str, body: Body, st: ServerState) -> dict:
    """The server's routes: the JSON reply, or an error (Refused 404 for no route)."""
    match (method, path.split("?")[0].strip("/").split("/")):
        case ("GET", ["health"]):
            run, version = st.local.held
            return {
                "run": run,
                "version": version,
                "model": st.model,
                "in_flight": st.local.gate.in_flight,
                "max_body_bytes": st.max_body_bytes,
                "lora_modules": st.local.lora_modules(),
                "routed_experts": st.local.routes,
            }
        case ("POST", ["generate"]):
            return _generate(st.local, body.json())
        case ("POST", ["score"]):
            return _score(st.local, body.json())
        case ("GET", ["teacher"]):
            return _teacher(st)
        case ("PUT", ["weights", run, version, index]):
            return _stage_bucket(st, _run(run), _number(version), _number(index), body)
        case ("POST", ["weights", run, version, "commit"]):
            return _commit(st, _run(run), _number(version), body.json()["num_buckets"])
        case ("PUT", ["adapter", run, version]):
            return _load_adapter_tar(st, _run(run), _number(version), body.read())
        case ("POST", ["sleep"]):
            level = body.json().get("level", 1)
            if level not in (1, 2):
                raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
            st.local.sleep(level)
            return {}
        case ("POST", ["wake_up"]):
            st.local.wake_up()
            return {}
    raise Refused(404, f"no route {method} {path}")


def _run(text: Any) -> str:
    if not isinstance(text, str) or not RUN_ID.fullmatch(text):
        raise ValueError(f"a run id is 1-64 characters of [A-Za-z0-9_-], got {text!r}")
    return text


def _number(text: Any) -> int:
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return text
    if not isinstance(text, str) or not NUMBER.fullmatch(text):
        raise ValueError(f"expected a non-negative integer, got {text!r}")
    return int(text)


def _generate(local: Any, payload: dict) -> dict:
    params = SamplingParams(
        **(payload["params"] | {"stop": tuple(payload["params"].get("stop", ()))})
    )
    prompts, seeds = payload["prompts"], payload.get("seeds")
    if not isinstance(prompts, list) or not all(
        isinstance(p, list) and all(type(t) is int for t in p) for p in prompts
    ):
        raise ValueError("prompts must be lists of token ids")
    if seeds is not None and (len(seeds) != len(prompts) or any(type(s) is not int for s in seeds)):
        raise ValueError("seeds must be one integer per prompt")
    run, version, n = _run(payload["run"]), _number(payload["version"]), _number(payload["n"])
    groups = local.generate(prompts, params, n, version, seeds, run=run)
    return {"completions": [[completion_json(c) for c in group] for group in groups]}


def _score(local: Any, payload: dict) -> dict:
    sequences, starts = payload["sequences"], payload["starts"]
    if not isinstance(sequences, list) or not all(
        isinstance(q, list) and all(type(t) is int and t >= 0 for t in q) for q in sequences
    ):
        raise ValueError("sequences must be lists of token ids")
    if not isinstance(starts, list) or len(starts) != len(sequences):
        raise ValueError("starts must hold one position per sequence")
    starts = [_number(start) for start in starts]
    temperature = payload.get("temperature", 1.0)
    if temperature != 1.0:
        raise ValueError(
            f"temperature {temperature!r}: vLLM's prompt log-probs are of the unscaled "
            "distribution, so this server scores at temperature 1 only"
        )
    return {"logprobs": local.score(sequences, starts)}


def _teacher(st: ServerState) -> dict:
    """The served model's tokenizer report (distill/check.py `tokenizer_report`) and the
    longest sequence the engine takes; read from its directory once."""
    if st.teacher is None:
        settings = argparse.Namespace(name_or_path=st.model, revision=None)
        directory = check_model_files(settings).directory
        if directory is None:
            raise FileNotFoundError(f"{st.model} has no local directory to read its tokenizer from")
        st.teacher = {"model": st.model, **tokenizer_report(directory)}
    return st.teacher | {"max_model_len": st.local.max_model_len}


def completion_json(c: Completion) -> dict:
    """A completion as JSON; a route record (routing replay) as shape, dtype and bytes."""
    out = asdict(replace(c, routes=None))
    if c.routes is not None:
        out["routes"] = routes_to_wire(c.routes)
    return out


# --------------------------------------------------------------------------- staging


def _staged_dir(staging: Path, run: str, version: int) -> Path:
    return staging / f"weights-{run}-v{version}"


def _stage_bucket(st: ServerState, run: str, version: int, index: int, body: Body) -> dict:
    if index >= MAX_BUCKETS:
        raise ValueError(f"bucket index {index} >= {MAX_BUCKETS}")
    st.local.gate.check_update(version, run)  # refuses a version older than the one held
    sweep_staging(st.staging, st.staging_timeout_s)
    directory = _staged_dir(st.staging, run, version)
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".part")
    os.close(fd)
    try:
        size = body.save(Path(tmp))
        os.replace(tmp, directory / f"bucket-{index:05d}.safetensors")  # never half a bucket
    finally:
        Path(tmp).unlink(missing_ok=True)
    return {"bytes": size}


def _commit(st: ServerState, run: str, version: int, num_buckets: Any) -> dict:
    if st.local.held == (run, version):  # a retried commit
        return {"version": version}
    num_buckets = _number(num_buckets)
    if not 1 <= num_buckets <= MAX_BUCKETS:
        raise ValueError(f"num_buckets must be in [1, {MAX_BUCKETS}], got {num_buckets}")
    directory = _staged_dir(st.staging, run, version)
    paths = [directory / f"bucket-{i:05d}.safetensors" for i in range(num_buckets)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"commit of run {run} version {version} is missing buckets {missing}; upload them first"
        )
    st.local.load_weight_files(paths, version, run=run)
    drop_superseded(st.staging, run, version)
    return {"version": version}


def sweep_staging(staging: Path, timeout_s: float) -> None:
    """Delete staged uploads untouched for `timeout_s` (a client that never committed)."""
    cutoff = time.time() - timeout_s
    for entry in staging.iterdir():
        try:
            if entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry, ignore_errors=True)
        except FileNotFoundError:
            pass  # removed by another request meanwhile


def drop_superseded(staging: Path, run: str, version: int) -> None:
    """After (run, version) is loaded: every staged upload but this run's newer versions."""
    for entry in staging.iterdir():
        match = STAGED.fullmatch(entry.name)
        if match and not (match[1] == run and int(match[2]) > version):
            shutil.rmtree(entry, ignore_errors=True)


def prepare_staging(root: Path) -> Path:
    """An empty staging directory: uploads of an earlier process are never committed."""
    staging = root / "staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


# --------------------------------------------------------------------------- adapters


def _load_adapter_tar(st: ServerState, run: str, version: int, data: bytes) -> dict:
    st.local.gate.check_update(version, run)
    directory = Path(tempfile.mkdtemp(prefix="adapter-", dir=st.staging))
    try:
        extract_adapter(data, directory)
        st.local.load_adapter(directory, version, run=run)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    drop_superseded(st.staging, run, version)
    return {"version": version}


def extract_adapter(data: bytes, directory: Path) -> None:
    """Unpack an adapter archive: regular files named adapter_config.json or *.safetensors."""
    names: set[str] = set()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:  # uncompressed only
        for member in tar.getmembers():
            if not member.isreg():
                raise ValueError(
                    f"adapter archive entry {member.name!r} is not a regular file (links and "
                    "directories are refused)"
                )
            if not ADAPTER_FILE.fullmatch(member.name) or member.name in names:
                raise ValueError(
                    f"adapter archive entry {member.name!r} refused: an adapter upload holds "
                    "adapter_config.json and *.safetensors files once each, by plain name "
                    "(a pickled adapter_model.bin is never loaded: save with safe_serialization=True)"
                )
            names.add(member.name)
            (directory / member.name).write_bytes(tar.extractfile(member).read())
    if "adapter_config.json" not in names or len(names) < 2:
        raise ValueError(
            f"an adapter upload needs adapter_config.json and a .safetensors file, got {sorted(names)}"
        )
    if not isinstance(json.loads((directory / "adapter_config.json").read_text()), dict):
        raise ValueError("adapter_config.json must hold a JSON object")
