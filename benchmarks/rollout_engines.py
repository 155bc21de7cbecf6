"""Rollout engines: hf vs vLLM.  .venv-vllm/bin/python benchmarks/rollout_engines.py [--quick]

Cases, on the demo model (`examples/demo/model`; where vLLM cannot serve it, e.g. a head
size its CPU kernels lack, a tiny Qwen2 + character tokenizer built on the spot, head size
64; `--model PATH` for another):
- `generate`: P prompts x n completions of up to `max_new_tokens`, temperature 1; time of
  one call after a warm-up call, `tokens_per_s` (completion tokens generated / time) and
  `throughput_ratio` (vLLM / hf tokens per second; the engines sample different tokens).
- `sync_full`: `update_weights(model.state_dict())` (vLLM: safetensors buckets reloaded by
  the worker extension; hf: copy into the engine's own weights).
- `sync_lora`: `load_adapter(dir)` of a rank-16 all-linear peft adapter (vLLM: published
  as `adapters/v{N}` and added by name; hf: peft weights loaded into its own copy).
Baseline = the hf engine (`leangrpo.rollout.hf.engine.HFEngine`) where it exists, else vLLM's
lines carry no ratios. vLLM runs in-process (engine core + worker in this process).

peak_bytes: the process's peak resident memory after the case (ru_maxrss; both engines
live in this process, so it only grows: read it as "peak so far"); CUDA: max reserved.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: JSON lines only
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

from leangrpo.contracts import Prompt, SamplingParams  # noqa: E402

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 +-*/=.,?"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def build_char_model(path: Path, hidden: int, layers: int) -> None:
    """Tiny Qwen2 (head_dim 64) + WordLevel character tokenizer, saved for vLLM."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    vocab = {"<|endoftext|>": 0} | {c: i + 1 for i, c in enumerate(CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    ).save_pretrained(path)


def usable_by_vllm(model_path: Path) -> str | None:
    """None, or why vLLM cannot serve this model here."""
    if not (model_path / "config.json").is_file():
        return "no model there"
    if DEVICE == "cpu":
        from leangrpo.rollout.vllm.local import check_cpu_head_size

        try:
            check_cpu_head_size(str(model_path))
        except ValueError as err:
            return str(err).split(";")[0]
    return None


def peak_bytes() -> int:
    if DEVICE == "cuda":
        return int(torch.cuda.max_memory_reserved())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def emit(case: str, variant: str, time_s: float, baseline: dict | None, **extra) -> dict:
    row = {
        "bench": "rollout_engines",
        "case": case,
        "device": DEVICE,
        "variant": variant,
        "time_s": round(time_s, 5),
        "peak_bytes": peak_bytes(),
        **extra,
    }
    if baseline is not None:
        row["time_ratio"] = round(time_s / baseline["time_s"], 4)
        row["mem_ratio"] = round(row["peak_bytes"] / baseline["peak_bytes"], 4)
    print(json.dumps(row), flush=True)
    return row


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prompts_for(tokenizer, count: int) -> list[Prompt]:
    texts = [f"{a}+{b}=" for a, b in zip(range(10, 10 + count), range(37, 37 + count))]
    return [Prompt(uid=i, text=t, ids=tokenizer(t).input_ids) for i, t in enumerate(texts)]


def count_tokens(groups) -> int:
    return sum(len(c.ids) for group in groups for c in group)


def run_engine(name, engine, model, adapter_dir, prompts, params, n, repeats, baselines):
    """The three cases for one engine; returns its rows by case."""
    engine.generate(prompts, params, n, engine.version)  # warm-up
    tokens = []  # completion tokens of each timed call
    gen_s = timed(
        lambda: tokens.append(count_tokens(engine.generate(prompts, params, n, engine.version))),
        repeats,
    )
    rate = sum(tokens) / (gen_s * repeats)  # ~ tokens / time over the calls (median time)
    extra = {"tokens": tokens[-1], "tokens_per_s": round(rate, 1)}
    if "generate" in baselines:  # samples differ between engines: compare rates, not times
        base_rate = baselines["generate"]["tokens_per_s"]
        extra["throughput_ratio"] = round(extra["tokens_per_s"] / base_rate, 4)
    rows = {"generate": emit("generate", name, gen_s, baselines.get("generate"), **extra)}
    state = list(model.state_dict().items())
    sync_s = timed(lambda: engine.update_weights(state, engine.version + 1), repeats)
    size = sum(v.numel() * v.element_size() for _, v in state)
    rows["sync_full"] = emit("sync_full", name, sync_s, baselines.get("sync_full"), bytes=size)
    lora_s = timed(lambda: engine.load_adapter(str(adapter_dir), engine.version + 1), repeats)
    lora_bytes = sum(p.stat().st_size for p in adapter_dir.iterdir())
    rows["sync_lora"] = emit(
        "sync_lora", name, lora_s, baselines.get("sync_lora"), bytes=lora_bytes
    )
    return rows


def hf_engine(model, tokenizer):
    try:
        from leangrpo.rollout.hf.engine import HFEngine
    except ImportError:
        print(
            json.dumps(
                {
                    "bench": "rollout_engines",
                    "case": "all",
                    "device": DEVICE,
                    "variant": "hf",
                    "skipped": "leangrpo.rollout.hf is not available",
                }
            ),
            flush=True,
        )
        return None
    return HFEngine(
        copy.deepcopy(model), tokenizer, share_weights=False, device=torch.device(DEVICE)
    )


def vllm_engine(model_path: Path, work: Path):
    from leangrpo.rollout.vllm.engine import VLLMEngine

    return VLLMEngine.colocated(
        model_path,
        dtype="float32" if DEVICE == "cpu" else "bfloat16",
        max_model_len=512,
        enforce_eager=DEVICE == "cpu",
        enable_lora=True,
        max_lora_rank=16,
        work_dir=work / "vllm",
        engine_kwargs={"distributed_executor_backend": "uni"},
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, < ~2 minutes on CPU")
    parser.add_argument("--model", default=None, help="model directory (default: the demo model)")
    args = parser.parse_args()
    try:
        import vllm  # noqa: F401
    except ImportError:
        print(
            json.dumps(
                {
                    "bench": "rollout_engines",
                    "case": "all",
                    "device": DEVICE,
                    "variant": "vllm",
                    "skipped": "vLLM not installed: scripts/setup_vllm_venv.sh, then run with .venv-vllm",
                }
            )
        )
        return 0
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    model_path = Path(args.model) if args.model else ROOT / "examples" / "demo" / "model"
    why_not = usable_by_vllm(model_path)
    if why_not:
        print(
            json.dumps({"bench": "rollout_engines", "info": f"not using {model_path}: {why_not}"})
        )
        model_path = work / "model"
        build_char_model(model_path, hidden=256, layers=2 if args.quick else 4)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    lora = get_peft_model(
        copy.deepcopy(model), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    )
    lora.save_pretrained(work / "adapter")
    count, n, max_new = (4, 8, 64) if args.quick else (8, 8, 128)
    prompts = prompts_for(tokenizer, count)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=0)
    repeats = 1 if args.quick else 2
    print(
        json.dumps(
            {
                "bench": "rollout_engines",
                "info": platform.platform(),
                "model": str(model_path),
                "prompts": count,
                "n": n,
                "max_new_tokens": max_new,
            }
        ),
        flush=True,
    )

    baselines: dict = {}
    hf = hf_engine(model, tokenizer)
    if hf is not None:
        baselines = run_engine("hf", hf, model, work / "adapter", prompts, params, n, repeats, {})
        hf.close()
    start = time.perf_counter()
    engine = vllm_engine(model_path, work)
    emit("startup", "vllm", time.perf_counter() - start, None)
    run_engine("vllm", engine, model, work / "adapter", prompts, params, n, repeats, baselines)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
