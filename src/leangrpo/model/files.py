"""Cheap checks of the model's files, before anything loads (no torch, no weights read).

`check_model_files(cfg.model)` turns every way a model directory can be unusable into one
sentence naming the file and the fix, where transformers would raise a chain of
tracebacks after seconds of imports:

- `model.name_or_path` is a local directory, or a Hugging Face hub id (`org/name`). A
  path that does not exist and cannot be a hub id (it starts with `/`, `.` or `~`, or has
  more than one `/`) is refused. For a hub id its config.json is read from the local
  cache; with `fetch=True` (in the trainer's set-up, where the download is about to
  happen anyway) it is fetched when not cached. The weights are left to transformers.
- config.json must parse as a JSON object.
- Weights must exist: model.safetensors, a sharded index whose shards all exist, or
  pytorch_model.bin (and shards). A tokenizer file must exist too.
- Every safetensors file's header is checked the way the library reads it: 8 bytes of
  little-endian header length, a JSON header, and tensors whose byte ranges end exactly at
  the end of the file. A truncated download or a corrupt header is named now.

It also lists the model's safetensors files on this machine without fetching any
(`local_safetensors`: what colocated vLLM's shared tensors are checked against), and reads
the model's context length (positions it can attend to), which the data
checks compare prompt + rollout.max_new_tokens against. Rope scaling that extends the
context (linear, dynamic, yarn with a factor) multiplies the original length.

`check_context_heads`: a context-parallel size must divide the attention heads; the one
check train's preflight and `leangrpo plan` both run.

`check_merge(source, out)`: what `leangrpo merge` (model/final.py) needs before torch is
imported: an adapter in `source` or its final/, and an `out` that does not exist yet.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leangrpo.config import ConfigError
from leangrpo.errors import UserError
from leangrpo.model.smollm2 import link_hint

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own limit
ADAPTER_CONFIG = "adapter_config.json"  # peft's: a directory holding a LoRA adapter


class ModelFilesError(UserError):
    """The model's files cannot be loaded; the message names the file and the fix."""


@dataclass(frozen=True)
class ModelFiles:
    """What the cheap checks learnt about the model."""

    directory: Path | None  # local directory (or hub cache snapshot) holding config.json
    context: int | None  # positions the model attends to; None = unknown
    context_source: str = ""  # how `context` was read, for messages


def check_model_files(model_cfg: Any, fetch: bool = False) -> ModelFiles:
    name = model_cfg.name_or_path
    key = f"model.name_or_path = {name!r}"
    path = Path(name).expanduser()
    if path.is_dir():
        config = _read_config(path, key)
        _check_weights(path, key)
        _check_tokenizer(path, key)
        return ModelFiles(path, *context_length(config))
    if path.exists():
        raise ModelFilesError(
            f"{key} is a file; point it at the model's directory (config.json, weights, tokenizer)."
        )
    if name.startswith(("/", ".", "~")) or not HUB_ID.match(name) or link_hint(path):
        raise ModelFilesError(_no_directory(key, path))
    config_file = _hub_config(name, model_cfg.revision, key, fetch)
    if config_file is None:
        return ModelFiles(None, None)
    return ModelFiles(config_file.parent, *context_length(_read_config(config_file.parent, key)))


def read_model_config(model_cfg: Any) -> dict:
    """config.json of `model.name_or_path` (a local directory, or a hub id fetched when not
    cached) as a dict, without torch or transformers (`leangrpo plan`)."""
    name = model_cfg.name_or_path
    key = f"model.name_or_path = {name!r}"
    path = Path(name).expanduser()
    if path.is_dir():
        return _read_config(path, key)
    if name.startswith(("/", ".", "~")) or not HUB_ID.match(name) or link_hint(path):
        raise ModelFilesError(_no_directory(key, path))
    return _read_config(_hub_config(name, model_cfg.revision, key, fetch=True).parent, key)


def _no_directory(key: str, path: Path) -> str:
    hint = link_hint(path)
    if hint is not None:
        return f"{key}: no such directory ({path.resolve()}); {hint}."
    return f"{key}: no such directory ({path.resolve()}); point it at a model directory or a Hugging Face hub id such as Qwen/Qwen2.5-0.5B-Instruct."


def local_safetensors(model_cfg: Any) -> list[Path] | None:
    """The `*.safetensors` files of `model.name_or_path` on this machine, never fetched: a
    local directory's ([] when it holds none), or those of a hub id in the local cache
    (None when none are cached yet: whether the hub has them is not known here)."""
    name = model_cfg.name_or_path
    path = Path(name).expanduser()
    if not path.is_dir():
        if name.startswith(("/", ".", "~")) or not HUB_ID.match(name):
            return None
        from huggingface_hub import snapshot_download

        try:
            path = Path(
                snapshot_download(
                    name,
                    revision=model_cfg.revision,
                    allow_patterns=["*.safetensors", "config.json"],
                    local_files_only=True,
                )
            )
        except Exception:  # not in the local hub cache
            return None
        return sorted(path.glob("*.safetensors")) or None
    return sorted(path.glob("*.safetensors"))


def _hub_config(repo: str, revision: str | None, key: str, fetch: bool) -> Path | None:
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(repo, "config.json", revision=revision)
    if isinstance(cached, str):
        return Path(cached)
    if not fetch:
        return None
    try:
        return Path(hf_hub_download(repo, "config.json", revision=revision))
    except Exception as exc:  # offline, unknown repo, gated, no network: all one sentence
        raise ModelFilesError(
            f"{key} is not a local directory, and its config.json could not be fetched from the Hugging Face hub ({type(exc).__name__}); check the path or the hub id, the network, and HF_TOKEN for gated models."
        ) from None


def _read_config(directory: Path, key: str) -> dict:
    file = directory / "config.json"
    if not file.is_file():
        raise ModelFilesError(
            f"{key} has no config.json ({file}); point it at a directory written by save_pretrained."
        )
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ModelFilesError(
            f"{file} is not UTF-8 text; the model directory is corrupt."
        ) from None
    except json.JSONDecodeError as exc:
        raise ModelFilesError(
            f"{file} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); restore it from the model's source."
        ) from None
    if not isinstance(config, dict):
        raise ModelFilesError(f"{file} must hold a JSON object, not a {type(config).__name__}.")
    return config


def _check_weights(directory: Path, key: str) -> None:
    for index_name in INDEX_FILES:
        index = directory / index_name
        if index.is_file():
            for shard in _index_shards(index):
                _check_weight_file(directory / shard)
            return
    for name in WEIGHT_FILES:
        if (directory / name).is_file():
            _check_weight_file(directory / name)
            return
    raise ModelFilesError(
        f"{key} holds no weights (model.safetensors, a sharded model.safetensors.index.json, or pytorch_model.bin); copy them there or fix the path."
    )


def _index_shards(index: Path) -> list[str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return sorted(set(weight_map.values()))
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise ModelFilesError(
            f"{index} is not a valid weight index (JSON with a weight_map); restore it from the model's source."
        ) from None


def _check_weight_file(file: Path) -> None:
    if not file.is_file():
        raise ModelFilesError(f"weight file {file} is missing; the download is incomplete.")
    if file.suffix == ".safetensors":
        check_safetensors_header(file)
    elif file.stat().st_size == 0:
        raise ModelFilesError(f"weight file {file} is empty; the download is incomplete.")


def check_safetensors_header(file: Path) -> None:
    """Header length, JSON header and tensor byte ranges against the file size."""
    size = file.stat().st_size
    broken = f"{file} is not a valid safetensors file"
    fix = "download or save the weights again"
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFilesError(f"{broken} ({size} bytes, shorter than its header); {fix}.")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > MAX_HEADER_BYTES:
            raise ModelFilesError(
                f"{broken}: its header claims {header_len} bytes, more than any real one; {fix}."
            )
        if 8 + header_len > size:
            raise ModelFilesError(
                f"{file} is truncated ({size} bytes, its header alone needs {8 + header_len}); {fix}."
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, IndexError):
        raise ModelFilesError(
            f"{broken}: its header is not valid JSON tensor metadata; {fix}."
        ) from None
    expected = 8 + header_len + max(ends, default=0)
    if expected != size:
        what = "truncated" if size < expected else "longer than its header describes"
        raise ModelFilesError(
            f"{file} is {what} ({size} bytes, its header describes {expected}); {fix}."
        )


def _check_tokenizer(directory: Path, key: str) -> None:
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ModelFilesError(
            f"{key} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...); save the tokenizer there too (tokenizer.save_pretrained)."
        )


def context_length(config: dict) -> tuple[int | None, str]:
    """Positions the model attends to, from config.json, and where that number came from."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    for name in CONTEXT_KEYS:
        value = text.get(name)
        if isinstance(value, int) and value > 0:
            break
    else:
        return None, ""
    for rope_key in ("rope_scaling", "rope_parameters"):
        rope = text.get(rope_key)
        if not isinstance(rope, dict):
            continue
        kind = rope.get("rope_type", rope.get("type"))
        factor = rope.get("factor")
        if kind in ("linear", "dynamic", "yarn") and isinstance(factor, int | float) and factor > 1:
            original = rope.get("original_max_position_embeddings") or value
            return int(original * factor), f"config.json {name} with {kind} rope scaling x{factor}"
    return value, f"config.json {name}"


# -- what the weights and the tokenizer must agree on ---------------------------------------


def check_model_fits(cfg: Any, model: ModelFiles) -> None:
    """A local model directory's tokenizer fits its embedding rows, and lora.target_modules
    names modules its weights have: both read from the files' headers, before torch."""
    if model.directory is None:
        return
    config = _read_config(model.directory, f"model.name_or_path = {cfg.model.name_or_path!r}")
    check_tokenizer_fits(model.directory, config, tokenizer_size(model.directory))
    if cfg.lora.enabled and cfg.lora.target_modules != "all-linear":
        names = module_names(model.directory)
        if names is not None:
            check_lora_targets(cfg.lora.target_modules, names)


def embedding_rows(config: dict) -> int | None:
    """config.json's vocab_size: the rows of the model's token embedding."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    rows = text.get("vocab_size")
    return rows if isinstance(rows, int) and rows > 0 else None


def tokenizer_size(directory: Path) -> int | None:
    """1 + the highest token id tokenizer.json can produce (its vocabulary and added
    tokens), None when there is no tokenizer.json to read."""
    file = directory / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        vocab = data["model"].get("vocab") or {}
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        ids += [int(t["id"]) for t in data.get("added_tokens") or []]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return None  # transformers reads it (or says what is wrong) at the set-up
    ints = [i for i in ids if isinstance(i, int)]
    return max(ints) + 1 if ints else None


def check_tokenizer_fits(directory: Path | str, config: dict, size: int | None) -> None:
    """Every token id the tokenizer can produce has an embedding row: a tokenizer of
    another model would index past the embedding at the first forward."""
    rows = embedding_rows(config)
    if size is None or rows is None or size <= rows:
        return
    raise ModelFilesError(
        f"the tokenizer in {str(directory)!r} has {size} tokens (ids up to {size - 1}) but the model has only {rows} embedding rows (config.json vocab_size), so its first forward would index past them; use the tokenizer saved with these weights, or a model whose vocab_size covers this tokenizer."
    )


def module_names(directory: Path) -> set[str] | None:
    """The dotted names of the modules that hold tensors (a tensor's name less its last
    part, from the safetensors header or index), None for .bin weights (not read here).
    LoRA adapts such modules only (linear and embedding layers), never their containers."""
    keys: list[str] = []
    index = directory / INDEX_FILES[0]
    if index.is_file():
        keys = list(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
    elif (directory / WEIGHT_FILES[0]).is_file():
        keys = [k for k in _safetensors_header(directory / WEIGHT_FILES[0]) if k != "__metadata__"]
    else:
        return None
    return {key.rpartition(".")[0] for key in keys}  # the last part names the tensor


def check_lora_targets(targets: list[str], names: set[str]) -> None:
    """At least one of lora.target_modules must name a module of the model, matched as peft
    matches them (equal to a module's dotted name or to its ending): what peft would raise
    at the set-up (model/policy.py says it there too), said before the load."""
    if any(name == t or name.endswith("." + t) for name in names for t in targets):
        return
    leaves = sorted({n.rpartition(".")[2] for n in names if not n.rpartition(".")[2].isdigit()})
    raise ModelFilesError(
        f"lora.target_modules = {targets!r} names no module of the model (its weights are in modules named {', '.join(leaves)}); name some of those (the linear ones, e.g. the attention and MLP projections), or use lora.target_modules: all-linear."
    )


def _safetensors_header(file: Path) -> dict:
    """The JSON header of a safetensors file (checked by `check_safetensors_header`)."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length).decode("utf-8"))
def attention_heads(config: dict) -> int | None:
    """The model's query heads, from config.json (a multimodal config's text_config)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    heads = text.get("num_attention_heads")
    return heads if isinstance(heads, int) else None


def check_context_heads(
    context_size: int, heads: int | None, name_or_path: str, key: str = "model.name_or_path"
) -> None:
    """distributed.context_parallel_size C must divide the model's query heads (Ulysses
    gives each process H / C of them): one sentence, asked by train's preflight and by
    `leangrpo plan` alike, of the policy and of a distillation teacher (`key`:
    distill.teacher), whose rows are split alike. `heads` None (not in config.json): left
    to the set-up's checks."""
    if context_size > 1 and heads is not None and heads % context_size:
        whose = "model's" if key == "model.name_or_path" else "teacher's"
        raise ConfigError(
            f"distributed.context_parallel_size ({context_size}) must divide the {whose} {heads} attention heads (Ulysses gives each process an equal share of them; config.json of {key} = {name_or_path!r}); use a context_parallel_size that divides {heads}, or a {key} whose heads it divides."
        )


EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # routed experts


def declared_experts(config: dict) -> int:
    """Routed experts per MoE layer that config.json declares (0: a dense model)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    for name in EXPERT_KEYS:
        value = text.get(name)
        if isinstance(value, int) and value > 0:
            return value
    return 0


# -- merging an adapter into its base (leangrpo merge) --------------------------------------


def check_merge(source: str | Path, out: str | Path) -> Path:
    """The adapter directory of `source` (itself, or a run directory's final/), with `out`
    free for the merged model; else one sentence."""
    source, out = Path(source), Path(out)
    found = adapter_directory(source)
    if out.exists():
        raise ModelFilesError(
            f"{str(out)!r} exists already; choose a new directory for the merged model."
        )
    return found


def adapter_directory(source: Path) -> Path:
    """`source` when it holds a LoRA adapter, else its final/ when that does."""
    for candidate in (source, source / "final"):
        if (candidate / ADAPTER_CONFIG).is_file():
            return candidate
    if (source / "config.json").is_file() or (source / "final" / "config.json").is_file():
        raise ModelFilesError(
            f"{str(source)!r} holds a full model, not a LoRA adapter: there is nothing to merge; start a new run from its final/ directly (model.name_or_path)."
        )
    raise ModelFilesError(
        f"{str(source)!r} holds no LoRA adapter ({ADAPTER_CONFIG}), nor does its final/; pass the run directory of a LoRA run that saved its final model (checkpoint.save_final_model: true), or its final/."
    )
