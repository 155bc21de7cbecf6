"""Weights and LoRA adapters on disk, as the vLLM engines take them: full weights as
safetensors buckets of about `bucket_bytes` (tied weights written once), adapters as a
peft directory (config + safetensors; live peft names mapped to the saved ones). FSDP2
shards are gathered to whole tensors on the host first. An adapter is served from its
config and safetensors only (`adapter_files`: never a pickled `adapter_model.bin`),
copied into place atomically (`publish_adapter`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

DEFAULT_BUCKET_BYTES = 1 << 30  # 1 GiB of tensors per safetensors file


def is_lora_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name or ".lora_embedding_" in name


def _cpu_tensor(tensor: Tensor) -> Tensor:
    if hasattr(tensor, "full_tensor"):  # FSDP2 DTensor shard -> the whole tensor
        tensor = tensor.full_tensor()
    return tensor.detach().to("cpu").contiguous()


def write_weight_buckets(
    named_tensors: Iterable[tuple[str, Tensor]],
    directory: Path,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> list[Path]:
    """Write tensors as safetensors files of about `bucket_bytes` each; returns the paths."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    bucket: dict[str, Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal bucket, size
        path = directory / f"bucket-{len(paths):05d}.safetensors"
        save_file(bucket, str(path))
        paths.append(path)
        bucket, size = {}, 0

    seen_views: set[tuple] = set()
    seen_storages: set[int] = set()
    for name, tensor in named_tensors:
        t = _cpu_tensor(tensor)
        view = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        if view in seen_views:
            continue  # a tied weight (lm_head = embed_tokens): written once, under its first name
        seen_views.add(view)
        if view[0] in seen_storages:
            t = t.clone()  # another view of a storage already written: safetensors refuses aliases
        seen_storages.add(view[0])
        bucket[name] = t
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            flush()
    if bucket:
        flush()
    if not paths:
        raise ValueError(
            "update_weights got no tensors; pass model.named_parameters() or a state dict's items()"
        )
    return paths


def saved_lora_name(name: str) -> str:
    """Live peft parameter name -> the name peft saves (the adapter name dropped):
    `...q_proj.lora_A.default.weight` -> `...q_proj.lora_A.weight`."""
    name = re.sub(r"\.(lora_A|lora_B)\.(?!weight$)[^.]+\.weight$", r".\1.weight", name)
    return re.sub(r"\.(lora_embedding_A|lora_embedding_B)\.[^.]+$", r".\1", name)


def adapter_modules(names: Iterable[str]) -> list[str]:
    """The modules a LoRA adapter's tensors adapt (live or saved peft names -> the module
    path without peft's `base_model.model.`), once each, in order."""
    modules: dict[str, None] = {}
    for name in names:
        if is_lora_name(name):
            saved = saved_lora_name(name).removeprefix("base_model.model.")
            path = re.sub(r"\.(lora_A|lora_B)\.weight$|\.(lora_embedding_A|lora_embedding_B)$", "", saved)
            modules[path] = None
    return list(modules)


def unservable_modules(names: Iterable[str], servable: Iterable[str]) -> list[str]:
    """The adapted modules whose last name vLLM serves no LoRA on (its own rule:
    vllm.lora.worker_manager `expected_lora_modules`)."""
    allowed = set(servable)
    return [m for m in adapter_modules(names) if m.rpartition(".")[2] not in allowed]


def unservable_message(modules: list[str], servable: Iterable[str]) -> str:
    """One sentence: the adapter's modules vLLM would not serve, and what to do."""
    leaves = sorted({m.rpartition(".")[2] for m in modules})
    served = ", ".join(sorted(servable)) or "none: LoRA is off on that engine"
    more = f", and {len(modules) - 1} more" if len(modules) > 1 else ""
    return (
        f"lora.target_modules puts adapters on {', '.join(leaves)} ({modules[0]}{more}), which vLLM does not serve LoRA on for this model (it serves: {served}), so generation would run without that part of the adapter; remove them from lora.target_modules, or generate with rollout.engine: hf."
    )


def write_adapter(
    named_tensors: Iterable[tuple[str, Tensor]], adapter_config: Any, directory: Path
) -> Path:
    """Save LoRA tensors (live or saved peft names) + adapter_config.json as a peft adapter dir.

    `adapter_config`: a peft `LoraConfig` or its dict (`peft_config.to_dict()`)."""
    from safetensors.torch import save_file

    tensors = {
        saved_lora_name(name): _cpu_tensor(t) for name, t in named_tensors if is_lora_name(name)
    }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    if hasattr(adapter_config, "save_pretrained"):
        adapter_config.save_pretrained(str(directory))
    else:
        config = {
            k: sorted(v) if isinstance(v, set) else v for k, v in dict(adapter_config).items()
        }
        (directory / "adapter_config.json").write_text(json.dumps(config, default=str))
    return directory


def adapter_files(source: Path) -> list[Path]:
    """The files of a peft adapter directory that are served: its config and safetensors."""
    if not (source / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"no adapter_config.json in {source}; save the adapter with peft's model.save_pretrained(path)"
        )
    weights = sorted(p for p in source.glob("*.safetensors") if p.is_file())
    if not weights:
        raise FileNotFoundError(
            f"no .safetensors weights in {source} (a pickled adapter_model.bin is never loaded); "
            "save the adapter with save_pretrained(path, safe_serialization=True)"
        )
    return [source / "adapter_config.json", *weights]


def publish_adapter(source: Path, adapters_root: Path, name: str) -> Path:
    """Copy an adapter's config and safetensors to `adapters_root/name` atomically."""
    files = adapter_files(source)
    adapters_root.mkdir(parents=True, exist_ok=True)
    final = adapters_root / name
    if final.exists():
        shutil.rmtree(final)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=adapters_root))
    for item in files:
        shutil.copy2(item, staging / item.name)
    os.replace(staging, final)
    return final
