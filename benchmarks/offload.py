"""What does hidden-state offload save, and what does it cost?  python benchmarks/offload.py

Real architectures with random weights (Qwen2.5-1.5B and Llama-3.1-8B shapes, written
inline: nothing is downloaded), bf16 on one CUDA device, full fine-tuning, one row of
N = 8K, 16K, 32K tokens (a single sequence, so SDPA runs its causal flash kernel), loss
from the project's chunked lm_head log-probs (no (N, V) logits). One training step =
forward + backward; the optimizer is left out (it is the same for every variant).

Variants (baseline = `checkpointing`, plain non-reentrant checkpointing of every layer):
  no_checkpointing            every activation kept (OOM is reported, not fatal)
  checkpointing               the baseline
  checkpointing+offload_hidden  leangrpo.offload, offload="hidden_states", last layer kept
  checkpointing+offload_all   leangrpo.offload, offload="all": every saved tensor, restored
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

from leangrpo.logprobs import chunked_logprobs  # noqa: E402
from leangrpo.offload import enable_gradient_checkpointing  # noqa: E402

BENCH = "offload"
BASELINE = "checkpointing"
VARIANTS = (
    "no_checkpointing",
    "checkpointing",
    "checkpointing+offload_hidden",
    "checkpointing+offload_all",
    "checkpointing+hf_offload",
)

# Shapes of the public configs; rope scaling is left at its default (it does not change
# memory or time).
CONFIGS = {
    "qwen2.5-1.5b": dict(
        arch="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    ),
    "llama-3.1-8b": dict(
        arch="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    ),
}


def build_model(name: str, max_tokens: int):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    fields = dict(CONFIGS[name])
    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[fields.pop("arch")]
    config = config_cls(max_position_embeddings=max_tokens, **fields)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    return model.train()


def configure(model, variant: str):
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
    return enable_gradient_checkpointing(model, offload=offload)


def train_step(model, ids, pos, offloader) -> None:
    scope = offloader.step() if offloader is not None else contextlib.nullcontext()
    with scope:
        hidden = model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
        logprobs, _ = chunked_logprobs(hidden[0, :-1], model.lm_head.weight, ids[0, 1:])
        (-logprobs.mean()).backward()
    model.zero_grad(set_to_none=False)  # keep the grad buffers: the same for every variant


def measure(model, ids, pos, offloader, repeats: int) -> dict:
    train_step(model, ids, pos, offloader)  # warm-up: allocator, pinned pool, side stream
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        train_step(model, ids, pos, offloader)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated()
    out = {
        "time_s": statistics.median(times),
        "peak_bytes": peak,
        "activation_peak_bytes": peak - resident,
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
    layer_input_bytes = tokens * model.config.hidden_size * 2  # (1, N, H) bf16
    layer_inputs = model.config.num_hidden_layers * layer_input_bytes
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device="cuda")
    pos = torch.arange(tokens, device="cuda")[None]
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
            offloader = configure(model, variant)
            row.update(measure(model, ids, pos, offloader, repeats))
        except torch.cuda.OutOfMemoryError:
            row.update(time_s=None, peak_bytes=None, oom=True)
        except TypeError as err:  # an older transformers without offload=True
            row.update(time_s=None, peak_bytes=None, skipped=str(err))
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        results[variant] = row
        if variant.startswith("checkpointing+offload") and row.get("time_s") is not None:
            row["moved_fraction"] = row["offloaded_bytes"] / layer_inputs
        add_ratios(row, results.get(BASELINE), layer_inputs)
        print(json.dumps(row), flush=True)


def add_ratios(row: dict, base: dict | None, layer_inputs: int) -> None:
    if row["variant"] == BASELINE or not base or base.get("time_s") is None:
        return
    if row.get("time_s") is None:
        return
    row["time_ratio"] = row["time_s"] / base["time_s"]
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
        else (["qwen2.5-1.5b"] if args.quick else list(CONFIGS))
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
