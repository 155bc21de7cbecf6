"""What does hidden-state offload save, and what does it cost?  python benchmarks/offload.py

Real architectures with random weights (Qwen2.5-1.5B and Llama-3.1-8B shapes from
benchmarks/models.py: nothing is downloaded), bf16 on one CUDA device, full fine-tuning, one row of
N = 8K, 16K, 32K tokens (a single sequence, so SDPA runs its causal flash kernel), loss
from the project's chunked lm_head log-probs (no (N, V) logits). One training step =
forward + backward; the optimizer is left out (it is the same for every variant).

Variants (baseline = `checkpointing`, plain non-reentrant checkpointing of every layer):
  no_checkpointing            every activation kept (OOM is reported, not fatal)
  checkpointing               the baseline
  checkpointing+offload_hidden  leangrpo.ops.offload, offload="hidden_states", last layer kept
  checkpointing+offload_all   leangrpo.ops.offload, offload="all": every saved tensor, restored
                              on demand (no keep-last, no look-ahead): the simple comparison
  checkpointing+hf_offload    transformers' own `activation_checkpointing_enable(offload=True)`
                              (torch save_on_cpu around each layer, copies on the compute
                              stream), where the installed transformers has it

Each line also reports `moved_fraction` (bytes of the checkpointed layer inputs moved off
the device / their total) and `freed_fraction` ((baseline peak - variant peak) / those
bytes, what the device actually gained). Goals: moved >= 0.8, time_ratio <= 1.03.
Without CUDA it prints one line saying so and exits 0. `--quick`: Qwen2.5-1.5B at 8K only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from leangrpo.ops.logprobs.api import chunked_logprobs  # noqa: E402
from leangrpo.ops.offload import enable_gradient_checkpointing  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import CONFIGS  # noqa: E402
from models import build_model as build_random_model  # noqa: E402

BENCH = "offload"
BASELINE = "checkpointing"
VARIANTS = (
    "no_checkpointing",
    "checkpointing",
    "checkpointing+offload_hidden",
    "checkpointing+offload_all",
    "checkpointing+hf_offload",
)


def build_model(name: str, max_tokens: int, device: str = "cuda"):
    """Random weights of shape `name` (benchmarks/models.py), bf16 on CUDA, fp32 on CPU."""
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    return build_random_model(name, max_tokens, device, dtype)


def configure(model, variant: str, min_tensor_bytes: int = 1 << 20):
    """Switch checkpointing/offload for this variant; returns the offloader or None."""
    if variant == "no_checkpointing":
        disable = getattr(model, "activation_checkpointing_disable", None)
        (disable or model.gradient_checkpointing_disable)()
        return None
    if variant == "checkpointing+hf_offload":
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}, offload=True
        )
        return None
    offload = {
        "checkpointing": "none",
        "checkpointing+offload_hidden": "hidden_states",
        "checkpointing+offload_all": "all",
    }[variant]
    return enable_gradient_checkpointing(model, offload=offload, min_tensor_bytes=min_tensor_bytes)


def train_step(model, ids, pos, offloader) -> None:
    scope = offloader.step() if offloader is not None else contextlib.nullcontext()
    with scope:
        hidden = model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
        logprobs, _ = chunked_logprobs(hidden[0, :-1], model.lm_head.weight, ids[0, 1:])
        (-logprobs.mean()).backward()
    model.zero_grad(set_to_none=False)  # keep the grad buffers: the same for every variant


def measure(model, ids, pos, offloader, repeats: int) -> dict:
    """Median step time; on CUDA also the peak (on CPU the host buffers are memory too: None)."""
    cuda = ids.is_cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    train_step(model, ids, pos, offloader)  # warm-up: allocator, pinned pool, side stream
    sync()
    resident = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        train_step(model, ids, pos, offloader)
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    out = {
        "time_s": statistics.median(times),
        "peak_bytes": peak,
        "activation_peak_bytes": None if peak is None else peak - resident,
    }
    if offloader is not None:
        s = offloader.stats
        out.update(
            offloaded_bytes=s.offloaded_bytes,
            offloaded_tensors=s.offloaded,
            prefetched=s.prefetched,
            pool_bytes=offloader.pool.bytes,
        )
    return out


def run_case(model, name: str, tokens: int, repeats: int, device: str, variants) -> None:
    for row in case_rows(model, name, tokens, repeats, device, variants):
        print(json.dumps(row), flush=True)


def case_rows(model, name, tokens, repeats, device, variants, min_tensor_bytes=1 << 20):
    """One row per variant (the baseline first, so the others carry ratios)."""
    param = next(model.parameters())
    layer_input_bytes = tokens * model.config.hidden_size * param.element_size()  # (1, N, H)
    layer_inputs = model.config.num_hidden_layers * layer_input_bytes
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=param.device)
    pos = torch.arange(tokens, device=param.device)[None]
    oom = torch.cuda.OutOfMemoryError
    results = {}
    for variant in variants:
        row = {
            "bench": BENCH,
            "case": f"{name}/{tokens}",
            "device": device,
            "variant": variant,
            "model": name,
            "tokens": tokens,
            "baseline": BASELINE,
            "layer_inputs_bytes": layer_inputs,
        }
        try:
            offloader = configure(model, variant, min_tensor_bytes)
            row.update(measure(model, ids, pos, offloader, repeats))
        except oom:
            row.update(time_s=None, peak_bytes=None, oom=True)
        except (TypeError, AttributeError) as err:  # a transformers without offload=True
            row.update(time_s=None, peak_bytes=None, skipped=str(err))
        model.zero_grad(set_to_none=True)
        if param.is_cuda:
            torch.cuda.empty_cache()
        results[variant] = row
        if variant.startswith("checkpointing+offload") and row.get("time_s") is not None:
            row["moved_fraction"] = row["offloaded_bytes"] / layer_inputs
        add_ratios(row, results.get(BASELINE), layer_inputs)
        yield row


def add_ratios(row: dict, base: dict | None, layer_inputs: int) -> None:
    if row["variant"] == BASELINE or not base or base.get("time_s") is None:
        return
    if row.get("time_s") is None:
        return
    row["time_ratio"] = row["time_s"] / base["time_s"]
    if row.get("peak_bytes") is None or base.get("peak_bytes") is None:
        return
    row["mem_ratio"] = row["peak_bytes"] / base["peak_bytes"]
    row["freed_fraction"] = (base["peak_bytes"] - row["peak_bytes"]) / layer_inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Qwen2.5-1.5B at 8K tokens only")
    parser.add_argument("--models", default=None, help=f"comma list of {sorted(CONFIGS)}")
    parser.add_argument("--tokens", default=None, help="comma list, e.g. 8192,16384,32768")
    parser.add_argument("--repeats", type=int, default=None, help="measured steps per variant")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            json.dumps(
                {
                    "bench": BENCH,
                    "case": "all",
                    "device": "cpu",
                    "variant": "skipped",
                    "time_s": None,
                    "peak_bytes": None,
                    "skipped": "needs a CUDA device (offload moves device memory)",
                }
            )
        )
        return
    models = (
        args.models.split(",")
        if args.models
        else (["qwen2.5-1.5b"] if args.quick else ["qwen2.5-1.5b", "llama-3.1-8b"])
    )
    tokens = (
        [int(t) for t in args.tokens.split(",")]
        if args.tokens
        else ([8192] if args.quick else [8192, 16384, 32768])
    )
    repeats = args.repeats or (2 if args.quick else 3)
    device = torch.cuda.get_device_name()
    # the baseline runs first so every other variant's ratios are known when it prints
    variants = [BASELINE, *[v for v in VARIANTS if v != BASELINE]]
    for name in models:
        model = build_model(name, max(tokens))
        for n in tokens:
            run_case(model, name, n, repeats, device, variants)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
