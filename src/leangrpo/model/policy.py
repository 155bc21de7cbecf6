"""The policy: loading (checked weights in aligned memory of their own, no scaled logits;
a quantized base for QLoRA, quantization.py), LoRA, dropout off for RL, gradient
checkpointing with optional activation offload, and the frozen reference copy for full
fine-tuning with beta > 0 (LoRA runs use the same model with adapters disabled, see
scoring.py), and a distillation teacher's slot (loaded by distill/teacher.py). `Policy`
is what the trainer, the engines and the sharding code share.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from leangrpo.config import ConfigError
from leangrpo.config.run import OUTPUT_HEAD_TARGET
from leangrpo.model.files import ModelFilesError
from leangrpo.model.moe.control import NO_ROUTING, NoRouting, RoutingControl, install_routing
from leangrpo.ops.attention.adapter import enable_packed_attention
from leangrpo.ops.offload import ActivationOffloader, enable_gradient_checkpointing

log = logging.getLogger("leangrpo")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Policy:
    """The trained model and what scoring needs to know about it."""

    model: nn.Module  # a transformers causal LM, or a peft model wrapping one
    tokenizer: Any
    reference: nn.Module | None  # frozen copy for full fine-tuning with beta > 0, else None
    device: torch.device
    is_lora: bool
    # mixture of experts with routing replay or the router's aux loss: the hooks' control
    # (model/moe/control.py); NO_ROUTING otherwise
    routing: RoutingControl | NoRouting = NO_ROUTING
    offloader: ActivationOffloader | None = None
    attention_backend: str = "sdpa_segments"
    root: nn.Module | None = None  # torchrun: the FSDP root (a PackedScorer around model)
    # distillation: the frozen teacher (distill/teacher.py; torchrun: its FSDP root), or None
    teacher: nn.Module | None = None

    @property
    def scoring_module(self) -> nn.Module:
        """What scoring passes call: the model, or its FSDP root once sharded."""
        return self.root if self.root is not None else self.model

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def named_trainable_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """What weight sync sends: the adapter only for LoRA, every weight otherwise."""
        if self.is_lora:
            return [(n, p.detach()) for n, p in self.model.named_parameters() if p.requires_grad]
        return [(n, t.detach()) for n, t in self.model.state_dict().items()]


def resolve_device(setting: str) -> torch.device:
    """Checked before the model loads; a missing GPU is the user's to fix (one sentence)."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise ConfigError(
            f"run.device is 'cuda' but {why} (torch.cuda.is_available() is False); set run.device: cpu or auto."
        )
    return torch.device(setting)


def resolve_dtype(setting: str, device: torch.device) -> torch.dtype:
    if setting != "auto":
        return DTYPES[setting]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def refuse_float16_full_finetuning(cfg, dtype: torch.dtype) -> None:
    """float16 weights updated in place by AdamW (no float32 master copy) lose every update
    below float16's resolution and turn non-finite within steps: refused (config/root.py
    refuses model.dtype: float16; this is 'auto' on a GPU without bfloat16)."""
    if dtype == torch.float16 and not cfg.lora.enabled:
        raise ConfigError(
            f"model.dtype: {cfg.model.dtype} resolves to float16 on this device (it has no bfloat16), and full fine-tuning would update float16 weights in place, which turns them non-finite within a few steps; set model.dtype: float32, or train LoRA adapters (lora.enabled: true), which stay float32 on a float16 base."
        )


def resolve_compute_dtype(model_cfg, dtype: torch.dtype) -> torch.dtype:
    """The dtype a quantized base's 4-bit layers compute in: model.quantization_compute_dtype,
    'auto' being the model's own."""
    setting = model_cfg.quantization_compute_dtype
    return dtype if setting == "auto" else DTYPES[setting]


def load_tokenizer(model_cfg) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            model_cfg.name_or_path,
            revision=model_cfg.revision,
            trust_remote_code=model_cfg.trust_remote_code,
        )
    except (OSError, ValueError) as exc:  # missing/corrupt files, unknown tokenizer class
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise ModelFilesError(
            f"model.name_or_path = {model_cfg.name_or_path!r}: the tokenizer could not be loaded ({type(exc).__name__}: {first}); check the tokenizer files."
        ) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_policy(cfg, tokenizer, device: torch.device, *, reference_on_meta: bool = False) -> Policy:
    """Model from cfg.model, wrapped with LoRA if asked, packed attention, checkpointing.

    `reference_on_meta` (torchrun): a full fine-tuning reference is a `meta_copy`, filled
    from the policy's shards once sharded (fsdp.shard_policy), not a second full copy."""
    dtype = resolve_dtype(cfg.model.dtype, device)
    refuse_float16_full_finetuning(cfg, dtype)
    quantized = cfg.model.quantization != "none"
    extra = {}
    if quantized:  # QLoRA: the base is quantized as it loads (model/quantization.py)
        from leangrpo.model.quantization import check_device, quantized_load_kwargs

        check_device(cfg, device)
        extra = quantized_load_kwargs(cfg.model, device, resolve_compute_dtype(cfg.model, dtype))
    model = load_causal_lm(
        cfg.model.name_or_path, "model.name_or_path", device, dtype,
        revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code, **extra,
    )  # fmt: skip
    return build_policy(model, cfg, tokenizer, device, reference_on_meta=reference_on_meta)


def load_causal_lm(
    name: str, key: str, device: torch.device, dtype: torch.dtype, *, own_memory: bool = True,
    **kwargs,
) -> nn.Module:
    """A transformers causal LM from `name` (the config key `key` names it) on `device`:
    quantized as it loads when `kwargs` holds a `quantization_config` (then made safe,
    model/quantization.py), in memory of its own (`own_memory`; else CPU tensors may stay
    views into the memory-mapped weight files), its weights checked. The policy's and the
    distillation teacher's loading path."""
    from transformers import AutoModelForCausalLM

    try:  # mismatched shapes are reported in `info` (and refused below), not raised
        model, info = AutoModelForCausalLM.from_pretrained(
            name, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
        )
    except (OSError, ValueError) as exc:  # unknown model_type or architecture, unreadable files
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise ModelFilesError(
            f"{key} = {name!r}: the model could not be loaded ({type(exc).__name__}: {first}); check config.json (model_type, architectures) and the weight files."
        ) from None
    if "quantization_config" in kwargs:
        from leangrpo.model.quantization import prepare_quantized

        prepare_quantized(model, device)  # before any forward (the packed-attention probe)
    model = model.to(device)
    if own_memory:
        own_aligned_memory(model)
    refuse_broken_weights(model, info, name, key)
    return model


ALIGNMENT_BYTES = 64  # c10's CPU allocator (c10/core/alignment.h); CUDA's aligns to more


def own_aligned_memory(model: nn.Module) -> None:
    """Move every CPU tensor of `model` that does not start on a 64-byte boundary into
    memory of its own (the allocator's, aligned).

    transformers loads CPU weights as views into the memory-mapped safetensors file, so a
    tensor starts wherever the file's header ends (40 bytes past a boundary for the tool
    demo's model), while every copy of the model (the async engine's, the reference) is
    aligned. oneMKL's one-row products (sgemm with M = 1: each decode step of one row)
    round by the weights' alignment, so the same forward on the model and on its copy
    differed in the last bits and async at staleness 0 did not equal sync. Aligned, the
    model and its copies run the same kernels on the same layout, on every CPU. Tied
    tensors stay tied (a Parameter object is moved once, and stays the same object)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    for tensor in tensors.values():
        if tensor.device.type == "cpu" and tensor.data_ptr() % ALIGNMENT_BYTES:
            tensor.data = tensor.data.clone(memory_format=torch.contiguous_format)


def refuse_broken_weights(
    model: nn.Module, info: dict, name: str, key: str = "model.name_or_path"
) -> None:
    """Training must start from the checkpoint's weights: transformers initialises missing
    or wrongly shaped tensors at random with only a warning, and NaN weights fail later,
    deep in sampling."""

    def listed(keys: list[str]) -> str:
        return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")

    problems = []
    if info.get("missing_keys"):
        problems.append(f"tensors missing from the weights: {listed(sorted(info['missing_keys']))}")
    if info.get("mismatched_keys"):
        shapes = sorted(
            f"{k} {tuple(got)} instead of {tuple(want)}" for k, got, want in info["mismatched_keys"]
        )
        problems.append(f"tensors of the wrong shape: {listed(shapes)}")
    if not problems:
        bad = [
            n
            for n, t in model.state_dict().items()
            if t.is_floating_point() and not torch.isfinite(t).all()
        ]
        if bad:
            problems.append(f"tensors holding NaN or inf: {listed(bad)}")
    if problems:
        raise ModelFilesError(
            f"{key} = {name!r} does not hold a usable checkpoint for its config.json ({'; '.join(problems)}); download or save the model again."
        )


def build_policy(
    model: nn.Module, cfg, tokenizer, device: torch.device, *, reference_on_meta: bool = False
) -> Policy:
    """Wrap a loaded causal LM as cfg asks (benchmarks pass randomly initialised ones).
    `reference_on_meta`: see `load_policy`."""
    refuse_scaled_logits(model.config)
    backend = enable_packed_attention(model, cfg.packing.attention_backend)
    # before any copy: the reference and the engines' copies get controls of their own
    routing = install_routing(
        model, replay=cfg.rollout.routing_replay, aux_coef=cfg.train.router_aux_loss_coef
    )
    reference = None
    if cfg.loss.beta > 0 and not cfg.lora.enabled:
        frozen = meta_copy(model) if reference_on_meta else copy.deepcopy(model)
        reference = frozen.eval().requires_grad_(False)
    if cfg.lora.enabled:
        model = _wrap_lora(model, cfg.lora, cfg.model.revision)
    if cfg.model.disable_dropout:
        disable_dropout(model)
    offloader = None
    if cfg.model.gradient_checkpointing or cfg.offload.activations != "none":
        offloader = enable_gradient_checkpointing(
            model,
            offload=cfg.offload.activations,
            keep_on_device=cfg.offload.keep_last_layers,
            min_tensor_bytes=cfg.offload.min_tensor_bytes,
        )
    model.train()
    return Policy(
        model,
        tokenizer,
        reference,
        device,
        cfg.lora.enabled,
        routing or NO_ROUTING,
        offloader,
        backend,
    )


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` whose parameters are on the meta device (no storage), each
    with its source's shape, dtype and requires_grad (tied ones stay tied); buffers are
    copied. Torchrun: the reference and the hf engine's own copy start as this and are
    filled from the policy's shards (distributed/fsdp.py), so no rank holds a second full copy."""
    memo: dict[int, Any] = {
        id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for p in model.parameters()
    }
    return copy.deepcopy(model, memo)


def disable_dropout(model: nn.Module) -> int:
    """Zero every dropout in `model`; returns how many were non-zero.

    Two kinds exist: `nn.Dropout` modules (TRL's `disable_dropout_in_model` zeroes only
    these) and float attributes that the module passes to a functional call, such as
    transformers' `attention_dropout` (given to the attention kernel in train mode); the
    model's config is left untouched, so a saved model keeps its dropout settings.
    """
    changed = 0
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            changed += module.p > 0
            module.p = 0.0
            continue
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float) and value > 0:
                setattr(module, name, 0.0)
                changed += 1
    return changed


SCALED_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def refuse_scaled_logits(config) -> None:
    """The chunked lm_head computes hidden @ W.T (+ b) / temperature and nothing else."""
    for name in SCALED_LOGITS:
        value = getattr(getattr(config, "text_config", None) or config, name, None)
        if value not in (None, 1, 1.0):
            raise ValueError(
                f"model.name_or_path: this architecture transforms its logits ({name}={value}), "
                "which leangrpo's log-probs do not reproduce yet; use a model without it"
            )


def _wrap_lora(model: nn.Module, lora_cfg, revision: str | None) -> nn.Module:
    """`revision` (model.revision) is recorded in the adapter's config beside its base's
    name, so the saved adapter (final/) is loaded back onto the base it was trained on
    (model/final.py), not the hub's newest."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=lora_cfg.target_modules,
        task_type="CAUSAL_LM",
    )
    try:
        wrapped = get_peft_model(model, config, revision=revision)
    except ValueError as exc:  # peft's NoMatchingPeftModuleError, an unsupported module type
        held = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear)})  # fmt: skip
        raise ConfigError(
            f"lora.target_modules = {lora_cfg.target_modules!r} cannot be adapted ({str(exc).strip().splitlines()[0][:200]}); the model's linear modules are named {', '.join(held)}: name some of those, or use lora.target_modules: all-linear."
        ) from None
    refuse_bypassed_adapters(wrapped)
    return wrapped


def refuse_bypassed_adapters(model: nn.Module) -> None:
    """Scoring (scoring.py) runs the decoder (`get_decoder()`) and multiplies by the output
    head's weight itself: an adapter on any module outside the decoder (the head, whatever
    its name) would get no gradient and be left out of every log-prob, while generation,
    which runs the model's own forward, would use it."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    lm = model.get_base_model()
    inside = {id(m) for m in lm.get_decoder().modules()}
    bypassed = [
        name
        for name, module in lm.named_modules()
        if isinstance(module, BaseTunerLayer) and id(module) not in inside
    ]
    if bypassed:
        raise ConfigError(
            f"lora.target_modules {OUTPUT_HEAD_TARGET.format(modules=', '.join(bypassed))}."
        )


@contextlib.contextmanager
def quiet_transformers_progress() -> Iterator[None]:
    """No transformers progress bar ("Loading weights", "Writing model shards") under the
    training progress bar: for a model built from tensors in memory, or a save."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
