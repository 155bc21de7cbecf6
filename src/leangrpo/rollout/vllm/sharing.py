"""One copy of the weights: colocated vLLM and the policy share memory (`rollout.vllm.share_weights`).

vLLM starts first, in this process, and owns the tensors (it allocates its fused
parameters and copies the checkpoint into them); the policy is then a transformers model
whose parameters are views of those tensors. Nothing is copied, and an optimizer step on
the policy is an update of the weights vLLM serves.

- In-process: `VLLM_ENABLE_V1_MULTIPROCESSING=0` while the LLM is built, so its engine core
  and worker run here (`InprocClient`, `UniProcExecutor`) and `collective_rpc` passes live
  objects (worker.py `SharingExtension`); local.py puts back what such a start changes
  in the trainer's process.
- Views (`vllm_views`): a fused parameter (`packed_modules_mapping`: qkv_proj, gate_up_proj)
  is split along its output dimension by the layer's `output_partition_sizes`; the
  vocabulary rows vLLM pads to a multiple of 64 are sliced off (`org_vocab_size`); LoRA
  wrappers' `.base_layer` is dropped from the names. `model_on_views` builds the
  transformers model with `from_pretrained(None, config=, state_dict=views)`, which
  wraps each view in a Parameter of its own without copying it.
- Checked before the policy uses them: every transformers parameter gets a view of its
  shape and dtype on the trainer's device, equal to the checkpoint's tensor (the files
  are read once more, a tensor at a time), and once the policy is built (LoRA wrapped,
  checkpointing on) every base parameter still lies in a vLLM storage. Anything else
  keeps two copies: with `share_weights: auto` one log line says why, with `true` the
  run stops with it. Layouts that cannot be views: tensor or pipeline parallel shards,
  quantized serving (bitsandbytes, fp8, AWQ, GPTQ), a vLLM dtype other than the
  trainer's, models whose vLLM names do not map back to transformers' (renamed by
  `hf_to_vllm_mapper`, fused or transposed otherwise: GPT-2's Conv1D, MoE expert stacks,
  interleaved gate/up) and hub code (`trust_remote_code`).
- CPU: vLLM prepacks linear weights for oneDNN and empties them, so they are served as
  plain tensors with `F.linear` again (`leangrpo_plain_weights`; slower in decode
  batches, see benchmarks/RESULTS.md), and vLLM runs eagerly (a compiled graph holds the
  packed kernels).
- Sync: full fine-tuning updates vLLM's tensors in place, so a sync is a prefix-cache
  reset (its KV came from the old weights) and the version; tensors that are not vLLM's
  own still go through files. LoRA adapters are handed over as tensors (copies: vLLM
  keeps what it is given) under a name, id and path unique per version (local.py
  `AdapterSlots.in_memory`), so no prefix-cache reset is needed; `adapter_sync: files`
  keeps the file round trip.
- Standby (sync mode, GPUs with sleep mode): while the trainer trains, scheduling is
  paused and only the KV cache is released (`release_kv_cache_memory`); it comes back
  for the next request. Sleep levels 1 and 2 would unmap the shared weights under the
  trainer, so they are never used here. CPU vLLM has no sleep mode (logged once).

Tested with vLLM 0.32.x (`TESTED_VLLM`); the vLLM internals this reads are listed in
docs/ARCHITECTURE.md ("One copy of the weights").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leangrpo.contracts import EngineVersionError
from leangrpo.errors import RunError
from leangrpo.model.policy import Policy, build_policy, quiet_transformers_progress, resolve_dtype
from leangrpo.rollout.vllm.engine import VLLMEngine, make_vllm_engine
from leangrpo.rollout.vllm.files import is_lora_name, saved_lora_name
from leangrpo.rollout.vllm.local import LocalVLLM, _platform_is_cpu, import_vllm

log = logging.getLogger("leangrpo")

TESTED_VLLM = ("0.32.0", "0.33")  # low <= vLLM < high


class NotShared(Exception):
    """Why the weights cannot be shared (the message; `fix`: what would allow it)."""

    def __init__(self, why: str, fix: str = "a model and settings vLLM serves as plain tensors"):
        super().__init__(why)
        self.why, self.fix = why, fix


# --------------------------------------------------------------------------- set-up


@dataclass
class SharedStart:
    """A colocated engine started before the policy, and the views the policy is built on
    (None: it keeps two copies)."""

    engine: SharedVLLMEngine
    views: dict[str, torch.Tensor] | None
    storages: set[int]

    def build_policy(self, cfg, tokenizer, device: torch.device) -> Policy | None:
        """The policy on vLLM's tensors; None (after saying why) when they cannot be shared."""
        if self.views is None:
            return None
        try:
            policy = _policy_on_views(cfg, tokenizer, device, self.views)
        except NotShared as problem:
            self.views = None
            keep_two_copies(cfg, problem, runtime=True)
            return None
        self.engine.backend.storages = self.storages
        bytes_ = sum(t.numel() * t.element_size() for t in _unique(self.views.values()))
        log.info(
            "colocated vLLM and the policy share one copy of the weights (%d tensors, %.2f GiB)",
            len(self.views),
            bytes_ / 2**30,
        )
        return policy


def start_shared_vllm(cfg, device: torch.device) -> SharedStart | None:
    """Colocated vLLM set up to share its weights with the policy: started before the
    policy, in this process. None (after saying why) when the config or the installed
    vLLM rules sharing out before anything starts."""
    try:
        _check_before_start(cfg, device)
    except NotShared as problem:
        keep_two_copies(cfg, problem, runtime=False)
        return None
    dtype = resolve_dtype(cfg.model.dtype, device)
    engine = make_vllm_engine(cfg, None, SharedVLLMEngine, dtype=str(dtype).removeprefix("torch."))
    try:
        storages, views = engine.backend.shareable_views(dtype, device)
    except NotShared as problem:
        keep_two_copies(cfg, problem, runtime=True)
        return SharedStart(engine, None, set())
    except BaseException:
        engine.close()
        raise
    return SharedStart(engine, views, storages)


def keep_two_copies(cfg, problem: NotShared, runtime: bool) -> None:
    """One line (auto), or the run stops with the reason (share_weights: true)."""
    if cfg.rollout.vllm.share_weights is True:
        raise RunError(
            f"rollout.vllm.share_weights is true, but {problem.why}; use {problem.fix}, or set rollout.vllm.share_weights: auto or false to keep two copies of the weights."
        )
    say = log.warning if runtime else log.info
    say("colocated vLLM keeps its own copy of the weights: %s", problem.why)


def _check_before_start(cfg, device: torch.device) -> None:
    blocker = cfg.vllm_share_blocker()
    if blocker is not None:
        raise NotShared(*blocker)
    wanted = cfg.rollout.vllm.dtype
    dtype = str(resolve_dtype(cfg.model.dtype, device)).removeprefix("torch.")
    if wanted != "auto" and wanted != dtype:
        raise NotShared(
            f"rollout.vllm.dtype ({wanted}) differs from the trainer's dtype ({dtype})",
            "rollout.vllm.dtype: auto",
        )
    from packaging.version import Version

    found, (low, high) = import_vllm().__version__, TESTED_VLLM
    if not Version(low) <= Version(found) < Version(high):
        raise NotShared(
            f"vLLM {found} is outside the versions sharing is tested with ({low} <= vLLM < {high})",
            f"vllm>={low},<{high}",
        )


def _policy_on_views(cfg, tokenizer, device, views) -> Policy:
    dtype = resolve_dtype(cfg.model.dtype, device)
    model = model_on_views(cfg.model, views, dtype)
    mismatch = checkpoint_mismatch(model, cfg.model)
    if mismatch is not None:
        raise NotShared(mismatch)
    policy = build_policy(model, cfg, tokenizer, device)
    unshared = unshared_parameters(policy.model, views)
    if unshared:
        raise NotShared(
            f"{len(unshared)} base parameters of the policy do not lie in vLLM's tensors once it is built (e.g. {unshared[0]})"
        )
    return policy


# --------------------------------------------------------------------------- views


def vllm_views(vmodel: nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """{transformers name: view of a vLLM tensor}, and what could not be mapped.

    Each value is a `detach()`ed view: transformers wraps it in a Parameter of its own, so
    the trainer's `requires_grad_` never touches vLLM's parameters."""
    packed = dict(getattr(vmodel, "packed_modules_mapping", None) or {})
    views: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    for module_name, module in vmodel.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if not own:
            continue
        name = module_name.replace(".base_layer", "")  # vLLM's LoRA wrappers
        prefix, _, leaf = name.rpartition(".")
        for pname, p in own.items():
            if leaf in packed:  # fused: [sum of parts, in] -> one view per part
                parts = packed[leaf]
                sizes = list(getattr(module, "output_partition_sizes", None) or [])
                if len(sizes) != len(parts) or sum(sizes) != p.shape[0]:
                    problems.append(f"{name}.{pname} fuses {parts} in sizes {sizes}")
                    continue
                for part, view in zip(parts, torch.split(p.detach(), sizes, dim=0)):
                    views[f"{prefix}.{part}.{pname}" if prefix else f"{part}.{pname}"] = view
            elif pname == "weight" and hasattr(module, "org_vocab_size"):
                views[f"{name}.weight"] = p.detach()[: module.org_vocab_size]  # padding rows off
            else:
                views[f"{name}.{pname}"] = p.detach()
    return views, problems


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same elements of the same storage (pointer, offset, shape, strides, dtype)."""
    return (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def model_on_views(model_cfg, views: dict[str, torch.Tensor], dtype: torch.dtype) -> nn.Module:
    """The transformers causal LM of `model_cfg` whose parameters are `views` (no copy)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_cfg.name_or_path, revision=model_cfg.revision)
    try:
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise NotShared(f"transformers has no causal LM class for {type(config).__name__}") from None
    wrong = sorted(k for k, v in views.items() if v.dtype != dtype)
    if wrong:
        raise NotShared(f"vLLM holds {wrong[0]} in {views[wrong[0]].dtype}, not {dtype}")
    with quiet_transformers_progress():
        model, info = model_class.from_pretrained(
            None, config=config, state_dict=views, dtype=dtype, output_loading_info=True
        )
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(kind):
            keys = sorted(str(k) for k in info[kind])
            what = kind.replace("_", " ").removesuffix("s")
            raise NotShared(f"vLLM's tensors do not map onto {model_class.__name__}: {what} {keys[0]}")
    model.name_or_path = model.config._name_or_path = model_cfg.name_or_path  # peft reads it
    copied = [
        n
        for n, p in model.named_parameters(remove_duplicate=False)
        if not same_memory(p, views[n])
    ]
    if copied:
        raise NotShared(f"transformers copied {copied[0]} instead of keeping vLLM's tensor")
    return model


def checkpoint_mismatch(model: nn.Module, model_cfg) -> str | None:
    """Whether every parameter equals the checkpoint's tensor of its name (read one at a
    time): what catches a layout that maps by shape but not by meaning (say, an
    interleaved gate/up). None when it does."""
    from safetensors import safe_open

    files = _checkpoint_files(model_cfg)
    if not files:
        return f"no .safetensors checkpoint of {model_cfg.name_or_path} to check vLLM's tensors against"
    params = dict(model.named_parameters())
    seen: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                param = params.get(key)
                if param is None:
                    continue
                saved = f.get_tensor(key).to(param.device, param.dtype)
                if not torch.equal(param.detach(), saved):
                    return f"vLLM's tensor for {key} differs from the checkpoint's"
                seen.add(key)
    unseen = [
        n
        for n, p in params.items()
        if n not in seen and not any(same_memory(p, params[s]) for s in seen)
    ]
    if unseen:
        return f"{unseen[0]} is not in the checkpoint under that name, so vLLM's tensor for it cannot be checked"
    return None


def _checkpoint_files(model_cfg) -> list[Path]:
    path = Path(model_cfg.name_or_path)
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(
                snapshot_download(
                    model_cfg.name_or_path,
                    revision=model_cfg.revision,
                    allow_patterns=["*.safetensors"],
                    local_files_only=True,
                )
            )
        except Exception:  # not in the local hub cache: nothing to check against
            return []
    return sorted(path.glob("*.safetensors"))


def unshared_parameters(model: nn.Module, views: dict[str, torch.Tensor]) -> list[str]:
    """Base (non-LoRA) parameters of `model` that are not exactly their vLLM view (peft's
    `base_model.model.` prefix and `.base_layer` dropped from the names)."""
    unshared = []
    for name, param in model.named_parameters():
        if "lora_" in name:
            continue
        view = views.get(name.removeprefix("base_model.model.").replace(".base_layer", ""))
        if view is None or not same_memory(param, view):
            unshared.append(name)
    return unshared


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[tuple, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)), t)
    return list(seen.values())


# --------------------------------------------------------------------------- vLLM in-process


@contextlib.contextmanager
def in_process() -> Iterator[None]:
    """Build a `vllm.LLM` whose engine core and worker run in this process."""
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    saved = os.environ.get(key)
    os.environ[key] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved


def shared_llm_kwargs(kwargs: dict, on_cpu: bool) -> dict:
    """The LLM settings sharing needs: one worker in this process; on CPU, eager."""
    kwargs = dict(kwargs)
    kwargs.setdefault("distributed_executor_backend", "uni")
    if on_cpu and not kwargs.get("enforce_eager"):
        log.info("vLLM on CPU runs eagerly when it shares its weights (its compiled graph would keep the packed kernels)")
        kwargs["enforce_eager"] = True
    if kwargs.get("enable_lora"):  # room for the two adapters kept and the one arriving
        kwargs.setdefault("max_cpu_loras", kwargs.get("max_loras", 1) + 1)
    return kwargs


class SharedVLLM(LocalVLLM):
    """A `LocalVLLM` in this process whose tensors the policy views.

    `storages`: the data pointers of vLLM's parameter storages once the policy shares
    them (empty: it does not, and every sync goes through files as in `LocalVLLM`)."""

    def __init__(self, llm_kwargs: dict, work_dir: Path, run: str | None = None):
        self.on_cpu = _platform_is_cpu()
        with in_process():
            super().__init__(shared_llm_kwargs(llm_kwargs, self.on_cpu), work_dir, run)
        self.storages: set[int] = set()

    def shareable_views(
        self, dtype: torch.dtype, device: torch.device
    ) -> tuple[set[int], dict[str, torch.Tensor]]:
        """vLLM's storages and the transformers-named views of its tensors (CPU: served
        as plain tensors first); NotShared when its layout cannot be viewed."""
        client = type(self.llm.llm_engine.engine_core).__name__
        if client != "InprocClient":
            raise NotShared(
                f"vLLM's engine core runs in another process ({client}), though VLLM_ENABLE_V1_MULTIPROCESSING was 0 when it started"
            )
        config = self.llm.llm_engine.vllm_config
        parallel = config.parallel_config
        if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
            raise NotShared("vLLM holds shards of each weight (tensor or pipeline parallel)")
        if config.model_config.quantization:
            raise NotShared(f"vLLM serves {config.model_config.quantization}-quantized tensors")
        (model,) = self.call_workers("leangrpo_model")
        if self.on_cpu:
            (empty,) = self.call_workers("leangrpo_plain_weights")
            self.llm.reset_prefix_cache()
            if empty:
                raise NotShared(f"vLLM's layer {empty[0]} keeps no plain weight on CPU")
        views, problems = vllm_views(model)
        if problems:
            raise NotShared(f"vLLM's {problems[0]}, which transformers' layers cannot view")
        elsewhere = sorted({str(t.device) for t in views.values()} - {_device_name(device)})
        if elsewhere:
            raise NotShared(f"vLLM's tensors are on {elsewhere[0]}, the trainer's on {device}")
        return {p.untyped_storage().data_ptr() for p in model.parameters()}, views

    def owns(self, named: list[tuple[str, torch.Tensor]]) -> bool:
        """Every tensor lies in vLLM's storages (the policy's own views, while shared)."""
        return bool(self.storages) and all(
            t.untyped_storage().data_ptr() in self.storages for _, t in named
        )

    def weights_updated(self, version: int, *, run: str | None) -> None:
        """The shared weights changed in place: forget the KV computed from the old ones."""
        with self.gate.update(version, drain=True, run=run) as needed:
            if not needed:
                return
            with self._lock:
                self._wake_locked()
                if not self.llm.reset_prefix_cache():
                    raise RuntimeError(
                        "vLLM did not reset its prefix cache after a weight update (requests still running?); refusing to serve KV computed from the old weights"
                    )
                self._retire_adapters(keep=0)
                self._base_run = run

    def load_adapter_tensors(
        self, named: list[tuple[str, torch.Tensor]], config: dict, version: int, *, run: str | None
    ) -> None:
        """A LoRA adapter from tensors (live or saved peft names), copied, as `version`."""
        from vllm.lora.request import LoRARequest

        tensors = {saved_lora_name(n): t.detach().clone() for n, t in named if is_lora_name(n)}
        with self.gate.update(version, drain=False, run=run) as needed:
            if not needed:
                return
            if self._base_run not in (None, run):
                raise EngineVersionError(
                    f"run {self._base_run} replaced this engine's base weights; an adapter of run {run} needs the original base"
                )
            slot = self.adapters.in_memory(run, version)
            with self._lock:
                self._wake_locked()
                (added,) = self.llm.collective_rpc(
                    "leangrpo_add_adapter", args=(slot.int_id, tensors, config)
                )
                if not added:
                    raise RuntimeError(
                        f"vLLM refused the LoRA adapter of version {version}; is enable_lora set and max_lora_rank large enough?"
                    )
                self.adapters.add(slot)
                self._requests[slot.key] = LoRARequest(slot.name, slot.int_id, str(slot.path))
                self._retire_adapters(keep=2)

    def sleep(self, level: int = 1) -> None:
        """Standby: pause and release the KV cache only, never the (shared) weights."""
        if not self.sleep_mode:
            return
        with self._lock:
            if self._asleep:
                return
            if not self.storages:  # two copies: vLLM's own weights may go too
                self.llm.sleep(level=level)
            else:
                self.llm.llm_engine.step()  # hands finished requests over: a completed pause
                self.llm.sleep(level=0)
                self.llm.release_kv_cache_memory()
            self._asleep = True

    def _wake_locked(self) -> None:
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache", "scheduling"] if self.storages else None)
            self._asleep = False


def _device_name(device: torch.device) -> str:
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


class SharedVLLMEngine(VLLMEngine):
    """`VLLMEngine` over a `SharedVLLM`: syncs without files where the weights are shared."""

    backend_class = SharedVLLM

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        named = list(named_tensors)
        backend = self.backend
        if named and is_lora_name(named[0][0]):
            if self.settings.adapter_sync == "memory" and self.adapter_config is not None:
                config = adapter_config_dict(self.adapter_config)
                backend.load_adapter_tensors(named, config, version, run=self.run_id)
                return
        elif named and backend.owns(named):  # the optimizer wrote into vLLM's tensors
            backend.weights_updated(version, run=self.run_id)
            return
        super().update_weights(named, version)


def adapter_config_dict(adapter_config: Any) -> dict:
    """A peft LoraConfig (or its dict) as adapter_config.json would hold it."""
    config = adapter_config.to_dict() if hasattr(adapter_config, "to_dict") else dict(adapter_config)
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    return json.loads(json.dumps(config, default=str))
