"""What a run leaves in `final/`, loaded back as the trainer had it, and an adapter merged
into its base as a new starting point.

`final/` of full fine-tuning is an ordinary Hugging Face model directory. Of a LoRA run it
is peft's adapter and the tokenizer, plus two notes on the base the adapter was trained on
(`write_adapter_notes`): `base_model.json` (the dtype the base was loaded in: model.dtype
as resolved, which the checkpoint's own dtype need not be) and, for a quantized base,
`quantization_config.json` (its `BitsAndBytesConfig`, model/quantization.py).

`load_final(path)` gives the trainer's model back: the base named in adapter_config.json at
the revision recorded there (model.revision, model/policy.py), in the recorded dtype, quantized
as recorded, with leangrpo's load-time fixes (`prepare_quantized`: bitsandbytes' CPU bf16
repack off, int8 layers in train mode), then the adapter; in eval mode. Loading by hand
misses them: on a CPU with AVX512-BF16 bitsandbytes repacks every 4-bit layer at its first
eval-mode no-grad forward into a bf16 kernel, and a base in the checkpoint's dtype is
another base for a run in another dtype: either gives other outputs than the trained
policy's.

`merge_adapter(source, out)` (`leangrpo merge`) writes the adapter merged into its base,
unquantized, in the run's dtype, with the tokenizer: a full model directory a new run can
start from (model.name_or_path). A QLoRA adapter is merged into the full-precision base,
which that run quantizes again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leangrpo.model.files import ADAPTER_CONFIG, ModelFilesError, check_merge
from leangrpo.model.policy import DTYPES, own_aligned_memory, quiet_transformers_progress
from leangrpo.model.quantization import NOTE_FILE, prepare_quantized, write_quantization_note

log = logging.getLogger("leangrpo")

BASE_NOTE = "base_model.json"

# -- writing (the checkpointers call this) -------------------------------------------------


def write_adapter_notes(model: nn.Module, directory: str | Path) -> None:
    """`base_model.json` (and `quantization_config.json` for a quantized base) beside an
    adapter saved from `model`; nothing for a model without adapters."""
    if not hasattr(model, "peft_config"):
        return
    dtype = model.get_input_embeddings().weight.dtype
    note = {"dtype": str(dtype).removeprefix("torch.")}
    text = json.dumps(note, indent=2, sort_keys=True)
    (Path(directory) / BASE_NOTE).write_text(text + "\n", encoding="utf-8")
    write_quantization_note(model, directory)


# -- loading ---------------------------------------------------------------------------------


def load_final(
    path: str | Path, *, device: str | torch.device = "cpu", base: str | None = None
) -> nn.Module:
    """The model a run saved in `path` (its final/), in eval mode, computing what the
    trainer's model computed. `base`: where the adapter's base model is, when not where
    the run loaded it from (adapter_config.json's base_model_name_or_path)."""
    from peft import PeftModel

    path, device = Path(path), torch.device(device)
    if not (path / ADAPTER_CONFIG).is_file():
        return _load_full(path, device)
    base_model = load_base(path, device, base=base, quantized=True)
    with quiet_transformers_progress():
        model = PeftModel.from_pretrained(base_model, path)
    return model.eval()


def _load_full(path: Path, device: torch.device) -> nn.Module:
    from transformers import AutoModelForCausalLM

    if not (path / "config.json").is_file():
        raise ModelFilesError(
            f"{str(path)!r} holds neither a model (config.json) nor a LoRA adapter ({ADAPTER_CONFIG}); pass a run's final/ directory."
        )
    with quiet_transformers_progress():
        model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    model = model.to(device)
    own_aligned_memory(model)  # as the trainer's policy: the same bits on every CPU
    return model.eval()


def load_base(path: Path, device: torch.device, *, base: str | None, quantized: bool) -> nn.Module:
    """The base of the adapter in `path` as the run loaded it: its dtype, and (`quantized`)
    its quantization with leangrpo's load-time fixes; unquantized otherwise."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    adapter = _read_json(path / ADAPTER_CONFIG)
    name = base or adapter.get("base_model_name_or_path")
    if not name:
        raise ModelFilesError(
            f"{path / ADAPTER_CONFIG} names no base model (base_model_name_or_path); pass base= (the directory or hub name the run trained from)."
        )
    dtype = base_dtype(path)
    kwargs: dict[str, Any] = {}
    note = _read_json(path / NOTE_FILE) if quantized and (path / NOTE_FILE).is_file() else None
    if note is not None:
        kwargs = {
            "quantization_config": BitsAndBytesConfig.from_dict(note),
            "device_map": {"": str(device)},
        }
    try:
        with quiet_transformers_progress():
            model = AutoModelForCausalLM.from_pretrained(
                name, revision=adapter.get("revision"), dtype=dtype, **kwargs
            )
    except (OSError, ValueError) as exc:  # moved, deleted, not cached, unreadable
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise ModelFilesError(
            f"the base model of the adapter in {str(path)!r}, {name!r}, could not be loaded ({first}); pass base= (its directory or hub name now)."
        ) from None
    if note is not None:
        prepare_quantized(model, device)
        return model
    model = model.to(device)
    own_aligned_memory(model)  # as the trainer's policy: the same bits on every CPU
    return model


def base_dtype(path: Path) -> torch.dtype | str:
    """The dtype base_model.json records ('auto', the checkpoint's own, without it: an
    adapter saved by an older leangrpo)."""
    if not (path / BASE_NOTE).is_file():
        log.warning("%s has no %s: loading its base in the checkpoint's own dtype", path, BASE_NOTE)
        return "auto"
    name = _read_json(path / BASE_NOTE).get("dtype")
    if name not in DTYPES:
        raise ModelFilesError(
            f"{path / BASE_NOTE} records dtype {name!r}, not one of {sorted(DTYPES)}."
        )
    return DTYPES[name]


def _read_json(file: Path) -> dict:
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFilesError(
            f"{file} cannot be read as JSON ({exc}); save the model again."
        ) from None
    if not isinstance(value, dict):
        raise ModelFilesError(f"{file} holds no JSON object; save the model again.")
    return value


# -- merging ---------------------------------------------------------------------------------


def merge_adapter(source: str | Path, out: str | Path) -> Path:
    """Write the adapter of `source` (a run directory, whose final/ is used, or an adapter
    directory) merged into its base, with the tokenizer, as the model directory `out`
    (which must not exist yet); returns `out`."""
    from peft import PeftModel

    adapter_dir, out = check_merge(source, out), Path(out)
    cpu = torch.device("cpu")
    with quiet_transformers_progress():
        merged = PeftModel.from_pretrained(
            load_base(adapter_dir, cpu, base=None, quantized=False), adapter_dir
        ).merge_and_unload()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    mask = os.umask(0o022)
    os.umask(mask)
    tmp.chmod(0o777 & ~mask)  # mkdtemp makes it private; a merged model is not
    try:  # written beside `out`, then renamed: never a half-written model under its name
        with quiet_transformers_progress():
            merged.save_pretrained(tmp)
            _tokenizer(adapter_dir).save_pretrained(tmp)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _tokenizer(adapter_dir: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(adapter_dir)
    except (OSError, ValueError):  # an adapter saved without its tokenizer: the base's
        name = _read_json(adapter_dir / ADAPTER_CONFIG).get("base_model_name_or_path")
        return AutoTokenizer.from_pretrained(name)
