"""A quantized base model (QLoRA): bitsandbytes 4-bit (nf4, fp4) or int8 linears, frozen,
with LoRA adapters trained on top (`model.quantization`).

Imports no torch at module level: preflight's checks run before torch is imported.

Checks, each one sentence naming the fix:
- before anything loads (`check_environment`, called by preflight): bitsandbytes >= 0.47
  installed (else the install hint), a CPU it runs on (bitsandbytes' documented minimum:
  x86-64 with AVX2, or ARM64; a pre-AVX2 x86 CPU would die of an illegal instruction, not
  an exception), and, when this process starts vLLM, a vLLM that can quantize in flight
  (the CPU builds and vLLM after its deprecation of bitsandbytes cannot) on a GPU;
- at load, before the weights are read (`check_device`): the GPU's compute capability
  (4-bit needs 6.0, int8 7.5), or, for `run.device: auto` resolved to the CPU, its AVX2
  (and no vLLM started here).

Loading: transformers' `BitsAndBytesConfig` (blocks of 64; double quantization and the
compute dtype from the config; transformers' default skip list keeps the lm_head and tied
weights unquantized, so the chunked lm_head reads a plain matrix as before), with
`device_map={"": device}` (without it the quantizer picks a visible GPU even for
`run.device: cpu`). Then `prepare_quantized` makes the model safe for leangrpo:
1. bitsandbytes' CPU bf16 repack is turned off (`support_avx512bf16_for_cpu = False` on each
   4-bit layer). On a CPU with AVX512-BF16, a 4-bit layer's first forward in eval mode
   without grad (leangrpo's packed-attention probe, every old-log-prob and generation
   pass) rewrites its weight for good into a layout whose fused kernel computes in bf16
   and has no backward: scoring moved by 0.1-0.4 in log-prob and the base weights'
   gradient path was lost. A deepcopy (the async hf engine's) keeps the flag.
2. int8 layers stay in train mode (a subclass whose `train()` ignores eval): in eval mode
   bitsandbytes runs LLM.int8() (fp16 activations, int8 matmul), 1.5 nats from its
   train-mode dequantize-and-matmul on SmolLM2, so generation and old log-probs would
   disagree with the training pass.
3. On the CPU the tensors left unquantized (embeddings, norms, biases) are copied out of
   the checkpoint's memory map: quantizing read every page of the file, and while any
   tensor views the mapping those pages stay resident (0.4 GiB for SmolLM2, more than
   the quantization saves).
`peft.prepare_model_for_kbit_training` is not called: its reentrant checkpointing clashes
with leangrpo's own (non-reentrant, offload hooks), and it casts the embeddings, lm_head
and norms of a bf16 model to fp32; `get_peft_model` freezes the base anyway.

Re-quantizing the same checkpoint gives the same bytes (nf4, fp4, int8), so checkpoints
hold the adapters and optimizer only and a resume loads and quantizes the base again. The
final adapter is saved as for LoRA (peft loads it on any base), with
`quantization_config.json` beside it: the `BitsAndBytesConfig` to load the base with, so
that the adapter sees the base it was trained on.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import json
import logging
import platform
from pathlib import Path
from typing import Any

from leangrpo.errors import UserError

log = logging.getLogger("leangrpo")

MIN_BITSANDBYTES = "0.47"
INSTALL_HINT = "pip install 'leangrpo[qlora]' (or 'bitsandbytes>=0.47')"
NOTE_FILE = "quantization_config.json"
X86 = ("x86_64", "amd64")
ARM = ("aarch64", "arm64")


class QuantizationError(UserError):
    """A quantized base this machine or this configuration cannot run (one sentence)."""


# -- checks before the model loads (no torch) ------------------------------------------------


def check_environment(cfg: Any) -> None:
    """Everything about `model.quantization` that can be known before torch is imported."""
    quant = cfg.model.quantization
    if quant == "none":
        return
    check_bitsandbytes(quant, bitsandbytes_version())
    if cfg.run.device == "cpu":  # 'auto': checked at load, once the device is resolved
        problem = cpu_problem(platform.machine(), cpu_flags())
        if problem:
            raise QuantizationError(f"model.quantization: {quant} {problem}")
    if starts_vllm(cfg):
        check_vllm(cfg.run.device, vllm_has_bitsandbytes())


def bitsandbytes_version() -> str | None:
    """The installed bitsandbytes' version, or None (not importable)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return None
    try:
        return importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_bitsandbytes(quant: str, version: str | None, key: str = "model.quantization") -> None:
    from packaging.version import Version

    if version is None:
        raise QuantizationError(
            f"{key}: {quant} needs bitsandbytes >= {MIN_BITSANDBYTES}, which is not installed; {INSTALL_HINT}, or set {key}: none."
        )
    if Version(version) < Version(MIN_BITSANDBYTES):
        raise QuantizationError(
            f"{key}: {quant} needs bitsandbytes >= {MIN_BITSANDBYTES} (its CPU 4-bit and int8 kernels), but {version} is installed; {INSTALL_HINT}."
        )


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags (Linux /proc/cpuinfo), or None where they cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return None


def cpu_problem(
    machine: str, flags: set[str] | None, key: str = "model.quantization"
) -> str | None:
    """Why bitsandbytes cannot run on this CPU (the rest of a sentence), or None."""
    machine = machine.lower()
    if machine in ARM:
        return None
    if machine not in X86:
        return f"runs bitsandbytes on the CPU, which supports x86-64 and ARM64 CPUs only, not {machine}; train on a supported machine or set {key}: none."
    if flags is not None and "avx2" not in flags:
        return f"runs bitsandbytes on the CPU, which needs an x86-64 CPU with AVX2, and this one has none; train on a newer CPU or a GPU, or set {key}: none."
    return None


def starts_vllm(cfg: Any) -> bool:
    """This process starts a vLLM engine: colocated, or a local `leangrpo serve`."""
    vllm = cfg.rollout.vllm
    return cfg.rollout.engine == "vllm" and (vllm.mode == "colocate" or not vllm.urls)


def vllm_has_bitsandbytes() -> bool | None:
    """Whether the installed vLLM has its bitsandbytes method (None: no vLLM installed)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    return (root / "model_executor" / "layers" / "quantization" / "bitsandbytes.py").is_file()


def check_vllm(device: str, has_bitsandbytes: bool | None) -> None:
    """vLLM quantizes the base in flight (`quantization="bitsandbytes"`) on CUDA only."""
    if device == "cpu":
        raise QuantizationError(
            "model.quantization: nf4 with rollout.engine vllm needs vLLM's bitsandbytes loader, which runs on CUDA GPUs only, and this run trains on the CPU; use rollout.engine: hf, or vLLM servers on GPUs (rollout.vllm.mode: server with rollout.vllm.urls)."
        )
    if has_bitsandbytes is False:
        raise QuantizationError(
            "model.quantization: nf4 with rollout.engine vllm needs vLLM's bitsandbytes quantization, which the installed vLLM does not have (CPU builds never had it, and vLLM deprecated it); use rollout.engine: hf, or a vLLM with bitsandbytes on a GPU."
        )


# -- at load, before the weights are read ----------------------------------------------------


def check_device(cfg: Any, device: Any) -> None:
    """What needs torch: the GPU's compute capability, or the CPU of a resolved 'auto'
    (and then no local vLLM)."""
    check_quantized_device(cfg.model.quantization, device, "model.quantization")
    if device.type != "cuda" and starts_vllm(cfg):
        check_vllm("cpu", None)


def check_quantized_device(quant: str, device: Any, key: str) -> None:
    """`key: quant` (model.quantization, distill.teacher_quantization) can run on
    `device`: a GPU's compute capability (4-bit needs 6.0, int8 7.5), or a CPU
    bitsandbytes runs on (AVX2 on x86-64, or ARM64)."""
    import torch

    if device.type == "cuda":
        need = (7, 5) if quant == "int8" else (6, 0)
        have = torch.cuda.get_device_capability(device)
        if tuple(have) < need:
            raise QuantizationError(
                f"{key}: {quant} needs a GPU of compute capability {need[0]}.{need[1]} or higher for bitsandbytes, and this one is {have[0]}.{have[1]}; use {key}: nf4 (6.0), none, or a newer GPU."
            )
        return
    machine = platform.machine().lower()
    flags = cpu_flags()
    if machine in X86 and flags is None and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        flags = set()  # no /proc/cpuinfo, and torch found no AVX2 either (ATen's choice is
        # otherwise no statement about the CPU: ATEN_CPU_CAPABILITY=default picks it anywhere)
    problem = cpu_problem(machine, flags, key)
    if problem:
        raise QuantizationError(f"{key}: {quant} {problem}")


# -- loading ---------------------------------------------------------------------------------


def quantized_load_kwargs(model_cfg: Any, device: Any, compute_dtype: Any) -> dict[str, Any]:
    """from_pretrained's extra arguments for `model.quantization` (not 'none');
    `compute_dtype`: the torch dtype 4-bit layers compute in (policy.py resolves it)."""
    from transformers import BitsAndBytesConfig

    quiet_bitsandbytes()
    quant = model_cfg.quantization
    if quant == "int8":
        config = BitsAndBytesConfig(load_in_8bit=True)
    else:
        config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quant,
            bnb_4bit_compute_dtype=compute_dtype,
            bnb_4bit_use_double_quant=model_cfg.quantization_double_quant,
        )
    return {"quantization_config": config, "device_map": {"": str(device)}}


def quiet_bitsandbytes() -> None:
    """bitsandbytes logs at import, on AVX512-BF16 CPUs, that its fused CPU inference kernel
    (from the optional `kernels` package) is missing: the path prepare_quantized turns off."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def prepare_quantized(model: Any, device: Any) -> None:
    """The load-time fixes of the module docstring, before anything runs a forward."""
    import bitsandbytes as bnb

    refuse_quantized_head(model)
    count = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
        elif isinstance(module, bnb.nn.Linear8bitLt):
            module.__class__ = train_mode_int8_class()
            module.train()
        else:
            continue
        count += 1
    if device.type == "cpu":
        own_unquantized_tensors(model)
    kind = model.config.quantization_config.quantization_method()
    log.info(
        "quantized base: %d linear layers in %s (bitsandbytes %s)", count, kind, bnb.__version__
    )


def refuse_quantized_head(model: Any) -> None:
    """The chunked lm_head multiplies by the head's weight as a plain matrix."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if weight is None or not weight.is_floating_point():
        raise QuantizationError(
            "model.quantization: the lm_head was quantized too, but leangrpo's chunked log-probs read it as a plain matrix; keep the output head unquantized (transformers' default: llm_int8_skip_modules unset)."
        )


@functools.cache
def train_mode_int8_class() -> type:
    import bitsandbytes as bnb

    class TrainModeLinear8bitLt(bnb.nn.Linear8bitLt):
        """Always in train mode: dequantize + matmul in the input's dtype (see the module
        docstring, fix 2). It has no weights of its own to train: train mode changes only
        which matmul bitsandbytes runs."""

        def train(self, mode: bool = True) -> TrainModeLinear8bitLt:
            return super().train(True)

    return TrainModeLinear8bitLt


def own_unquantized_tensors(model: Any) -> None:
    """Copy every floating-point parameter and buffer (the unquantized ones) out of the
    checkpoint's memory map, so that the mapping and its resident pages go (fix 3); ties
    are kept (a shared Parameter is one object)."""
    import ctypes
    import gc

    import torch

    seen: set[int] = set()
    with torch.no_grad():
        for module in model.modules():
            tensors = [*module._parameters.values(), *module._buffers.values()]
            for tensor in tensors:
                if tensor is None or id(tensor) in seen or not tensor.is_floating_point():
                    continue
                seen.add(id(tensor))
                tensor.data = tensor.data.clone()
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # give freed pages back now (glibc)
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# -- the final adapter -----------------------------------------------------------------------


def quantization_note(model: Any) -> dict | None:
    """The `BitsAndBytesConfig` the model's base was loaded with, as a JSON-ready dict
    (None: a plain base)."""
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is None:
        return None
    if isinstance(config, dict):
        return dict(config)
    return json.loads(config.to_json_string(use_diff=False))


def write_quantization_note(model: Any, directory: str | Path) -> None:
    """`quantization_config.json` next to a saved adapter of a quantized base: load the base
    with `BitsAndBytesConfig.from_dict(json.load(...))`, so the adapter sees its base."""
    note = quantization_note(model)
    if note is not None:
        text = json.dumps(note, indent=2, sort_keys=True)
        (Path(directory) / NOTE_FILE).write_text(text + "\n", encoding="utf-8")
