"""vLLM's tensors as transformers' parameters: the views the shared policy is built on
(sharing.py), and every check that they mean what their names say.

- Views (`vllm_views`): a fused parameter (`packed_modules_mapping`: qkv_proj, gate_up_proj)
  is split along its output dimension by the layer's `output_partition_sizes`; the
  vocabulary rows vLLM pads to a multiple of 64 are sliced off (`org_vocab_size`); LoRA
  wrappers' `.base_layer` is dropped from the names. `model_on_views` builds the
  transformers model with `from_pretrained(None, config=, state_dict=views)`, which wraps
  each view in a Parameter of its own without copying it.
- Checked before vLLM's layers are touched (`check_layout`; on CPU the linear weights are
  still packed and emptied then, so each emptied weight is planned from its layer's
  partition sizes as a meta tensor, `stand_ins=True`): the names map onto the
  transformers model's parameters (a skeleton on the meta device: names, ties, shapes,
  dtypes), and the checkpoint holds a safetensors tensor under one name of each.
- Checked once the views hold values (`model_on_views`, `checkpoint_mismatch`): every
  view equals the checkpoint's tensor of its name (read a tensor at a time: what catches
  a layout that maps by shape but not by meaning, say an interleaved gate/up), and
  transformers kept each view instead of copying it; after LoRA wrapping and
  checkpointing, every base parameter of the policy still is its view
  (`unshared_parameters`).

Any failure raises `NotShared` with the reason; sharing.py decides what follows.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from leangrpo.model.files import local_safetensors
from leangrpo.model.policy import quiet_transformers_progress


class NotShared(Exception):
    """Why the weights cannot be shared (the message; `fix`: what would allow it)."""

    def __init__(self, why: str, fix: str = "a model and settings vLLM serves as plain tensors"):
        super().__init__(why)
        self.why, self.fix = why, fix


def vllm_views(
    vmodel: nn.Module, stand_ins: bool = False
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """{transformers name: view of a vLLM tensor}, and what could not be mapped.

    Each value is a `detach()`ed view: transformers wraps it in a Parameter of its own, so
    the trainer's `requires_grad_` never touches vLLM's parameters. `stand_ins`: a weight
    vLLM emptied (CPU: packed for oneDNN) is given as a meta tensor of the shape it has
    once plain again (its layer's partition sizes x input size), so the layout can be
    checked before anything changes."""
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
            p = _planned(module, p) if stand_ins else p.detach()
            if leaf in packed:  # fused: [sum of parts, in] -> one view per part
                parts = packed[leaf]
                sizes = list(getattr(module, "output_partition_sizes", None) or [])
                if len(sizes) != len(parts) or sum(sizes) != p.shape[0]:
                    problems.append(f"{name}.{pname} fuses {parts} in sizes {sizes}")
                    continue
                for part, view in zip(parts, torch.split(p, sizes, dim=0)):
                    views[f"{prefix}.{part}.{pname}" if prefix else f"{part}.{pname}"] = view
            elif pname == "weight" and hasattr(module, "org_vocab_size"):
                views[f"{name}.weight"] = p[: module.org_vocab_size]  # padding rows off
            else:
                views[f"{name}.{pname}"] = p
    return views, problems


def _planned(module: nn.Module, p: torch.Tensor) -> torch.Tensor:
    """`p`, or for a linear weight vLLM emptied, a meta tensor of its plain shape."""
    sizes = getattr(module, "output_partition_sizes", None)
    if p.numel() or not sizes or p is not getattr(module, "weight", None):
        return p.detach()
    columns = getattr(module, "input_size_per_partition", getattr(module, "input_size", 0))
    return torch.empty((sum(sizes), columns), dtype=p.dtype, device="meta")


def causal_lm_skeleton(model_cfg, dtype: torch.dtype) -> nn.Module:
    """The transformers causal LM of `model_cfg` on the meta device (no memory)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_cfg.name_or_path, revision=model_cfg.revision)
    with torch.device("meta"):
        return causal_lm_class(config)._from_config(config, dtype=dtype)


def causal_lm_class(config) -> type:
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise NotShared(f"transformers has no causal LM class for {type(config).__name__}") from None


def check_layout(model_cfg, views: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Before vLLM's layers change: the views (stand-ins allowed) are exactly the
    transformers model's parameters (every name known, each tied group present once at
    least, shapes and dtypes equal), and the checkpoint names one tensor of each group."""
    skeleton = causal_lm_skeleton(model_cfg, dtype)
    groups: dict[int, list[str]] = {}
    for name, param in skeleton.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    params = dict(skeleton.named_parameters(remove_duplicate=False))
    where = f"vLLM's tensors do not map onto {type(skeleton).__name__}"
    unexpected = sorted(set(views) - set(params))
    if unexpected:
        raise NotShared(f"{where}: unexpected key {unexpected[0]}")
    missing = [names[0] for names in groups.values() if not any(n in views for n in names)]
    if missing:
        raise NotShared(f"{where}: missing key {missing[0]}")
    for name, view in views.items():
        if view.shape != params[name].shape:
            raise NotShared(
                f"{where}: mismatched key {name} ({tuple(view.shape)} in vLLM, {tuple(params[name].shape)} in transformers)"
            )
        if view.dtype != dtype:
            raise NotShared(f"vLLM holds {name} in {view.dtype}, not {dtype}")
    _check_checkpoint_names(model_cfg, list(groups.values()))


def _check_checkpoint_names(model_cfg, groups: list[list[str]]) -> None:
    from safetensors import safe_open

    files = local_safetensors(model_cfg)
    if not files:
        raise NotShared(no_checkpoint(model_cfg))
    keys: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            keys.update(f.keys())
    for names in groups:
        if not any(n in keys for n in names):
            raise NotShared(
                f"{names[0]} is not in the checkpoint under that name, so vLLM's tensor for it cannot be checked"
            )


def no_checkpoint(model_cfg) -> str:
    return f"no .safetensors checkpoint of {model_cfg.name_or_path} to check vLLM's tensors against"


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
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_cfg.name_or_path, revision=model_cfg.revision)
    model_class = causal_lm_class(config)
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

    files = local_safetensors(model_cfg)
    if not files:
        return no_checkpoint(model_cfg)
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


def unshared_parameters(model: nn.Module, views: dict[str, torch.Tensor]) -> list[str]:
    """Base (non-LoRA) parameters of `model` that are not exactly their vLLM view (peft's
    `base_model.model.` prefix and `.base_layer` dropped from the names)."""
    unshared = []
    for name, param in model.named_parameters():
        if "lora_" in name:
            continue
        view = views.get(_transformers_name(name))
        if view is None or not same_memory(param, view):
            unshared.append(name)
    return unshared


def base_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """{transformers name: base parameter} of `model`, tied names included (what a full
    weight sync may name)."""
    return {
        _transformers_name(name): param.detach()
        for name, param in model.named_parameters(remove_duplicate=False)
        if "lora_" not in name
    }


def _transformers_name(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def unique_tensors(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[tuple, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)), t)
    return list(seen.values())
