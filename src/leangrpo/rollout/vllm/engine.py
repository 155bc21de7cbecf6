"""vLLM rollout engine: colocated in the trainer's process, or one or more servers.

`VLLMEngine.colocated(model_path, cfg)` runs a `vllm.LLM` next to the trainer (sleep mode
frees its memory while the trainer trains, where the platform supports it);
`VLLMEngine.server(urls, cfg)` talks to `leangrpo serve` processes over HTTP, spreading
prompt groups evenly (router.py). Both implement `contracts.RolloutEngine`:

- Behaviour log-probs are vLLM's *processed* log-probs (`logprobs_mode=
  "processed_logprobs"`: after temperature, top-k/top-p and min-p), of each sampled token.
  Completion ids keep the EOS token when generation stopped on it; text drops specials.
- Weight sync goes through vLLM's supported hooks only: the trainer writes the full
  weights as safetensors buckets, and a worker extension (`worker.py`) feeds them to
  the model's own `load_weights` via `collective_rpc` (tensors never pass through vLLM's
  msgspec serialiser). In-flight requests drain first; the prefix cache is reset after.
- Colocated and sharing the policy's weights (`rollout.vllm.share_weights`): sharing.py's
  `SharedVLLMEngine` over a `SharedVLLM` backend, started before the policy; a full
  fine-tuning sync is then a prefix-cache reset, a LoRA sync hands the tensors over.
- LoRA sync: the adapter (config + safetensors only) is published atomically under a name
  and integer id unique per run and version (`local.AdapterSlots`), so requests
  admitted under the previous version finish on the adapter they started with, and a
  cached adapter is never served for other weights. Before training, `check_adapter`
  refuses an adapter on modules vLLM serves no LoRA on (embed_tokens, lm_head on most
  models), naming them: every engine says what it serves (`lora_modules`; a server in
  its /health reply).
- A quantized base (`model.quantization: nf4`, QLoRA) is passed as
  `quantization="bitsandbytes"`: vLLM quantizes the checkpoint in flight with the same
  recipe as the trainer (nf4, blocks of 64, double quantization) and serves the adapter on
  it. Preflight refuses it where vLLM cannot (CPU builds, vLLM without bitsandbytes, fp4
  and int8, which vLLM has no in-flight path for); servers not started by the trainer
  must be started with `leangrpo serve MODEL --quantization bitsandbytes`.
- Versions identify the run: the engine draws a run id (uuid) at construction and sends
  (run id, version) with every push and generation; `version` is `NO_VERSION` (-1) until
  this run has pushed weights to a server, `generate` refuses a version the engine does
  not hold, and a completion tagged with any other version is an error (never a sample
  with negative staleness).
- Seeds: `params.seed` is the batch's seed; prompt i is seeded `seeding.prompt_seed`, a
  hash with 16 low bits free for vLLM's per-sample `seed + k`, so no two samples of a run
  share a seed. A multi-turn turn is one request with its own seed.
- Multi-turn (`open_turns`, turns.py): colocated, each turn enters the in-process
  engine as it comes and is stepped there with the others (prefix caching on); servers,
  each turn is a request to its trajectory's server (router.py: sticky, least-loaded,
  re-routed when a server fails), many in flight.

vLLM is imported lazily, so this module imports without it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from leangrpo.contracts import Completion, EngineVersionError, Prompt, SamplingParams, TurnRequest
from leangrpo.errors import RunError
from leangrpo.rollout.vllm.client import ServerPool, client_token, start_local_server
from leangrpo.rollout.vllm.files import (
    DEFAULT_BUCKET_BYTES,
    is_lora_name,
    unservable_message,
    unservable_modules,
    write_adapter,
    write_weight_buckets,
)
from leangrpo.rollout.vllm.local import LocalVLLM, build_llm_kwargs
from leangrpo.rollout.vllm.settings import VLLMSettings
from leangrpo.rollout.vllm.turns import LocalTurnStream, ServerTurnStream
from leangrpo.rollout.vllm.versions import NO_VERSION
from leangrpo.seeding import prompt_seed

if TYPE_CHECKING:
    from torch import Tensor

log = logging.getLogger(__name__)
STREAM_WAIT_S = 0.05  # generate_turns: how long one advance waits for server replies


# --------------------------------------------------------------------------- the engine


class VLLMEngine:
    """`RolloutEngine` over an in-process `LocalVLLM` or a `ServerPool` of `leangrpo serve`s.

    Build it with `VLLMEngine.colocated(...)` or `VLLMEngine.server(...)`.
    """

    backend_class: type[LocalVLLM] = LocalVLLM  # colocated; sharing.py's engine: SharedVLLM

    def __init__(
        self,
        backend: Any,
        settings: VLLMSettings,
        *,
        adapter_config: dict | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        owned_dir: Path | None = None,
        run_id: str | None = None,
    ):
        self.backend = backend
        self.settings = settings
        self.adapter_config = adapter_config
        self.bucket_bytes = bucket_bytes
        self.run_id = run_id or uuid.uuid4().hex  # this engine's policies: (run_id, version)
        self._owned_dir = owned_dir

    @classmethod
    def colocated(
        cls,
        model_path: str | os.PathLike,
        cfg: Any = None,
        *,
        enable_lora: bool = False,
        max_lora_rank: int = 16,
        adapter_config: dict | None = None,
        seed: int = 0,
        work_dir: str | os.PathLike | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        **settings: Any,
    ) -> VLLMEngine:
        """A `vllm.LLM` in this process. `cfg`: the `rollout.vllm` section (or a dict); keyword
        settings override it. `adapter_config`: the peft config dict, needed only to sync LoRA
        tensors through `update_weights` (`load_adapter` reads it from the adapter dir)."""
        s = VLLMSettings.from_section(cfg, **settings)
        kwargs = build_llm_kwargs(str(model_path), s, enable_lora, max_lora_rank, seed)
        root = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="leangrpo-vllm-"))
        run_id = uuid.uuid4().hex
        try:  # the weights on disk are this run's version 0
            backend = cls.backend_class(kwargs, root, run=run_id)
        except BaseException:
            if not work_dir:
                shutil.rmtree(root, ignore_errors=True)
            raise
        return cls(
            backend,
            s,
            adapter_config=adapter_config,
            bucket_bytes=bucket_bytes,
            owned_dir=None if work_dir else root,
            run_id=run_id,
        )

    @classmethod
    def server(
        cls,
        urls: list[str] | None = None,
        cfg: Any = None,
        *,
        model_path: str | os.PathLike | None = None,
        enable_lora: bool = False,
        max_lora_rank: int = 16,
        adapter_config: dict | None = None,
        seed: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        startup_timeout_s: float = 600.0,
        **settings: Any,
    ) -> VLLMEngine:
        """Servers at `urls` (default: `cfg.urls`); none given = start one local `leangrpo serve
        model_path` on a free loopback port (with a fresh token), stopped by `close()`.
        The servers hold none of this run's weights until the first `update_weights`."""
        s = VLLMSettings.from_section(cfg, **settings)
        urls = list(urls if urls is not None else s.urls)
        token = client_token(s.token_file)
        process = None
        if not urls:
            token = token or secrets.token_urlsafe(32)
            if model_path is None:
                raise ValueError(
                    "rollout.vllm.urls is empty and no model_path was given to start a local `leangrpo serve`"
                )
            process, url = start_local_server(
                str(model_path),
                s,
                enable_lora=enable_lora,
                max_lora_rank=max_lora_rank,
                seed=seed,
                token=token,
                startup_timeout_s=startup_timeout_s,
            )
            urls = [url]
        try:
            pool = ServerPool(
                urls,
                token=token,
                timeout_s=s.request_timeout_s,
                max_retries=s.max_retries,
                process=process,
            )
        except BaseException:
            if process is not None:  # never leave a server we started behind
                process.terminate()
            raise
        return cls(pool, s, adapter_config=adapter_config, bucket_bytes=bucket_bytes)

    @property
    def version(self) -> int:
        """The version of this run the backend holds; NO_VERSION before this run's first push."""
        run, version = self.backend.held
        return version if run == self.run_id else NO_VERSION

    def generate(
        self,
        prompts: list[Prompt],
        params: SamplingParams,
        n: int,
        version: int,
        prompt_offset: int = 0,
    ) -> list[list[Completion]]:
        held = self.version
        if held == NO_VERSION:
            raise EngineVersionError(
                f"run {self.run_id} has not pushed its weights to the engine yet; call "
                "update_weights/load_adapter first (the trainer does at start)"
            )
        if version != held:  # fail fast; the backend checks again under its lock
            raise EngineVersionError(
                f"generation requested for policy version {version}, but the engine holds version "
                f"{held}; sync the weights first (update_weights/load_adapter)"
            )
        if not prompts:
            return []
        seeds = None
        if params.seed is not None:
            seeds = [prompt_seed(params.seed, prompt_offset + i, n) for i in range(len(prompts))]
        ids = [p.ids for p in prompts]
        groups = self.backend.generate(ids, params, n, version, seeds, run=self.run_id)
        check_groups(groups, len(prompts), n, version)
        return groups

    def generate_turns(
        self, requests: list[TurnRequest], params: SamplingParams, version: int
    ) -> list[Completion]:
        """One completion per request (a multi-turn trajectory's turn): one vLLM request
        each, n = 1, seeded with the request's seed, at most its own max_new_tokens, all
        submitted to one turn stream at once. Each is submitted as a copy of its own, so a
        request object passed twice is two independent turns (two completions), as with
        the hf engine."""
        submitted = [dataclasses.replace(r) for r in requests]
        position = {id(r): i for i, r in enumerate(submitted)}
        out: list[Completion | None] = [None] * len(requests)
        with self.open_turns(params, version) as stream:
            for request in submitted:
                stream.submit(request)
            while stream.pending():
                for request, completion in stream.advance(STREAM_WAIT_S):
                    out[position[id(request)]] = completion
        return out

    def open_turns(
        self, params: SamplingParams, version: int
    ) -> LocalTurnStream | ServerTurnStream:
        """A stream for one generation call's turns (turns.py): colocated, each turn added
        to the engine as it comes; servers, each turn a request to its trajectory's server."""
        held = self.version
        if version != held:
            raise EngineVersionError(
                f"generation requested for policy version {version}, but the engine holds version {held}"
            )
        if isinstance(self.backend, ServerPool):
            return CheckedStream(
                ServerTurnStream(self.backend, params, version, self.run_id), version
            )
        return CheckedStream(LocalTurnStream(self.backend, params, version, self.run_id), version)

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Full weights (checkpoint names), or LoRA tensors by their peft names."""
        items = iter(named_tensors)
        first = next(items, None)
        if first is None:
            raise ValueError(
                "update_weights got no tensors; pass model.named_parameters() or a state dict's items()"
            )
        items = _chain_first(first, items)
        with tempfile.TemporaryDirectory(prefix="leangrpo-sync-") as tmp:
            if is_lora_name(first[0]):
                if self.adapter_config is None:
                    raise ValueError(
                        "update_weights got LoRA tensors but the engine has no adapter_config; "
                        "pass adapter_config=peft_config.to_dict() or call load_adapter(path)"
                    )
                adapter = write_adapter(items, self.adapter_config, Path(tmp))
                self.backend.load_adapter(adapter, version, run=self.run_id)
                return
            paths = write_weight_buckets(items, Path(tmp), self.bucket_bytes)
            self.backend.load_weight_files(paths, version, run=self.run_id)

    def load_adapter(self, path: str | os.PathLike, version: int) -> None:
        self.backend.load_adapter(Path(path), version, run=self.run_id)

    def check_adapter(self, names: Iterable[str]) -> None:
        """Before training: refuse (one sentence naming them) an adapter whose tensors
        (`names`) adapt modules this engine serves no LoRA on; vLLM would serve the rest
        of it (in memory) or refuse it at the first sync (files). A server that does not
        say what it serves is left to refuse at the push."""
        servable = self.backend.lora_modules()
        if servable is None:
            return
        refused = unservable_modules(names, servable)
        if refused:
            raise RunError(unservable_message(refused, servable))

    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory while the trainer trains (no-op where unsupported)."""
        self.backend.sleep(level)

    def wake_up(self) -> None:
        self.backend.wake_up()

    def close(self) -> None:
        self.backend.close()
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CheckedStream:
    """A turn stream whose completions are checked to carry the version asked for."""

    def __init__(self, stream: LocalTurnStream | ServerTurnStream, version: int):
        self.stream, self.version = stream, version

    def submit(self, request: TurnRequest) -> None:
        self.stream.submit(request)

    def pending(self) -> int:
        return self.stream.pending()

    def advance(self, timeout_s: float = 0.0) -> list[tuple[TurnRequest, Completion]]:
        done = self.stream.advance(timeout_s)
        check_groups([[c] for _, c in done], len(done), 1, self.version)
        return done

    def release(self, key: int) -> None:
        self.stream.release(key)

    def metrics(self) -> dict[str, float]:
        return self.stream.metrics()

    def close(self) -> None:
        self.stream.close()

    def __enter__(self) -> CheckedStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_groups(groups: list[list[Completion]], prompts: int, n: int, version: int) -> None:
    """n completions per prompt, each tagged with the version asked for: a completion from
    other weights would enter training with a wrong (possibly negative) staleness."""
    if len(groups) != prompts or any(len(g) != n for g in groups):
        raise RuntimeError(
            f"the engine returned {[len(g) for g in groups]} completions for {prompts} prompts "
            f"x n={n}"
        )
    wrong = sorted({c.version for g in groups for c in g} - {version})
    if wrong:
        raise EngineVersionError(
            f"the engine returned completions of version(s) {wrong} for a request at version "
            f"{version}; refusing samples from weights this run did not push"
        )


def _chain_first(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest


def supported_lora_rank(rank: int) -> int:
    """vLLM's max_lora_rank takes powers of two from 8 up: the smallest one >= rank."""
    supported = 8
    while supported < rank:
        supported *= 2
    return supported


def make_vllm_engine(
    cfg: Any, policy: Any = None, engine_class: type[VLLMEngine] | None = None, **settings: Any
) -> VLLMEngine:
    """The engine a full `Config` asks for (`rollout.vllm`), starting from `model.name_or_path`.
    `engine_class`: a subclass to build (sharing.py's); `settings` override the section's."""
    section = cfg.rollout.vllm
    lora = bool(cfg.lora.enabled)
    peft_config = None
    if lora and policy is not None and hasattr(policy.model, "peft_config"):
        peft_config = policy.model.peft_config["default"]
    extra = dict(section.engine_kwargs)
    if cfg.model.revision:
        extra.setdefault("revision", cfg.model.revision)
    if cfg.model.trust_remote_code:
        extra.setdefault("trust_remote_code", True)
    if cfg.model.quantization != "none":  # QLoRA: vLLM quantizes the base in flight (nf4 +
        extra.setdefault("quantization", "bitsandbytes")  # double quant, as the trainer's)
    overrides = {}
    if section.dtype == "auto" and cfg.model.dtype != "auto":
        overrides["dtype"] = cfg.model.dtype  # sample in the trainer's precision by default
    common = dict(
        **{**overrides, **settings},
        enable_lora=lora,
        max_lora_rank=supported_lora_rank(cfg.lora.r),
        adapter_config=peft_config,
        seed=cfg.run.seed,
        engine_kwargs=extra,
    )
    engine_class = engine_class or VLLMEngine
    if section.mode == "server":
        return engine_class.server(cfg=section, model_path=cfg.model.name_or_path, **common)
    return engine_class.colocated(cfg.model.name_or_path, section, **common)
