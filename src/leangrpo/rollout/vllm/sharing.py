"""One copy of the weights: colocated vLLM and the policy share memory (`rollout.vllm.share_weights`).

vLLM starts first, in this process, and owns the tensors (it allocates its fused
parameters and copies the checkpoint into them); the policy is then a transformers model
whose parameters are views of those tensors (views.py). Nothing is copied, and an
optimizer step on the policy is an update of the weights vLLM serves.

- In-process: `VLLM_ENABLE_V1_MULTIPROCESSING=0` while the LLM is built, so its engine core
  and worker run here (`InprocClient`, `UniProcExecutor`) and `collective_rpc` passes live
  objects (worker.py `SharingExtension`); local.py puts back what such a start changes
  in the trainer's process. Proven, not assumed: the worker reports its process id and
  its parameters' storages (`leangrpo_whereabouts`, plain numbers that survive any
  serialiser), and the model `collective_rpc` hands over must hold exactly those
  storages, so a pickled copy (another executor, another process) is never "shared".
- Order of the checks, so that a refusal leaves an engine that works as with
  `share_weights: false`: before vLLM starts, what the config and the files tell
  (precheck.py: then no shared engine starts at all); once it runs and before anything
  of vLLM's changes, the engine (in-process, no shards, no quantization), the layout
  (views.py `check_layout`: names, ties, shapes, dtypes, checkpoint names, with the
  weights vLLM emptied on CPU planned from their layers). Only then, on CPU, vLLM's
  packed linear weights become plain tensors (`leangrpo_plain_weights`), and the checks
  that need values run (each view equals the checkpoint's tensor; transformers and peft
  keep every view). A refusal there puts vLLM's own processing back
  (`leangrpo_vllm_weights`: each changed layer processed again as at load, packed and
  emptied), so file syncs (`reload_weights`) find the layers vLLM recorded. With
  `share_weights: auto` one log line says why, with `true` the run stops with it (the
  engine closed).
- CPU: vLLM prepacks linear weights for oneDNN and empties them, so they are served as
  plain tensors with `F.linear` again (slower in decode batches, see
  benchmarks/RESULTS.md), and vLLM runs eagerly (a compiled graph holds the packed
  kernels).
- Sync: full fine-tuning updates vLLM's tensors in place, so a sync is a prefix-cache
  reset (its KV came from the old weights) and the version; tensors that are not vLLM's
  own (a checkpoint's, say) are copied into the one copy, the policy's too, never
  through vLLM's reload, which would replace the tensors the policy views. LoRA adapters
  are handed over as tensors (copies: vLLM keeps what it is given) under a name, id and
  path unique per version (local.py `AdapterSlots.in_memory`), so no prefix-cache reset
  is needed; `adapter_sync: files` keeps the file round trip. An engine that does not
  share (a refusal) syncs through files, as with `share_weights: false`.
- Standby (sync mode, GPUs with sleep mode): while the trainer trains, scheduling is
  paused and only the KV cache is released (`release_kv_cache_memory`); it comes back
  for the next request. Sleep levels 1 and 2 would unmap the shared weights under the
  trainer, so they are never used here. CPU vLLM has no sleep mode (logged once).

Tested with vLLM 0.32.x (`TESTED_VLLM`); the vLLM internals this reads are listed in
docs/shared-weights.md ("vLLM internals read, and the tested range").
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

from leangrpo.contracts import EngineVersionError
from leangrpo.errors import RunError
from leangrpo.model.policy import Policy, build_policy, resolve_dtype
from leangrpo.rollout.vllm.engine import VLLMEngine, make_vllm_engine
from leangrpo.rollout.vllm.files import is_lora_name, saved_lora_name
from leangrpo.rollout.vllm.local import LocalVLLM, _platform_is_cpu, import_vllm
from leangrpo.rollout.vllm.precheck import share_blocker
from leangrpo.rollout.vllm.views import (
    NotShared,
    base_tensors,
    check_layout,
    checkpoint_mismatch,
    model_on_views,
    unique_tensors,
    unshared_parameters,
    vllm_views,
)

log = logging.getLogger("leangrpo")

TESTED_VLLM = ("0.32.0", "0.33")  # low <= vLLM < high


# --------------------------------------------------------------------------- set-up


@dataclass
class SharedStart:
    """A colocated engine started before the policy, and the views the policy is built on
    (None: it keeps two copies)."""

    engine: SharedVLLMEngine
    views: dict[str, torch.Tensor] | None
    storages: set[int]

    def build_policy(self, cfg, tokenizer, device: torch.device) -> Policy | None:
        """The policy on vLLM's tensors; None (after saying why and giving vLLM its own
        layers back) when they cannot be shared. Stopping (share_weights: true, or any
        failure) closes the engine."""
        if self.views is None:
            return None
        backend = self.engine.backend
        try:
            try:
                policy = _policy_on_views(cfg, tokenizer, device, self.views)
            except NotShared as problem:
                self.views = None
                backend.serve_own_weights()
                keep_two_copies(cfg, problem, runtime=True)
                return None
        except BaseException:
            self.engine.close()
            raise
        backend.share(self.storages, base_tensors(policy.model))
        bytes_ = sum(t.numel() * t.element_size() for t in unique_tensors(self.views.values()))
        log.info(
            "colocated vLLM and the policy share one copy of the weights (%d tensors, %.2f GiB)",
            len(self.views),
            bytes_ / 2**30,
        )
        return policy


def start_shared_vllm(cfg, device: torch.device) -> SharedStart | None:
    """Colocated vLLM set up to share its weights with the policy: started before the
    policy, in this process. None (after saying why) when the config, the files or the
    installed vLLM rule sharing out before anything starts."""
    try:
        _check_before_start(cfg, device)
    except NotShared as problem:
        keep_two_copies(cfg, problem, runtime=False)
        return None
    dtype = resolve_dtype(cfg.model.dtype, device)
    engine = make_vllm_engine(cfg, None, SharedVLLMEngine, dtype=str(dtype).removeprefix("torch."))
    try:
        try:
            storages, views = engine.backend.shareable_views(cfg.model, dtype, device)
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
    dtype = str(resolve_dtype(cfg.model.dtype, device)).removeprefix("torch.")
    blocker = share_blocker(cfg, dtype)
    if blocker is not None:
        raise NotShared(*blocker)
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
    them (empty: it does not, and every sync goes through files as in `LocalVLLM`);
    `tensors`: the policy's base parameters by transformers name (vLLM's memory)."""

    def __init__(self, llm_kwargs: dict, work_dir: Path, run: str | None = None):
        self.on_cpu = _platform_is_cpu()
        with in_process():
            super().__init__(shared_llm_kwargs(llm_kwargs, self.on_cpu), work_dir, run)
        self.storages: set[int] = set()
        self.tensors: dict[str, torch.Tensor] = {}

    def shareable_views(
        self, model_cfg, dtype: torch.dtype, device: torch.device
    ) -> tuple[set[int], dict[str, torch.Tensor]]:
        """vLLM's storages and the transformers-named views of its tensors (CPU: served
        as plain tensors first); NotShared when they cannot be, raised before anything of
        vLLM's changes where the reason is known then, else after `serve_own_weights`."""
        model, storages = self._model_in_this_process()
        planned, problems = vllm_views(model, stand_ins=True)
        if problems:
            raise NotShared(f"vLLM's {problems[0]}, which transformers' layers cannot view")
        check_layout(model_cfg, planned, dtype)
        elsewhere = sorted({str(p.device) for p in model.parameters()} - {_device_name(device)})
        if elsewhere:
            raise NotShared(f"vLLM's tensors are on {elsewhere[0]}, the trainer's on {device}")
        try:
            views = self._plain_views(model)
        except BaseException:
            self.serve_own_weights()
            raise
        return {p.untyped_storage().data_ptr() for p in model.parameters()}, views

    def _model_in_this_process(self) -> tuple[torch.nn.Module, set[int]]:
        """vLLM's live model, proven to be the one its worker serves from."""
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
        workers = self.call_workers("leangrpo_whereabouts")
        pid, storages = workers[0]
        if len(workers) != 1 or pid != os.getpid():
            raise NotShared(
                f"vLLM's worker runs in another process (pid {pid}, the trainer's is {os.getpid()}), so the policy could only view a copy of its weights"
            )
        (model,) = self.call_workers("leangrpo_model")
        if {p.untyped_storage().data_ptr() for p in model.parameters()} != set(storages):
            raise NotShared("the model vLLM's worker handed over is a copy of the one it serves from")
        return model, set(storages)

    def _plain_views(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The views once every weight is a plain tensor vLLM computes with (CPU: its
        packed copies replaced, `leangrpo_plain_weights`)."""
        if self.on_cpu:
            (empty,) = self.call_workers("leangrpo_plain_weights")
            self.llm.reset_prefix_cache()
            if empty:
                raise NotShared(f"vLLM's layer {empty[0]} keeps no plain weight on CPU")
        views, problems = vllm_views(model)
        if problems:
            raise NotShared(f"vLLM's {problems[0]}, which transformers' layers cannot view")
        return views

    def serve_own_weights(self) -> None:
        """After a refusal: vLLM's layers as it processed them at load (CPU: packed again),
        so the engine works as one that never shared (file syncs included)."""
        self.storages, self.tensors = set(), {}
        if self.on_cpu:
            self.call_workers("leangrpo_vllm_weights")
            self.llm.reset_prefix_cache()

    def share(self, storages: set[int], tensors: dict[str, torch.Tensor]) -> None:
        """The policy now views vLLM's tensors: syncs go in place from here on."""
        self.storages, self.tensors = storages, tensors

    def owns(self, named: list[tuple[str, torch.Tensor]]) -> bool:
        """Every tensor lies in vLLM's storages (the policy's own views, while shared)."""
        return bool(self.storages) and all(
            t.untyped_storage().data_ptr() in self.storages for _, t in named
        )

    def weights_updated(self, version: int, *, run: str | None) -> None:
        """The shared weights changed in place: forget the KV computed from the old ones."""
        with self.gate.update(version, drain=True, run=run) as needed:
            if needed:
                with self._lock:
                    self._base_changed_locked(run)

    def write_weights(self, named: list[tuple[str, torch.Tensor]], version: int, *, run: str | None) -> None:
        """Full weights that are not vLLM's own tensors, copied into the one copy (the
        policy's too): vLLM keeps serving the tensors the policy views. Every name and
        shape is checked before anything is written."""
        pairs = []
        for name, tensor in named:
            target = self.tensors.get(name)
            if target is None:
                raise ValueError(
                    f"{name} is not one of the weights colocated vLLM shares with the policy; sync the policy's own parameters (checkpoint names)"
                )
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"{name} has shape {tuple(tensor.shape)}, the shared weight {tuple(target.shape)}"
                )
            pairs.append((target, tensor))
        with self.gate.update(version, drain=True, run=run) as needed:
            if not needed:
                return
            with self._lock, torch.no_grad():
                for target, tensor in pairs:
                    target.copy_(tensor)  # a tensor onto itself (the policy's own) is a no-op
                self._base_changed_locked(run)

    def _base_changed_locked(self, run: str | None) -> None:
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
        if not named or not backend.storages:  # not shared: files, as two copies do
            super().update_weights(named, version)
        elif is_lora_name(named[0][0]):
            if self.settings.adapter_sync == "memory" and self.adapter_config is not None:
                config = adapter_config_dict(self.adapter_config)
                backend.load_adapter_tensors(named, config, version, run=self.run_id)
            else:
                super().update_weights(named, version)
        elif backend.owns(named):  # the optimizer wrote into vLLM's tensors
            backend.weights_updated(version, run=self.run_id)
        else:  # other tensors: into the one copy, never through vLLM's reload
            backend.write_weights(named, version, run=self.run_id)


def adapter_config_dict(adapter_config: Any) -> dict:
    """A peft LoraConfig (or its dict) as adapter_config.json would hold it."""
    config = adapter_config.to_dict() if hasattr(adapter_config, "to_dict") else dict(adapter_config)
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    return json.loads(json.dumps(config, default=str))
