"""In-process vLLM with policy versions: the part shared by colocated mode and `leangrpo serve`.

`LocalVLLM` wraps one `vllm.LLM` (not thread-safe, so one lock) with a `VersionGate`
(versions.py): every update and generation carries (run id, version), so a long-lived
server never mistakes another run's weights for this run's (a new run starts at version 0
like the last one did).

A full-weight update holds new requests back and waits for those in flight (drain), loads
the safetensors buckets through the worker extension (`collective_rpc(
"load_weights_from_files")`), resets the prefix cache (its KV came from the old weights)
and only then holds the new version. A LoRA update needs no drain: each adapter gets a
name and an integer id never used before in this process (vLLM caches loaded adapters by
id, so reusing one would serve the old tensors), requests admitted earlier finish on
their own adapter, and adapters beyond the two newest are dropped once no request uses
them. Only `adapter_config.json` and `*.safetensors` files are published (never a
pickled `adapter_model.bin`; files.py `publish_adapter`).

Generation is cooperative: a caller adds its requests to the engine (`enqueue`, vLLM's
`llm_engine.add_request`) and steps the engine until they are finished (`step`, one
`llm_engine.step()` under the lock); every step advances every caller's requests, and
outputs that finish for another caller are kept for it. So concurrent callers (the
threads of `leangrpo serve`, a turn stream and an evaluation) are batched by vLLM's
scheduler together, and a turn stream adds each turn the moment it is ready.

`score` serves a distillation teacher (`leangrpo serve TEACHER`, distill/served.py): the
prompt log-probs of given sequences under the weights loaded from disk, refused once a
run has pushed its own.

Before vLLM starts, its compile cache is checked for the entries a start-up killed while
compiling left damaged, which are removed and compiled again (compile_cache.py).
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from leangrpo.contracts import Completion, EngineVersionError, SamplingParams
from leangrpo.errors import RunError
from leangrpo.model.moe.routers import RoutingError
from leangrpo.model.moe.routes import routes_from_vllm
from leangrpo.rollout.vllm.compile_cache import compile_cache_roots, repair_compile_cache
from leangrpo.rollout.vllm.files import publish_adapter
from leangrpo.rollout.vllm.settings import INSTALL_HINT
from leangrpo.rollout.vllm.versions import VersionGate

if TYPE_CHECKING:
    from leangrpo.rollout.vllm.settings import VLLMSettings

log = logging.getLogger(__name__)

WORKER_EXTENSION = "leangrpo.rollout.vllm.worker.WeightSyncExtension"
IN_MEMORY_ADAPTERS = Path("/leangrpo-in-memory")  # the paths of adapters vLLM got as tensors


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"the vllm rollout engine needs vLLM: {INSTALL_HINT}") from err
    return vllm


# --------------------------------------------------------------------------- conversions


def to_vllm_sampling_params(params: SamplingParams, n: int, routes_from: int | None = None) -> Any:
    """`routes_from` (routing replay): the prompt position routed experts are returned
    from, its last (the one that predicts the first token)."""
    if n < 1:
        raise ValueError(f"n must be >= 1 completions per prompt, got {n}")
    vllm = import_vllm()
    extra = {} if routes_from is None else {"routed_experts_prompt_start": routes_from}
    return vllm.SamplingParams(
        **extra,
        n=n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else 0,
        min_p=params.min_p,
        max_tokens=params.max_new_tokens,
        stop=list(params.stop) or None,
        seed=params.seed,
        logprobs=0,  # the sampled token's log-prob only
        skip_special_tokens=True,
    )


def completion_from_output(output: Any, version: int, routes: bool = False) -> Completion:
    """One vLLM CompletionOutput -> Completion (ids keep EOS; processed log-probs; with
    `routes`, its routed experts from the prompt's last position: one row per token)."""
    ids = [int(t) for t in output.token_ids]
    if output.logprobs is None or len(output.logprobs) != len(ids):
        raise RuntimeError("vLLM returned no per-token log-probs; was logprobs=0 dropped?")
    logprobs = [float(step[tok].logprob) for step, tok in zip(output.logprobs, ids)]
    reason = {"stop": "stop", "length": "length"}.get(output.finish_reason, "error")
    return Completion(
        ids=ids,
        text=output.text,
        logprobs=logprobs,
        finish_reason=reason,
        version=version,
        routes=routes_from_vllm(output.routed_experts, len(ids)) if routes else None,
    )


def teacher_sampling_params() -> Any:
    """A scoring request: the prompt's own log-probs (`prompt_logprobs=0`: each position's
    actual next token only, of vLLM's log-softmax over the full vocabulary, no temperature
    or filter), one greedy token generated because a request must generate one, nothing
    detokenised."""
    vllm = import_vllm()
    return vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)


def prompt_logprobs_from(output: Any, ids: list[int], start: int) -> list[float]:
    """log p(ids[i] | ids[:i]) for i in [start, len(ids)) from a request's prompt log-probs
    (vLLM's entry i holds its prompt token's; entry 0 is None)."""
    entries = output.prompt_logprobs
    if entries is None or len(entries) != len(ids):
        raise RuntimeError("vLLM returned no prompt log-probs; was prompt_logprobs=0 dropped?")
    return [float(entries[i][ids[i]].logprob) for i in range(start, len(ids))]


@dataclass(frozen=True)
class AdapterSlot:
    """One published adapter: what vLLM is asked for when (run, version) generates."""

    key: tuple[str | None, int]  # (run id, version)
    name: str  # unique per run and version: vLLM matches requests by name
    int_id: int  # never reused by this process: vLLM caches loaded adapters by id
    path: Path


class AdapterSlots:
    """Names, ids and directories of the adapters one `LocalVLLM` serves."""

    def __init__(self, root: Path):
        self.root = root
        shutil.rmtree(root, ignore_errors=True)  # an earlier process's adapters: never served
        self._last_id = 0
        self.slots: dict[tuple[str | None, int], AdapterSlot] = {}  # oldest first

    def publish(self, source: Path, run: str | None, version: int) -> AdapterSlot:
        self._last_id += 1
        name = f"{run or 'base'}-v{version}-{self._last_id}"
        path = publish_adapter(source, self.root, name)
        return AdapterSlot((run, version), name, self._last_id, path)

    def in_memory(self, run: str | None, version: int) -> AdapterSlot:
        """A slot for an adapter handed over as tensors (sharing.py): its path exists
        nowhere, absolute so that a reload vLLM might attempt fails instead of asking the
        hub, and unique like the name (vLLM keys its prefix cache by both)."""
        self._last_id += 1
        name = f"{run or 'base'}-v{version}-{self._last_id}"
        return AdapterSlot((run, version), name, self._last_id, IN_MEMORY_ADAPTERS / name)

    def add(self, slot: AdapterSlot) -> None:
        self.slots.pop(slot.key, None)
        self.slots[slot.key] = slot

    def retire(
        self, keep: int, in_use: Callable[[tuple[str | None, int]], bool]
    ) -> list[AdapterSlot]:
        """Forget (and delete the files of) all but the `keep` newest adapters not in use."""
        old = list(self.slots.values())[: max(len(self.slots) - keep, 0)]
        gone = [slot for slot in old if not in_use(slot.key)]
        for slot in gone:
            del self.slots[slot.key]
            if slot.path.parent != IN_MEMORY_ADAPTERS:
                shutil.rmtree(slot.path, ignore_errors=True)
        return gone


# --------------------------------------------------------------------------- in-process vLLM


def _platform_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def cpu_moe_reload_blocker(llm: Any) -> str | None:
    """Why this engine cannot load new full weights in place, or None. vLLM 0.32's CPU
    build cannot for a mixture of experts: its layerwise reload copies the checkpoint's
    expert weights into the CPU fused-MoE layer's repacked tensors (shape mismatch), and
    the engine dies at the next forward (seen with Qwen3-MoE)."""
    from vllm import __version__

    from leangrpo.model.files import declared_experts

    hf_config = llm.llm_engine.vllm_config.model_config.hf_config
    if not _platform_is_cpu() or not declared_experts(hf_config.to_dict()):
        return None
    return f"vLLM {__version__}'s CPU build cannot load new weights into a mixture of experts in place (its reload fails on the CPU fused-MoE layers and the engine dies), so a full fine-tuning run cannot sync it; generate with rollout.engine: hf, or vLLM on a GPU"


def _sleep_mode_available() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def check_cpu_head_size(model_path: str) -> None:
    """vLLM's CPU attention kernels take a fixed set of head sizes; say so before start-up."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return  # a hub name: vLLM reports it
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = CPUAttentionBackend.get_supported_head_sizes()
    except (ImportError, AttributeError):
        return  # another vLLM layout: let vLLM check
    config = json.loads(config_file.read_text())
    config = config.get("text_config", config)
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (heads and config.get("hidden_size", 0) // heads)
    if head_dim and head_dim not in supported:
        raise ValueError(
            f"{model_path} has attention head size {head_dim}, which vLLM's CPU kernels do not "
            f"support (supported: {supported}); use rollout.engine=hf on CPU, or a model whose "
            "hidden_size / num_attention_heads is one of those"
        )


def build_llm_kwargs(
    model_path: str, s: VLLMSettings, enable_lora: bool, max_lora_rank: int, seed: int
) -> dict:
    import_vllm()  # the install hint, before anything else touches vllm
    gpu_mem = s.gpu_memory_utilization
    on_cpu = _platform_is_cpu()
    if gpu_mem is None:
        gpu_mem = 0.1 if on_cpu else 0.9
    elif on_cpu and gpu_mem > 0.5:
        raise ValueError(
            f"rollout.vllm.gpu_memory_utilization={gpu_mem}: on CPU vLLM reserves this fraction of NUMA "
            "node 0's memory for its KV cache alone; set about 0.1 (or null for the platform default)"
        )
    if on_cpu:
        check_cpu_head_size(model_path)
    sleep = s.enable_sleep_mode and _sleep_mode_available()
    if s.enable_sleep_mode and not sleep:
        log.info("vLLM sleep mode is not available on this platform; the engine stays awake")
    kwargs: dict[str, Any] = dict(
        model=model_path,
        dtype=s.dtype,
        gpu_memory_utilization=gpu_mem,
        max_model_len=s.max_model_len,
        kv_cache_dtype=s.kv_cache_dtype,
        enforce_eager=s.enforce_eager,
        enable_sleep_mode=sleep,
        worker_extension_cls=WORKER_EXTENSION,
        logprobs_mode="processed_logprobs",
        seed=seed,
        # multi-turn: a trajectory's next turn recomputes only what its engine did not cache
        enable_prefix_caching=True,
    )
    if enable_lora:
        kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=2)
    if s.routed_experts:  # routing replay (mixtures of experts)
        check_routed_experts(on_cpu)
        kwargs["enable_return_routed_experts"] = True
    kwargs.update(s.engine_kwargs)
    return kwargs


def check_routed_experts(on_cpu: bool) -> None:
    """Routing replay needs vLLM's routed-experts output: refused in one sentence where
    the installed vLLM cannot give it. vLLM 0.32 returns it only from Model Runner V2
    (asked for here), which needs Triton on a GPU: its CPU build refuses it."""
    import dataclasses
    import os

    from vllm import __version__
    from vllm.engine.arg_utils import EngineArgs

    if "enable_return_routed_experts" not in {f.name for f in dataclasses.fields(EngineArgs)}:
        raise RoutingError(
            f"rollout.routing_replay needs vLLM's routed-experts output (enable_return_routed_experts), which vLLM {__version__} does not have; use rollout.engine: hf, or a vLLM that has it"
        )
    if on_cpu:
        raise RoutingError(
            f"rollout.routing_replay needs vLLM's routed-experts output, which vLLM {__version__} returns only from its Model Runner V2 (GPUs with Triton), not on this CPU; use rollout.engine: hf for routing replay on CPU"
        )
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")  # its aux-output connector needs it


class LocalVLLM:
    """A `vllm.LLM` with versions, a lock (LLM is not thread-safe) and file-based sync.

    `run`: the run whose version 0 the weights on disk are (colocated: the engine's own
    run id); None for a server, which holds no run's weights until one pushes them."""

    def __init__(self, llm_kwargs: dict, work_dir: Path, run: str | None = None):
        vllm = import_vllm()
        repair_compile_cache(compile_cache_roots(llm_kwargs))  # a killed start's leftovers
        with keep_process_state():
            self.llm = vllm.LLM(**llm_kwargs)
        self.in_process = type(self.llm.llm_engine.engine_core).__name__ == "InprocClient"
        self.routes = bool(llm_kwargs.get("enable_return_routed_experts"))  # routing replay
        self.reload_refused = cpu_moe_reload_blocker(self.llm)  # why full weights cannot sync
        self.sleep_mode = bool(llm_kwargs.get("enable_sleep_mode"))
        self.work_dir = work_dir
        self.gate = VersionGate(0, run)
        self.adapters = AdapterSlots(work_dir / "adapters")
        self._requests: dict[tuple[str | None, int], Any] = {}  # (run, version) -> LoRARequest
        self._base_run: str | None = None  # whose full weights replaced the ones from disk
        self._lock = threading.Lock()
        self._asleep = False
        self._finished: dict[str, Any] = {}  # outputs a step finished for another caller
        self._request_ids = 0
        self._lora_modules: list[str] | None = None

    @property
    def version(self) -> int:
        return self.gate.version

    @property
    def held(self) -> tuple[str | None, int]:
        return self.gate.held

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        n: int,
        version: int,
        seeds: list[int] | None = None,
        *,
        run: str | None,
    ) -> list[list[Completion]]:
        """`seeds`: one per prompt (vLLM seeds completion k of a prompt with seed + k)."""
        for i, ids in enumerate(prompt_ids):
            if not ids:
                raise ValueError(f"prompt {i} has no token ids; tokenise prompts before generating")
        seeded = [replace(params, seed=s) for s in seeds] if seeds is not None else None
        sampling = [
            to_vllm_sampling_params(
                params if seeded is None else seeded[i], n, len(ids) - 1 if self.routes else None
            )
            for i, ids in enumerate(prompt_ids)
        ]
        with self.gate.admit(version, run):
            outputs = self.collect(self.enqueue(prompt_ids, sampling, run=run, version=version))
        return [
            [completion_from_output(o, version, self.routes) for o in req.outputs]
            for req in outputs
        ]

    def score(self, sequences: list[list[int]], starts: list[int]) -> list[list[float]]:
        """The log-prob of each sequence's token at every position from its start on,
        given the tokens before it, under the weights loaded from disk: vLLM's prompt
        log-probs (its full vocabulary, no temperature, no filter), the log-probs a served
        distillation teacher returns (distill/served.py). Refused (EngineVersionError)
        once a run has pushed its weights here: the engine no longer holds the model it
        loaded."""
        for i, (ids, start) in enumerate(zip(sequences, starts, strict=True)):
            if not 1 <= start <= len(ids) - 1:
                raise ValueError(
                    f"sequence {i} has {len(ids)} tokens, so scored positions start in "
                    f"[1, {len(ids) - 1}], got {start}"
                )
        run, version = self.held
        if run is not None:
            raise EngineVersionError(
                f"this server holds run {run}'s weights (version {version}), pushed by a "
                "trainer, not the model it loaded, so it cannot score as a teacher; restart "
                "`leangrpo serve` and list it in distill.teacher_urls only, never in "
                "rollout.vllm.urls"
            )
        sampling = [teacher_sampling_params() for _ in sequences]
        with self.gate.admit(version, run):
            outputs = self.collect(self.enqueue(sequences, sampling, run=run, version=version))
        return [
            prompt_logprobs_from(output, ids, start)
            for output, ids, start in zip(outputs, sequences, starts)
        ]

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + completion) this engine takes."""
        return int(self.llm.llm_engine.vllm_config.model_config.max_model_len)

    # -- requests, stepped cooperatively ----------------------------------------------------
    def enqueue(
        self, prompt_ids: list[list[int]], sampling: list[Any], *, run: str | None, version: int
    ) -> list[str]:
        """Add requests to the engine (admitted by the caller under `gate.admit`); their
        request ids, for `step` / `collect`. The ids are ours (vLLM's outputs carry the id a
        request was added with; `LLM.enqueue` returns the engine's internal ones)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        lora = self._requests.get((run, version))
        added = []
        with self._lock:
            self._wake_locked()
            try:
                for ids, params in zip(prompt_ids, sampling):
                    params.output_kind = RequestOutputKind.FINAL_ONLY  # as LLM.generate asks
                    self._request_ids += 1
                    request_id = f"leangrpo-{self._request_ids}"
                    prompt = TokensPrompt(prompt_token_ids=list(ids))
                    self.llm.llm_engine.add_request(request_id, prompt, params, lora_request=lora)
                    added.append(request_id)
            except BaseException:
                if added:
                    self.llm.llm_engine.abort_request(added)
                raise
        return added

    def step(self, wanted: Iterable[str]) -> dict[str, Any]:
        """The finished outputs of `wanted` requests: those already done, else after one
        engine step (which advances every caller's requests; theirs are kept for them)."""
        wanted = list(wanted)
        with self._lock:
            if not any(i in self._finished for i in wanted):
                for output in self.llm.llm_engine.step():
                    if output.finished:
                        self._finished[output.request_id] = output
            return {i: self._finished.pop(i) for i in wanted if i in self._finished}

    def collect(self, request_ids: list[str]) -> list[Any]:
        """Step until every request is finished; their outputs in order."""
        done: dict[str, Any] = {}
        while len(done) < len(request_ids):
            done.update(self.step([i for i in request_ids if i not in done]))
        return [done[i] for i in request_ids]

    def abort(self, request_ids: list[str]) -> None:
        """Drop requests nobody waits for any more (finished or not)."""
        with self._lock:
            for i in request_ids:
                self._finished.pop(i, None)
            if self.llm is not None:
                self.llm.llm_engine.abort_request(list(request_ids))

    def load_weight_files(self, paths: list[Path], version: int, *, run: str | None) -> None:
        if self.reload_refused is not None:  # before vLLM tries, and dies
            raise RunError(self.reload_refused)
        with self.gate.update(version, drain=True, run=run) as needed:
            if not needed:
                return
            with self._lock:
                self._wake_locked()
                counts = self.llm.collective_rpc(
                    "load_weights_from_files", args=([str(p) for p in paths],)
                )
                self.llm.reset_prefix_cache()  # cached KV was computed by the old weights
                self._retire_adapters(keep=0)  # adapters applied to the old base
                self._base_run = run
        log.debug("vLLM loaded %s tensors per worker as run %s version %d", counts, run, version)

    def load_adapter(self, source: Path, version: int, *, run: str | None) -> None:
        from vllm.lora.request import LoRARequest

        with self.gate.update(version, drain=False, run=run) as needed:
            if not needed:
                return
            if self._base_run not in (None, run):
                raise EngineVersionError(
                    f"run {self._base_run} replaced this engine's base weights; an adapter of run "
                    f"{run} needs the original base: restart `leangrpo serve`"
                )
            slot = self.adapters.publish(source, run, version)
            request = LoRARequest(slot.name, slot.int_id, str(slot.path))
            with self._lock:
                self._wake_locked()
                if not self.llm.llm_engine.add_lora(request):
                    raise RuntimeError(
                        f"vLLM refused LoRA adapter {slot.path}; is enable_lora set and max_lora_rank large enough?"
                    )
                self.adapters.add(slot)
                self._requests[slot.key] = request
                self._retire_adapters(keep=2)

    def _retire_adapters(self, keep: int) -> None:
        for slot in self.adapters.retire(keep, self.gate.in_use):
            self._requests.pop(slot.key, None)
            self.llm.llm_engine.remove_lora(slot.int_id)

    def sleep(self, level: int = 1) -> None:
        if not self.sleep_mode:
            return
        with self._lock:
            if not self._asleep:
                self.llm.sleep(level=level)
                self._asleep = True

    def wake_up(self) -> None:
        with self._lock:
            self._wake_locked()

    def _wake_locked(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def lora_modules(self) -> list[str]:
        """The module names this vLLM serves LoRA on ([] with LoRA off), asked once."""
        if self._lora_modules is None:
            self._lora_modules = list(self.call_workers("leangrpo_lora_modules")[0])
        return self._lora_modules

    def call_workers(self, method: str, *args: Any) -> list[Any]:
        with self._lock:
            return self.llm.collective_rpc(method, args=args)

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            if self.in_process:  # now, not whenever the collector finds it: its teardown
                llm.llm_engine.engine_core.shutdown()  # ends vLLM's process-wide state
            del llm
            import gc

            gc.collect()


@contextmanager
def keep_process_state() -> Iterator[None]:
    """Around a `vllm.LLM` start: what an engine core in this process (VLLM_ENABLE_V1_
    MULTIPROCESSING=0) changes for the whole process is put back: the random streams
    (its worker seeds random, numpy and torch), `torch.set_num_threads` (vLLM's CPU
    worker replaces it with a no-op) and the thread count. Its `gc.freeze()` and its
    distributed state are undone by its own shutdown, which `close` calls."""
    import random

    import numpy as np
    import torch

    streams = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        random.setstate(streams[0])
        np.random.set_state(streams[1])
        torch.set_rng_state(streams[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
