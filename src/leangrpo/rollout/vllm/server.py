"""`leangrpo serve`: a vLLM rollout server started from the command line.

`serve_main` parses the command line (extra `--name value` flags go to vllm.LLM), checks
everything cheap before the model loads (token required beyond loopback, --max-body-mb,
--engine-kwargs, the model directory, vLLM installed, the port free), then starts one
`LocalVLLM` holding no run's weights and serves it until SIGTERM or Ctrl-C. The HTTP
handler, its wire format and its security rules are in http.py; the client
(`ServerPool`, `start_local_server`) is in client.py. vLLM itself is imported only when
the engine starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import json
import logging
import shutil
import signal
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from leangrpo.errors import UserError
from leangrpo.model.files import check_model_files
from leangrpo.rollout.vllm.client import TOKEN_ENV, read_token
from leangrpo.rollout.vllm.http import (
    DEFAULT_MAX_BODY_MB,
    STAGING_TIMEOUT_S,
    make_handler,
    prepare_staging,
)
from leangrpo.rollout.vllm.local import LocalVLLM, build_llm_kwargs
from leangrpo.rollout.vllm.settings import INSTALL_HINT, VLLMSettings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="leangrpo serve",
        description="Serve a model for leangrpo rollouts with vLLM, or as a distillation "
        "teacher (distill.teacher_urls: it then scores the sampled tokens, POST /score). "
        "Extra `--name value` flags are passed to vllm.LLM as name=value. "
        f"The shared-secret token comes from ${TOKEN_ENV} or --token-file; it is required "
        "whenever --host is not a loopback address.",
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
    p.add_argument(
        "--routed-experts",
        action="store_true",
        help="return each token's routed experts (routing replay: mixtures of experts)",
    )
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--work-dir",
        default=None,
        help="where adapters and staged weights go (default: a temp dir)",
    )
    p.add_argument(
        "--token-file", default=None, help=f"file holding the token (default: ${TOKEN_ENV})"
    )
    p.add_argument(
        "--max-body-mb",
        type=int,
        default=DEFAULT_MAX_BODY_MB,
        help="largest upload (one weight bucket, one adapter) in MiB",
    )
    p.add_argument(
        "--staging-timeout-s",
        type=float,
        default=STAGING_TIMEOUT_S,
        help="delete uploads never committed after this many seconds without activity",
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


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "", "0.0.0.0"-like names or a host name: reachable from elsewhere


def check_serve_args(args: argparse.Namespace) -> str | None:
    """The token to require (None: none), or ValueError before anything expensive starts."""
    token = read_token(args.token_file, "--token-file")
    if token is None and not is_loopback(args.host):
        raise ValueError(
            f"--host {args.host} is reachable from other machines, and anyone who reaches the "
            f"server can replace the policy's weights: set ${TOKEN_ENV} (or --token-file) to a "
            "shared secret here and on the trainer"
        )
    if args.max_body_mb < 1:
        raise ValueError(f"--max-body-mb must be >= 1, got {args.max_body_mb}")
    return token


def check_serve_start(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """The engine kwargs, or ValueError, for what would otherwise fail as a traceback after
    (or inside) a long model load: bad --engine-kwargs, no vLLM, a broken model directory."""
    try:
        kwargs = json.loads(args.engine_kwargs)
    except json.JSONDecodeError as err:
        raise ValueError(f"--engine-kwargs is not valid JSON ({err})") from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"--engine-kwargs must be a JSON object, got {args.engine_kwargs!r}")
    try:
        check_model_files(argparse.Namespace(name_or_path=args.model, revision=None))
    except UserError as err:
        raise ValueError(str(err).replace("model.name_or_path = ", "model ", 1)) from None
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(f"vLLM is not installed in this environment: {INSTALL_HINT}")
    return kwargs | parse_extra_flags(extra)


def start_engine(args: argparse.Namespace, engine_kwargs: dict[str, Any], root: Path) -> Any:
    """The `LocalVLLM` the server fronts; it holds no run's weights until a trainer pushes them."""
    settings = VLLMSettings(
        mode="server",
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_sleep_mode=args.enable_sleep_mode,
        enforce_eager=args.enforce_eager,
        engine_kwargs=engine_kwargs,
        routed_experts=args.routed_experts,
    )
    return LocalVLLM(
        build_llm_kwargs(args.model, settings, args.enable_lora, args.max_lora_rank, args.seed),
        root,
    )


def serve_main(argv: list[str] | None = None) -> int:
    """Entry point of `leangrpo serve MODEL --port P [vllm args]`; blocks until SIGTERM/Ctrl-C."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    try:
        token = check_serve_args(args)
        engine_kwargs = check_serve_start(args, extra)
    except ValueError as err:
        parser.error(str(err))
    try:  # bound before the model loads: a port in use is one line, not a traceback later
        server = ThreadingHTTPServer((args.host, args.port), BaseHTTPRequestHandler)
    except OSError as err:
        parser.error(
            f"cannot listen on {args.host}:{args.port} ({err.strerror}); choose another --port"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    root = (
        Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="leangrpo-serve-"))
    )
    try:
        local = start_engine(args, engine_kwargs, root)
    except UserError as err:  # --routed-experts where this vLLM cannot return them
        server.server_close()
        parser.error(str(err))
    server.RequestHandlerClass = make_handler(
        local,
        prepare_staging(root),
        args.model,
        token=token,
        max_body_bytes=args.max_body_mb << 20,
        staging_timeout_s=args.staging_timeout_s,
    )
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    auth = "token required" if token else "no token (loopback only)"
    print(
        f"leangrpo serve: ready on http://{args.host}:{server.server_address[1]} ({auth})",
        flush=True,
    )
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


if __name__ == "__main__":
    sys.exit(serve_main())
