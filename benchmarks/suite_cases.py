"""The cases of benchmarks/gpu_suite.py: each a generator of JSON rows, with its goals.

Every case reuses a benchmark script's own functions (logprob_memory, packing, offload,
grpo_step, hf_generation, qlora, shared_weights) at the shapes of the issue on CUDA, or at tiny shapes on CPU
(`ctx.dry`). A goal is written on the rows it judges: `goal` (the sentence) and
`goal_met` (bool); `note` is the one figure the summary table shows.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GB = 1e9  # decimal, as the anchors (Unsloth's 54.3 GB) are written
DRY_HANG_S = 1800.0  # a dry run stops a case (or its ranks) only as a hang: no verdict on speed

GPU_TEST_FILES = [
    "tests/ops/test_offload.py",
    "tests/ops/test_attention.py",
    "tests/ops/test_logprobs.py",
    "tests/benchmarks/test_gpu_suite.py",
]


@dataclass(frozen=True)
class Ctx:
    dry: bool  # tiny shapes on CPU
    device: torch.device


def _goal(row: dict, text: str, met: bool | None) -> dict:
    if met is not None:
        row["goal"], row["goal_met"] = text, bool(met)
    return row


# -- environment and tests ------------------------------------------------------------------


def env_case(ctx: Ctx):
    import transformers

    row = {
        "bench": "env",
        "case": "versions",
        "variant": "-",
        "device": torch.cuda.get_device_name() if ctx.device.type == "cuda" else "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "cpus": os.cpu_count(),
    }
    for name in ("peft", "pydantic", "triton", "bitsandbytes"):
        try:
            row[name] = __import__(name).__version__
        except ImportError:
            row[name] = None
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        row.update(
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            memory_bytes=total,
            free_bytes=free,
        )
    row["note"] = f"{row['device']}, torch {row['torch']}, transformers {row['transformers']}"
    yield row


class _Outcomes:
    """pytest plugin: counts test outcomes (call phase; setup skips count as skipped)."""

    def __init__(self):
        self.counts = {"passed": 0, "failed": 0, "skipped": 0}
        self.failed: list[str] = []

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and not report.passed):
            outcome = report.outcome if report.outcome in self.counts else "failed"
            self.counts[outcome] += 1
            if outcome == "failed":
                self.failed.append(report.nodeid)


def pytest_case(ctx: Ctx):
    """The gpu-marked tests (on CPU they are collected and skipped)."""
    import pytest

    plugin = _Outcomes()
    start = time.perf_counter()
    files = [str(ROOT / f) for f in GPU_TEST_FILES]
    args = ["-q", "-m", "gpu", "-p", "no:cacheprovider", "--rootdir", str(ROOT), *files]
    rc = pytest.main(args, plugins=[plugin])
    row = {
        "bench": "pytest_gpu",
        "case": "-m gpu",
        "variant": "pytest",
        "time_s": round(time.perf_counter() - start, 2),
        "exit_code": int(rc),
        **plugin.counts,
        "failed_tests": plugin.failed[:10],
    }
    row["note"] = "{passed} passed, {failed} failed, {skipped} skipped".format(**plugin.counts)
    yield _goal(row, "no gpu test fails", plugin.counts["failed"] == 0 and int(rc) in (0, 5))


# -- end to end ------------------------------------------------------------------------------


def grpo_case(ctx: Ctx, model: str, tiny: str, peak_goal_gb: float, above_weights: bool):
    import grpo_step

    for row in grpo_step.case_rows(tiny if ctx.dry else model, ctx.device):
        if row.get("oom") or "error" in row:
            planned = row.get("planned_total")
            oom = f"out of memory (plan {planned / GB:.1f} GB)" if planned else "OOM"
            row["note"] = row.get("error") or oom
            yield row
            continue
        peak = row.get("peak_above_weights_bytes" if above_weights else "peak_bytes")
        ratios = row.get("plan_ratio", {})
        worst = max(ratios.items(), key=lambda kv: abs(kv[1] - 1), default=(None, None))
        row["note"] = (
            f"peak {_gb(row.get('peak_bytes'))}, above weights "
            f"{_gb(row.get('peak_above_weights_bytes'))}; plan ratio worst {worst[0]} {worst[1]}"
        )
        if row["variant"] == "all_on" and peak is not None:
            what = "peak above weights" if above_weights else "trainer peak"
            _goal(row, f"{what} < {peak_goal_gb:g} GB", peak < peak_goal_gb * GB)
        if peak is not None and ratios:
            row["plan_goal"] = "each measured term within 10% of `leangrpo plan`"
            row["plan_goal_met"] = all(0.9 <= r <= 1.1 for r in ratios.values())
        yield row


def context_parallel_case(ctx: Ctx):
    """One training step on one long sequence (benchmarks/context_parallel.py: each C in
    processes of its own), Qwen2.5-1.5B shape bf16, 16K tokens: C = 1, and C = 2 wherever two
    GPUs are visible (one GPU: a "needs 2 GPUs" row; the first multi-GPU machine yields the
    figure): peak memory per rank, mem_ratio of the activations against C = 1. Dry run: the
    tiny Llama, 512 tokens, C = 1 and 2 on CPU (gloo)."""
    import context_parallel

    model, tokens = ("tiny-llama", 512) if ctx.dry else ("qwen2.5-1.5b", 16384)
    limit_s = DRY_HANG_S if ctx.dry else 120.0  # a dry run's verdict never depends on speed
    for row in context_parallel.case_rows(model, tokens, [1, 2], limit_s=limit_s):
        if "error" in row or "skipped" in row:
            row["note"] = row.get("error") or f"skipped: {row['skipped']}"
        else:
            ratio = f", mem_ratio {row['mem_ratio']}" if "mem_ratio" in row else ""
            row["note"] = f"peak per rank {_gb(row['peak_bytes'])}{ratio}"
            if "mem_ratio" in row:
                judged = ctx.device.type == "cuda"
                met = row["mem_ratio"] <= 0.6 if judged else None
                _goal(row, "activation memory per rank at C = 2 <= 0.6 x C = 1", met)
        yield row


def qlora_case(ctx: Ctx):
    """One GRPO step, Qwen2.5-1.5B LoRA: bf16 base vs nf4 (benchmarks/qlora.py)."""
    import qlora

    for row in qlora.case_rows(ctx.device, dry=ctx.dry):
        if "error" in row:
            row["note"] = row["error"]
        else:
            ratio = f", mem_ratio {row['mem_ratio']}" if "mem_ratio" in row else ""
            row["note"] = (
                f"peak {_gb(row.get('peak_bytes'))}, weights {_gb(row.get('weights_bytes'))}{ratio}"
            )
        yield row


def shared_weights_case(ctx: Ctx):
    """Colocated vLLM sharing its weights with the policy vs two copies
    (benchmarks/shared_weights.py, each variant a process of its own): peak CUDA memory,
    sync time, tokens/s. Needs vLLM, which the GPU image lacks (its wheel is far over what
    a run may carry): then one row says so. With vLLM installed it takes about two
    minutes on its own: `gpu_suite.sh --only shared_weights`."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:  # not imported: a child never loads it
        yield {"bench": "shared_weights", "case": "-", "variant": "-",
               "skipped": "vLLM is not installed here", "note": "skipped: no vLLM"}  # fmt: skip
        return
    import shared_weights

    model = ROOT / "examples" / "demo" / "model" if ctx.dry else None
    modes = ["full"] if ctx.dry else ["full", "lora"]
    for row in shared_weights.case_rows(model, modes, "quick" if ctx.dry else "full"):
        if "error" in row:
            row["note"] = row["error"]
        elif row["case"].endswith("/memory") and "mem_ratio" in row:
            row["note"] = f"peak {_gb(row['peak_bytes'])}, mem_ratio {row['mem_ratio']}"
            judged = ctx.device.type == "cuda"
            _goal(
                row,
                "peak memory below the two-copy run's",
                row["mem_ratio"] < 1 if judged else None,
            )
        elif "tokens_per_s_ratio" in row:
            row["note"] = (
                f"{row['tokens_per_s']} tokens/s, x{row['tokens_per_s_ratio']} of two copies"
            )
            met = row["tokens_per_s_ratio"] >= 0.95 if ctx.device.type == "cuda" else None
            _goal(row, "generation speed unchanged (>= 0.95 x two copies)", met)
        elif "time_ratio" in row:
            row["note"] = f"{row['time_s']} s, x{row['time_ratio']} of two copies"
        yield row


def _gb(value) -> str:
    return "-" if value is None else f"{value / GB:.2f} GB"


def generation_case(ctx: Ctx):
    import hf_generation

    for row in hf_generation.case_rows("tiny-qwen2" if ctx.dry else "qwen2.5-1.5b", ctx.device):
        if "tokens_per_s" in row:
            row["note"] = f"{row['tokens_per_s']} tokens/s"
        elif "vs_ideal" in row:
            row["note"] = f"async/sync {row['time_ratio']}, vs ideal {row['vs_ideal']}"
        yield row


# -- offload, packing, log-probs ------------------------------------------------------------


def offload_case(ctx: Ctx):
    import offload

    name, tokens, repeats = (
        ("tiny-qwen2", [64, 128], 1)
        if ctx.dry
        else (
            "qwen2.5-1.5b",
            [8192, 16384, 32768],
            2,  # timed steps after one warm-up, per variant and length
        )
    )
    model = offload.build_model(name, max(tokens), ctx.device.type)
    device = torch.cuda.get_device_name() if ctx.device.type == "cuda" else "cpu"
    variants = ["checkpointing", "checkpointing+offload_hidden", "checkpointing+hf_offload"]
    min_bytes = 0 if ctx.dry else 1 << 20  # tiny layer inputs move too in a dry run
    if ctx.device.type != "cuda":  # transformers' save_on_cpu pins host memory
        variants.pop()
        yield {
            "bench": "offload",
            "case": name,
            "variant": "checkpointing+hf_offload",
            "skipped": "pins host memory: needs CUDA",
        }
    for n in tokens:
        for row in offload.case_rows(model, name, n, repeats, device, variants, min_bytes):
            if row["variant"] == "checkpointing+offload_hidden" and "time_ratio" in row:
                freed = row.get("freed_fraction")
                row["note"] = (
                    f"time x{row['time_ratio']:.3f}, moved {row.get('moved_fraction', 0):.2f}"
                    + ("" if freed is None else f", freed {freed:.2f} of the layer inputs")
                )
                met = row["time_ratio"] <= 1.03 if ctx.device.type == "cuda" else None
                _goal(row, "step time <= 1.03 x plain checkpointing", met)
            yield row


def packing_case(ctx: Ctx, backends=("torch_varlen", "sdpa_segments")):
    """Padded vs packed vs shared prefix at 40% and 60% padding (flex: its own case, as it
    compiles its kernels on first use)."""
    import packing

    from leangrpo.ops.attention.adapter import enable_packed_attention

    if ctx.dry:
        name, groups, width, prompts, repeats = "tiny-qwen2", 2, 64, (8, 16), 1
    else:
        name, groups, width, prompts, repeats = "qwen2.5-1.5b", 2, 1024, (64, 256), 2
    from models import build_model

    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    model = build_model(name, width, ctx.device, dtype)
    enable_packed_attention(model, "auto")
    vocab = model.config.vocab_size
    for padding in (0.4, 0.6):
        samples = packing.make_padded_batch(padding, groups, 8, width, vocab, prompts)
        for row in packing.layout_rows(model, samples, ctx.device, repeats, list(backends)):
            row["case"] = f"{row['case']}/pad{round(100 * padding)}"
            if "speedup" in row:
                target = 0.9 * row["ideal_speedup"]
                row["note"] = f"x{row['speedup']:.2f} (ideal x{row['ideal_speedup']:.2f})"
                judged = row["variant"].startswith("packed/") and not ctx.dry
                met = row["speedup"] >= target if judged else None
                _goal(row, f"speedup >= 0.9 x ideal = {target:.2f}", met)
            yield row


def logprobs_case(ctx: Ctx):
    import logprob_memory as lm

    if ctx.dry:
        tiles = {"row_tile": 512, "vocab_tile": 1024, "compile": "aot_eager"}
        cases = [
            (lm.Case("dry-2k-frozen", 2048, 64, 3000, "float32", "cpu"), True),
            (lm.Case("dry-2k-trainable", 2048, 64, 3000, "float32", "cpu"), False),
        ]
        warmup, repeats = 1, 1
    else:
        row_tile, vocab_tile = lm.DEFAULT_TILES["cuda"]
        tiles = {"row_tile": row_tile, "vocab_tile": vocab_tile, "compile": "inductor"}
        shape = dict(h=4096, v=128256, dtype="bfloat16", device="cuda")  # Llama-3.1-8B head
        cases = [
            (lm.Case("16k-frozen", 16384, **shape), True),
            (lm.Case("8x20k-frozen", 8 * 20480, **shape), True),
            (lm.Case("16k-trainable", 16384, **shape), False),
        ]
        warmup, repeats = 1, 3
    variants = ["baseline", "chunked", "chunked_compiled"]
    for case, frozen in cases:
        walls = {}

        def measure(variant, case=case, frozen=frozen, walls=walls):
            start = time.perf_counter()
            result = lm.measure_inprocess(case, variant, frozen, tiles, warmup, repeats)
            walls[variant] = time.perf_counter() - start
            return result

        rows = {}
        for row in lm.case_rows(case, variants, frozen, tiles, measure):
            if "time_s" in row:
                row["setup_and_warmup_s"] = round(
                    walls[row["variant"]] - repeats * row["time_s"], 2
                )
            _logprob_goal(row, ctx)
            rows[row["variant"]] = row
            yield row
        if case.n <= 16384:  # the full-logits reference fits: check the values too
            yield _agreement_row(case, lm.agreement(case, frozen, tiles, variants[1:]))
        yield _verdict(case.name, rows)


def _agreement_row(case, diffs: dict) -> dict:
    """Chunked (eager and compiled) against full logits on the measured inputs."""
    tol = (0.05, 0.02) if case.dtype == "bfloat16" else (1e-3, 1e-4)
    met = all(
        d["logprob_max_diff"] <= tol[0] and d["grad_rel_diff"] <= tol[1] for d in diffs.values()
    )
    row = {"bench": "logprob_memory", "case": case.name, "variant": "agreement", "diffs": diffs}
    worst = max((d["logprob_max_diff"] for d in diffs.values()), default=0.0)
    row["note"] = f"largest log-prob difference from full logits {worst:.3g}"
    return _goal(row, f"log-probs within {tol[0]}, hidden grads within {tol[1]} relative", met)


def _logprob_goal(row: dict, ctx: Ctx) -> None:
    if "error" in row:
        row["note"] = row["error"]
    if "mem_ratio" not in row:
        return
    row["note"] = f"mem x{row['mem_ratio']:.4f}, time x{row['time_ratio']:.3f}"
    if ctx.dry or row.get("lm_head") != "frozen":  # the goal is the LoRA (frozen head) case
        return
    met = row["mem_ratio"] <= 0.02 and row["time_ratio"] <= 1.1
    _goal(row, "memory <= 2% and time <= 1.1 x full logits", met)


def _verdict(case: str, rows: dict) -> dict:
    """Which chunked path is faster here; the default stays eager until this says compiled."""
    eager, compiled = rows.get("chunked", {}), rows.get("chunked_compiled", {})
    row = {"bench": "logprob_memory", "case": case, "variant": "verdict"}
    if eager.get("time_s") and compiled.get("time_s"):
        ratio = compiled["time_s"] / eager["time_s"]
        row.update(
            faster_chunked_path="compiled" if ratio < 1 else "eager",
            compiled_vs_eager=round(ratio, 4),
            compiled_vs_full=compiled.get("time_ratio"),
            eager_vs_full=eager.get("time_ratio"),
        )
        row["note"] = f"{row['faster_chunked_path']} is faster (compiled/eager x{ratio:.3f})"
    else:
        row["note"] = "no verdict: a chunked variant has no time"
    return row
