"""`leangrpo serve`: a vLLM rollout server, and `ServerPool`, the engine's client for it.

The server is a small stdlib HTTP server (threads) in front of one `LocalVLLM`, so it has
exactly the colocated engine's semantics: versions checked on admission, weight updates
drain the requests in flight, LoRA adapters published as `adapters/v{N}` and requested by
name. Our own server rather than vLLM's OpenAI one: it returns token ids and processed
log-probs directly, and weight sync needs no dev-mode endpoints. Wire format (JSON unless
noted):

    GET  /health                         -> {"version", "model", "in_flight"}
    POST /generate {prompts, params, n, version, seeds} -> {"completions": [[Completion...]]}
    PUT  /weights/{version}/{index}      body: one safetensors bucket (binary)
    POST /weights/{version}/commit {num_buckets}
    PUT  /adapter/{version}              body: tar of the peft adapter directory
    POST /sleep {level}, POST /wake_up

Version mismatch -> 409 (EngineVersionError on the client); bad input -> 400.
The client retries connection errors, timeouts and 5xx with exponential backoff, then
raises one error naming the URL and `rollout.vllm.urls`.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from leangrpo.contracts import Completion, EngineVersionError, SamplingParams

log = logging.getLogger(__name__)


class VLLMServerError(RuntimeError):
    """A rollout server could not be reached, or failed a request."""


# --------------------------------------------------------------------------- client


class ServerPool:
    """Client for one or more `leangrpo serve` processes; prompts spread round-robin."""

    def __init__(
        self,
        urls: list[str],
        timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        process: subprocess.Popen | None = None,
    ):
        if not urls:
            raise ValueError(
                "no vLLM server URLs; set rollout.vllm.urls or leave it empty to start one locally"
            )
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.process = process
        self._next = 0
        self._pool = ThreadPoolExecutor(
            max_workers=max(2, 2 * len(self.urls)), thread_name_prefix="vllm-client"
        )
        versions = {url: self.request(url, "GET", "/health")["version"] for url in self.urls}
        if len(set(versions.values())) != 1:
            raise VLLMServerError(
                f"vLLM servers hold different policy versions {versions}; restart them together"
            )
        self.version = next(iter(versions.values()))

    def request(
        self,
        url: str,
        method: str,
        path: str,
        body: bytes | None = None,
        content_type: str = "application/json",
    ) -> Any:
        """One HTTP call with retries; returns the decoded JSON reply."""
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            req = urllib.request.Request(
                url + path, data=body, method=method, headers={"Content-Type": content_type}
            )
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as reply:
                    return json.loads(reply.read())
            except urllib.error.HTTPError as err:
                message = _error_message(err)
                if err.code == 409:
                    raise EngineVersionError(f"{url}: {message}") from None
                if err.code < 500:
                    raise VLLMServerError(
                        f"{url}{path} refused the request ({err.code}): {message}"
                    ) from None
                last = VLLMServerError(f"{err.code}: {message}")
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
                last = err
        raise VLLMServerError(
            f"vLLM server {url} did not answer {method} {path} after {self.max_retries + 1} attempts "
            f"(last error: {last}); check that `leangrpo serve` runs there and that rollout.vllm.urls is right"
        )

    def _post_json(self, url: str, path: str, payload: dict) -> Any:
        return self.request(url, "POST", path, json.dumps(payload).encode())

    def _broadcast(self, fn: Any) -> list[Any]:
        return list(self._pool.map(fn, self.urls))

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        n: int,
        version: int,
        seeds: list[int] | None = None,
    ) -> list[list[Completion]]:
        shares: dict[int, list[int]] = {}  # server index -> prompt indices
        for i in range(len(prompt_ids)):
            shares.setdefault((self._next + i) % len(self.urls), []).append(i)
        self._next = (self._next + len(prompt_ids)) % len(self.urls)
        wire_params = asdict(params) | {"stop": list(params.stop)}

        def run(server: int) -> list[list[dict]]:
            payload = {
                "prompts": [prompt_ids[i] for i in shares[server]],
                "params": wire_params,
                "n": n,
                "version": version,
                "seeds": None if seeds is None else [seeds[i] for i in shares[server]],
            }
            return self._post_json(self.urls[server], "/generate", payload)["completions"]

        results: list[list[Completion]] = [[] for _ in prompt_ids]
        futures = {server: self._pool.submit(run, server) for server in shares}
        for server, future in futures.items():
            for i, group in zip(shares[server], future.result()):
                results[i] = [Completion(**c) for c in group]
        return results

    def load_weight_files(self, paths: list[Path], version: int) -> None:
        def push(url: str) -> None:
            for index, path in enumerate(paths):
                self.request(
                    url,
                    "PUT",
                    f"/weights/{version}/{index}",
                    path.read_bytes(),
                    "application/octet-stream",
                )
            self._post_json(url, f"/weights/{version}/commit", {"num_buckets": len(paths)})

        self._broadcast(push)
        self.version = version

    def load_adapter(self, source: Path, version: int) -> None:
        if not (source / "adapter_config.json").is_file():
            raise FileNotFoundError(
                f"no adapter_config.json in {source}; save it with peft's save_pretrained"
            )
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for item in sorted(source.iterdir()):
                if item.is_file():
                    tar.add(item, arcname=item.name)
        body = buffer.getvalue()
        self._broadcast(
            lambda url: self.request(url, "PUT", f"/adapter/{version}", body, "application/x-tar")
        )
        self.version = version

    def sleep(self, level: int = 1) -> None:
        self._broadcast(lambda url: self._post_json(url, "/sleep", {"level": level}))

    def wake_up(self) -> None:
        self._broadcast(lambda url: self._post_json(url, "/wake_up", {}))

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process = None


def _error_message(err: urllib.error.HTTPError) -> str:
    try:
        return json.loads(err.read()).get("error", err.reason)
    except Exception:
        return str(err.reason)


# --------------------------------------------------------------------------- server


def make_handler(local: Any, staging: Path, model: str) -> type[BaseHTTPRequestHandler]:
    """An HTTP handler class bound to one `LocalVLLM` and a staging directory."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s " + fmt, self.address_string(), *args)

        def _reply(self, code: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def _dispatch(self, route: Any) -> None:
            try:
                self._reply(200, route())
            except EngineVersionError as err:
                self._reply(409, {"error": str(err)})
            except (ValueError, TypeError, KeyError, FileNotFoundError) as err:
                self._reply(400, {"error": f"{type(err).__name__}: {err}"})
            except Exception as err:  # the server must outlive one bad request
                log.exception("request %s failed", self.path)
                self._reply(500, {"error": f"{type(err).__name__}: {err}"})

        def _handle(self, method: str) -> None:
            body = self._body() if method != "GET" else b""
            route = _route(method, self.path, body, local, staging, model)
            if route is None:
                self._reply(404, {"error": f"no route {method} {self.path}"})
            else:
                self._dispatch(route)

        def do_GET(self) -> None:
            self._handle("GET")

        def do_POST(self) -> None:
            self._handle("POST")

        def do_PUT(self) -> None:
            self._handle("PUT")

    return Handler


def _route(
    method: str, path: str, body: bytes, local: Any, staging: Path, model: str
) -> Callable[[], dict] | None:
    """The server's routes: a zero-argument call producing the JSON reply, or None (404)."""
    parts = path.strip("/").split("/")
    if method == "GET" and parts == ["health"]:
        return lambda: {"version": local.version, "model": model, "in_flight": local.gate.in_flight}
    if method == "POST" and parts == ["generate"]:
        return lambda: _generate(local, json.loads(body))
    if method == "POST" and len(parts) == 3 and parts[0] == "weights" and parts[2] == "commit":
        return lambda: _commit(local, staging, int(parts[1]), json.loads(body)["num_buckets"])
    if method == "POST" and parts == ["sleep"]:
        return lambda: local.sleep(json.loads(body).get("level", 1)) or {}
    if method == "POST" and parts == ["wake_up"]:
        return lambda: local.wake_up() or {}
    if method == "PUT" and len(parts) == 3 and parts[0] == "weights":
        return lambda: _stage_bucket(staging, int(parts[1]), int(parts[2]), body)
    if method == "PUT" and len(parts) == 2 and parts[0] == "adapter":
        return lambda: _load_adapter_tar(local, staging, int(parts[1]), body)
    return None


def _generate(local: Any, payload: dict) -> dict:
    params = SamplingParams(
        **(payload["params"] | {"stop": tuple(payload["params"].get("stop", ()))})
    )
    n, version = int(payload["n"]), int(payload["version"])
    groups = local.generate(payload["prompts"], params, n, version, payload.get("seeds"))
    return {"completions": [[asdict(c) for c in group] for group in groups]}


def _stage_bucket(staging: Path, version: int, index: int, body: bytes) -> dict:
    directory = staging / f"weights-v{version}"
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"bucket-{index:05d}.safetensors"
    tmp = final.with_suffix(".tmp")
    tmp.write_bytes(body)
    os.replace(tmp, final)  # a retried upload never leaves half a bucket behind
    return {"bytes": len(body)}


def _commit(local: Any, staging: Path, version: int, num_buckets: int) -> dict:
    if version == local.version:  # a retried commit
        return {"version": version}
    directory = staging / f"weights-v{version}"
    paths = [directory / f"bucket-{i:05d}.safetensors" for i in range(num_buckets)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"commit of version {version} is missing buckets {missing}; upload them first"
        )
    local.load_weight_files(paths, version)
    shutil.rmtree(directory, ignore_errors=True)
    return {"version": version}


def _load_adapter_tar(local: Any, staging: Path, version: int, body: bytes) -> dict:
    directory = Path(tempfile.mkdtemp(prefix=f"adapter-v{version}-", dir=staging))
    try:
        with tarfile.open(fileobj=io.BytesIO(body), mode="r") as tar:
            for member in tar.getmembers():
                if not member.isfile() or Path(member.name).name != member.name:
                    raise ValueError(
                        f"adapter archive entry {member.name!r} is not a plain file name"
                    )
                (directory / member.name).write_bytes(tar.extractfile(member).read())
        local.load_adapter(directory, version)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return {"version": version}


# --------------------------------------------------------------------------- `leangrpo serve`


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="leangrpo serve",
        description="Serve a model for leangrpo rollouts with vLLM. "
        "Extra `--name value` flags are passed to vllm.LLM as name=value.",
    )
    p.add_argument("model", help="model directory or hub name")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--enable-sleep-mode", action="store_true")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--work-dir",
        default=None,
        help="where adapters and staged weights go (default: a temp dir)",
    )
    p.add_argument("--engine-kwargs", default="{}", help="JSON object of extra vllm.LLM arguments")
    return p


def parse_extra_flags(extra: list[str]) -> dict[str, Any]:
    """`--max-num-seqs 64 --enable-prefix-caching` -> {"max_num_seqs": 64, "enable_prefix_caching": True}."""
    kwargs: dict[str, Any] = {}
    i = 0
    while i < len(extra):
        flag = extra[i]
        if not flag.startswith("--"):
            raise SystemExit(
                f"leangrpo serve: unexpected argument {flag!r}; vLLM options look like --name value"
            )
        name, _, inline = flag[2:].partition("=")
        name = name.replace("-", "_")
        if inline:
            value, i = inline, i + 1
        elif i + 1 < len(extra) and not extra[i + 1].startswith("--"):
            value, i = extra[i + 1], i + 2
        else:
            kwargs[name], i = True, i + 1
            continue
        try:
            kwargs[name] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[name] = value
    return kwargs


def serve_main(argv: list[str] | None = None) -> int:
    """Entry point of `leangrpo serve MODEL --port P [vllm args]`; blocks until SIGTERM/Ctrl-C."""
    from leangrpo.rollout.vllm import LocalVLLM, VLLMSettings, build_llm_kwargs

    args, extra = build_parser().parse_known_args(argv)
    engine_kwargs = json.loads(args.engine_kwargs) | parse_extra_flags(extra)
    settings = VLLMSettings(
        mode="server",
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_sleep_mode=args.enable_sleep_mode,
        enforce_eager=args.enforce_eager,
        engine_kwargs=engine_kwargs,
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    root = (
        Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="leangrpo-serve-"))
    )
    local = LocalVLLM(
        build_llm_kwargs(args.model, settings, args.enable_lora, args.max_lora_rank, args.seed),
        root,
    )
    staging = root / "staging"
    staging.mkdir(parents=True, exist_ok=True)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(local, staging, args.model))
    server.daemon_threads = True
    import signal

    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"leangrpo serve: ready on http://{args.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        local.close()
        if not args.work_dir:
            shutil.rmtree(root, ignore_errors=True)
    return 0


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
    startup_timeout_s: float = 600.0,
) -> tuple[subprocess.Popen, str]:
    """Start `leangrpo serve` on a free loopback port; returns (process, url) once healthy."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "leangrpo.rollout.vllm_server",
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
        ]
        if on
    ]
    process = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise VLLMServerError(
                f"local `leangrpo serve {model_path}` exited with code {process.returncode} "
                "before it was ready; see its log above"
            )
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return process, url
        except OSError:
            time.sleep(0.5)
    process.terminate()
    raise VLLMServerError(
        f"local `leangrpo serve {model_path}` was not ready after {startup_timeout_s:.0f} s"
    )


if __name__ == "__main__":
    sys.exit(serve_main())
