"""The policy: loading, LoRA, gradient checkpointing, and the packed scoring forward.

Scoring never builds logits for prompt tokens: the backbone runs once over the packed row
(real tokens only), the final hidden states are gathered at the T positions that predict
completion tokens, and the chunked lm_head turns those (T, H) rows into log-probs without
ever holding a (T, V) tensor. Reference log-probs come from the same forward with LoRA
adapters disabled, or from a frozen copy when training all weights with beta > 0; they are
unfiltered (temperature only): KL to a top-k / min-p filtered reference is +inf for any
token outside the reference's set, which becomes near-certain once the policy drifts.

For FSDP2 (fsdp.py) the chunked lm_head can be a module (`ChunkedLMHead`, the same
parameters under the same names) and the whole scoring pass a module (`PackedScorer`), so
that every weight is read inside a forward, where FSDP has gathered it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from leangrpo.attention import enable_packed_attention, packed_model_kwargs
from leangrpo.config_io import ConfigError
from leangrpo.contracts import PackedBatch, SamplingParams
from leangrpo.logprobs import token_logprobs
from leangrpo.offload import ActivationOffloader, enable_gradient_checkpointing

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
    offloader: ActivationOffloader | None = None
    attention_backend: str = "sdpa_segments"
    root: nn.Module | None = None  # torchrun: the FSDP root (a PackedScorer around model)

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


def load_tokenizer(model_cfg) -> Any:
    from transformers import AutoTokenizer

    from leangrpo.model_files import ModelFilesError

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


def load_policy(
    cfg, tokenizer, device: torch.device, *, reference_on_meta: bool = False
) -> Policy:
    """Model from cfg.model, wrapped with LoRA if asked, packed attention, checkpointing.

    `reference_on_meta` (torchrun): a full fine-tuning reference is a `meta_copy`, filled
    from the policy's shards once sharded (fsdp.shard_policy), not a second full copy."""
    from transformers import AutoModelForCausalLM

    from leangrpo.model_files import ModelFilesError

    name = cfg.model.name_or_path
    try:  # mismatched shapes are reported in `info` (and refused below), not raised
        model, info = AutoModelForCausalLM.from_pretrained(
            name,
            dtype=resolve_dtype(cfg.model.dtype, device),
            revision=cfg.model.revision,
            trust_remote_code=cfg.model.trust_remote_code,
            output_loading_info=True,
            ignore_mismatched_sizes=True,
        )
    except (OSError, ValueError) as exc:  # unknown model_type or architecture, unreadable files
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise ModelFilesError(
            f"model.name_or_path = {name!r}: the model could not be loaded ({type(exc).__name__}: {first}); check config.json (model_type, architectures) and the weight files."
        ) from None
    model = model.to(device)
    refuse_broken_weights(model, info, name)
    return build_policy(model, cfg, tokenizer, device, reference_on_meta=reference_on_meta)


def refuse_broken_weights(model: nn.Module, info: dict, name: str) -> None:
    """Training must start from the checkpoint's weights: transformers initialises missing
    or wrongly shaped tensors at random with only a warning, and NaN weights fail later,
    deep in sampling."""
    from leangrpo.model_files import ModelFilesError

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
            f"model.name_or_path = {name!r} does not hold a usable checkpoint for its config.json ({'; '.join(problems)}); download or save the model again."
        )


def build_policy(
    model: nn.Module, cfg, tokenizer, device: torch.device, *, reference_on_meta: bool = False
) -> Policy:
    """Wrap a loaded causal LM as cfg asks (benchmarks pass randomly initialised ones).
    `reference_on_meta`: see `load_policy`."""
    refuse_scaled_logits(model.config)
    backend = enable_packed_attention(model, cfg.packing.attention_backend)
    reference = None
    if cfg.loss.beta > 0 and not cfg.lora.enabled:
        frozen = meta_copy(model) if reference_on_meta else copy.deepcopy(model)
        reference = frozen.eval().requires_grad_(False)
    if cfg.lora.enabled:
        model = _wrap_lora(model, cfg.lora)
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
    return Policy(model, tokenizer, reference, device, cfg.lora.enabled, offloader, backend)


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` whose parameters are on the meta device (no storage), each
    with its source's shape, dtype and requires_grad (tied ones stay tied); buffers are
    copied. Torchrun: the reference and the hf engine's own copy start as this and are
    filled from the policy's shards (fsdp.py), so no rank holds a second full copy."""
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


def _wrap_lora(model: nn.Module, lora_cfg) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=lora_cfg.target_modules,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def backbone_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    lm = causal_lm(model)
    return lm.get_decoder(), lm.get_output_embeddings()


def completion_hidden(model: nn.Module, batch: PackedBatch) -> torch.Tensor:
    """Final hidden states (T, H) at the positions that predict completion tokens."""
    backbone, _ = backbone_and_head(model)
    out = backbone(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        use_cache=False,
        **packed_model_kwargs(batch),
    )
    return out.last_hidden_state[0].index_select(0, batch.completion_index)


def score(
    model: nn.Module,
    batch: PackedBatch,
    sampling: SamplingParams,
    logprob_cfg,
    *,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-completion-token log-probs (T,) under the engine's sampling transformation."""
    if isinstance(model, PackedScorer):  # the FSDP root: its forward gathers the root unit
        return model(batch, sampling, logprob_cfg, with_entropy=with_entropy)
    if any(_is_dtensor(p) for p in causal_lm(model).parameters()):
        raise RuntimeError(
            "score(): the model is FSDP-sharded; score through the PackedScorer that "
            "leangrpo.fsdp.shard_model returned, so that the sharded weights are gathered"
        )
    return _score(model, batch, sampling, logprob_cfg, with_entropy)


def _score(model, batch, sampling, logprob_cfg, with_entropy: bool):
    """score() without the check (inside the FSDP root's forward, units not yet reached
    still hold sharded weights; each unit's forward gathers its own)."""
    hidden = completion_hidden(model, batch)
    _, head = backbone_and_head(model)
    options = {
        "chunked": logprob_cfg.chunked,
        "compile": getattr(logprob_cfg, "compile", False),  # duck-typed test configs lack it
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "with_entropy": with_entropy,
        "row_tile": logprob_cfg.row_tile,
        "vocab_tile": logprob_cfg.vocab_tile,
    }
    if isinstance(head, ChunkedLMHead):  # a module call: FSDP gathers the head around it
        return head(hidden, batch.targets, **options)
    return token_logprobs(
        hidden, head.weight, batch.targets, getattr(head, "bias", None), **options
    )


def reference_sampling(sampling: SamplingParams) -> SamplingParams:
    """The reference's transformation: the engine's temperature, no top-k/top-p/min-p."""
    return dataclasses.replace(sampling, top_k=0, top_p=1.0, min_p=0.0)


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class ChunkedLMHead(nn.Module):
    """The lm_head as a module whose forward can return chunked log-probs.

    It takes over the original head's `weight` (and `bias`) Parameter objects, so names
    (`lm_head.weight`), tying to the input embeddings and saved checkpoints are unchanged.
    `head(hidden)` returns logits as nn.Linear does (generation, plain forwards);
    `head(hidden, targets, **options)` returns `token_logprobs(...)`. Under FSDP2 the head
    is its own unit (or part of the root's) and the weight is only read inside a forward,
    when it is gathered, never as a sharded DTensor.
    """

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.weight = linear.weight
        self.bias = getattr(linear, "bias", None)
        self.in_features, self.out_features = self.weight.shape[1], self.weight.shape[0]

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None, **options):
        if targets is None:
            return nn.functional.linear(hidden, self.weight, self.bias)
        return token_logprobs(hidden, self.weight, targets, self.bias, **options)


def install_chunked_head(model: nn.Module) -> ChunkedLMHead:
    """Replace the causal LM's output embeddings by a ChunkedLMHead (idempotent)."""
    lm = causal_lm(model)
    head = lm.get_output_embeddings()
    if isinstance(head, ChunkedLMHead):
        return head
    if not isinstance(head, nn.Linear):
        raise TypeError(
            f"the output embeddings are a {type(head).__name__}, not nn.Linear; the chunked "
            "lm_head needs a plain linear head (is lm_head a LoRA target? drop it from "
            "lora.target_modules)"
        )
    chunked = ChunkedLMHead(head)
    lm.set_output_embeddings(chunked)
    return chunked


class PackedScorer(nn.Module):
    """The packed scoring forward (backbone + chunked head) as one module call.

    FSDP2 gathers a unit's parameters in its forward pre-hook, so whatever is left outside
    the per-layer units (embeddings, final norm, a tied head) must be read inside some
    module's forward: this one is the root unit. `scorer(batch, sampling, logprob_cfg)`
    equals `score(model, ...)`.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: PackedBatch, sampling, logprob_cfg, with_entropy: bool = False):
        return _score(self.model, batch, sampling, logprob_cfg, with_entropy)


@torch.no_grad()
def reference_logprobs(policy: Policy, batch: PackedBatch, sampling, logprob_cfg) -> torch.Tensor:
    """Unfiltered log-probs of the reference policy: adapters off (LoRA) or the frozen copy."""
    sampling = reference_sampling(sampling)
    if policy.reference is not None:
        return score(policy.reference, batch, sampling, logprob_cfg)[0]
    if not policy.is_lora:
        raise RuntimeError("a reference pass was asked for but no reference policy exists")
    with policy.model.disable_adapter():
        return score(policy.scoring_module, batch, sampling, logprob_cfg)[0]


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """No dropout for the no-grad scoring passes, restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
