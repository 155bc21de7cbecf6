"""Peak memory and time of per-token log-probs through the lm_head, forward + backward.

Baseline: full logits (N, V) -> fp32 -> log_softmax -> gather, with autograd (what TRL does).
Variants: leangrpo's chunked_logprobs, eager and torch.compile'd (`chunked_compiled`, CUDA
only here: `logprobs.compile`); Liger's LigerFusedLinearGRPOLoss (a whole GRPO loss,
beta=0, on the same tokens) when liger_kernel is installed.

Memory: on CUDA, torch.cuda.max_memory_allocated minus what the inputs hold; on CPU, one
subprocess per variant, peak RSS (ru_maxrss) minus RSS after the inputs were created
("peak_extra_bytes"; "peak_bytes" is the same figure, so mem_ratio compares the extras).
Both hidden and the lm_head weight require grad (full fine-tuning: the harder case);
`--frozen-lm-head` freezes the weight (the LoRA case: no weight gradient).

    python benchmarks/logprob_memory.py --quick     # the CPU case only, one timed run
    python benchmarks/logprob_memory.py             # + the GPU cases when CUDA is present
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

from leangrpo.ops.logprobs.api import DEFAULT_TILES, chunked_logprobs, naive_logprobs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device_info import device_name  # noqa: E402

BENCH = "logprob_memory"


@dataclass(frozen=True)
class Case:
    name: str
    n: int  # completion tokens
    h: int  # hidden size
    v: int  # vocabulary
    dtype: str
    device: str


CASES = [
    Case("cpu-8k-h512-v32k", 8192, 512, 32000, "float32", "cpu"),
    Case("gpu-16k-h4096-v128k", 16384, 4096, 128256, "bfloat16", "cuda"),
    Case("gpu-160k-h4096-v128k", 8 * 20480, 4096, 128256, "bfloat16", "cuda"),
]
VARIANTS = ["baseline", "chunked", "chunked_compiled", "liger"]


def has_liger() -> bool:
    try:
        import liger_kernel.chunked_loss  # noqa: F401
    except ImportError:
        return False
    return True


def make_inputs(case: Case, frozen: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=case.device).manual_seed(0)
    dtype = getattr(torch, case.dtype)
    hidden = torch.randn(case.n, case.h, generator=g, device=case.device, dtype=dtype)
    weight = torch.randn(case.v, case.h, generator=g, device=case.device, dtype=dtype)
    weight.mul_(case.h**-0.5)
    targets = torch.randint(0, case.v, (case.n,), generator=g, device=case.device)
    return hidden.requires_grad_(), weight.requires_grad_(not frozen), targets


def step(variant: str, hidden, weight, targets, tiles: dict) -> None:
    """One forward + backward of a GRPO-like token loss; grads are dropped afterwards.

    `tiles` holds row_tile / vocab_tile, and for chunked_compiled the torch.compile backend
    under "compile" (default inductor).
    """
    advantages = torch.linspace(-1.0, 1.0, hidden.shape[0], device=hidden.device)
    if variant == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False)
        ones = torch.ones(1, hidden.shape[0], device=hidden.device)
        loss, _ = loss_fn(hidden[None], weight, targets[None], ones, advantages[:1])
    else:
        kw = {k: v for k, v in tiles.items() if k != "compile"}
        if variant == "baseline":
            logprobs, _ = naive_logprobs(hidden, weight, targets)
        elif variant == "chunked":
            logprobs, _ = chunked_logprobs(hidden, weight, targets, **kw)
        else:
            backend = tiles.get("compile", True)
            logprobs, _ = chunked_logprobs(hidden, weight, targets, **kw, compile=backend)
        loss = -(torch.exp(logprobs - logprobs.detach()) * advantages).sum()
    loss.backward()
    hidden.grad = None
    weight.grad = None


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed(variant: str, inputs, tiles: dict, warmup: int, repeats: int) -> tuple[float, float]:
    """(median wall seconds, median process CPU seconds) of one forward + backward."""
    cuda = inputs[0].is_cuda
    for _ in range(warmup):
        step(variant, *inputs, tiles)
    walls, cpus = [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        w0, c0 = time.perf_counter(), time.process_time()
        step(variant, *inputs, tiles)
        if cuda:
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return sorted(walls)[len(walls) // 2], sorted(cpus)[len(cpus) // 2]


def measure_cpu_child(case: Case, variant: str, tiles: dict, args: argparse.Namespace) -> dict:
    """Runs inside the per-variant subprocess: peak RSS above the inputs."""
    inputs = make_inputs(case, args.frozen_lm_head)
    rss_inputs = rss_bytes()
    time_s, cpu_s = timed(variant, inputs, tiles, args.warmup, args.repeats)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    extra = peak - rss_inputs
    return {
        "time_s": time_s,
        "cpu_time_s": cpu_s,
        "peak_bytes": extra,
        "peak_extra_bytes": extra,
        "peak_rss_bytes": peak,
        "inputs_rss_bytes": rss_inputs,
    }


def measure_cpu(case: Case, variant: str, args: argparse.Namespace) -> dict:
    row_tile, vocab_tile = resolve_tiles(case, args)
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        variant,
        "--case",
        case.name,
        "--warmup",
        str(args.warmup),
        "--repeats",
        str(args.repeats),
        "--row-tile",
        str(row_tile),
        "--vocab-tile",
        str(vocab_tile),
        *(["--frozen-lm-head"] if args.frozen_lm_head else []),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "failed"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_cuda(case: Case, variant: str, args: argparse.Namespace, tiles: dict) -> dict:
    inputs = make_inputs(case, args.frozen_lm_head)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    oom = False
    try:
        time_s, cpu_s = timed(variant, inputs, tiles, args.warmup, args.repeats)
    except torch.cuda.OutOfMemoryError:
        oom = True  # handled below, once the exception no longer holds the step's tensors
    del inputs
    extra = torch.cuda.max_memory_allocated() - base
    torch.cuda.empty_cache()
    if oom:
        return {"error": "CUDA out of memory", "peak_bytes_before_oom": extra}
    return {"time_s": time_s, "cpu_time_s": cpu_s, "peak_bytes": extra, "peak_extra_bytes": extra}


def run_case(case: Case, args: argparse.Namespace) -> None:
    row_tile, vocab_tile = resolve_tiles(case, args)
    tiles = {"row_tile": row_tile, "vocab_tile": vocab_tile, "compile": args.compile_backend}
    variants = [v for v in VARIANTS if v != "liger" or has_liger()]
    if "liger" not in variants:
        print(f"# {case.name}: liger_kernel not installed, Liger variant skipped", file=sys.stderr)
    if case.device == "cpu":  # compiling on CPU costs minutes and says nothing about CUDA
        variants.remove("chunked_compiled")

    def measure(variant: str) -> dict:
        if case.device == "cpu":
            return measure_cpu(case, variant, args)
        return measure_cuda(case, variant, args, tiles)

    for row in case_rows(case, variants, args.frozen_lm_head, tiles, measure):
        print(json.dumps(row), flush=True)


def case_rows(case: Case, variants: list[str], frozen: bool, tiles: dict, measure):
    """One row per variant, the baseline first; `measure(variant)` returns the figures."""
    baseline = None
    for variant in variants:
        result = measure(variant)
        shape = {k: v for k, v in asdict(case).items() if k not in ("name", "device")}
        shape["lm_head"] = "frozen" if frozen else "trainable"
        row = {
            "bench": BENCH,
            "case": case.name,
            "device": device_name(case.device),
            "variant": variant,
            **shape,
            **(chunked_options(tiles, variant) if variant.startswith("chunked") else {}),
            **result,
        }
        if variant == "baseline":
            baseline = result if "error" not in result else None
        elif baseline is not None and "error" not in result:
            row["time_ratio"] = result["time_s"] / baseline["time_s"]
            row["mem_ratio"] = result["peak_bytes"] / baseline["peak_bytes"]
        yield row


def agreement(case: Case, frozen: bool, tiles: dict, variants: list[str]) -> dict:
    """Each variant against the baseline on the same inputs: log-prob and hidden-grad error.

    `logprob_max_diff` is the largest |difference| of the log-probs, `grad_rel_diff`
    ||grad_variant - grad_baseline|| / ||grad_baseline|| for the hidden states.
    """
    hidden, weight, targets = make_inputs(case, frozen)
    out, ref = {}, None
    for variant in ["baseline", *[v for v in variants if v != "baseline"]]:
        h = hidden.detach().clone().requires_grad_()
        kw = {k: v for k, v in tiles.items() if k != "compile"}
        if variant == "baseline":
            lp, _ = naive_logprobs(h, weight, targets)
        else:
            backend = tiles.get("compile", True) if variant == "chunked_compiled" else False
            lp, _ = chunked_logprobs(h, weight, targets, **kw, compile=backend)
        lp.sum().backward()
        got = (lp.detach().float(), h.grad.float())
        if ref is None:
            ref = got
            continue
        out[variant] = {
            "logprob_max_diff": (got[0] - ref[0]).abs().max().item(),
            "grad_rel_diff": ((got[1] - ref[1]).norm() / ref[1].norm()).item(),
        }
    return out


def chunked_options(tiles: dict, variant: str) -> dict:
    return {k: v for k, v in tiles.items() if k != "compile" or variant == "chunked_compiled"}


def measure_inprocess(case: Case, variant: str, frozen: bool, tiles: dict, warmup, repeats):
    """Any device, in this process: CUDA peak from the allocator, CPU peak from live tensors.

    On CPU the peak is that of tensors created during one extra, untimed step (packing.py's
    LiveBytes), not RSS: cheap enough for a dry run, the subprocess RSS path stays `main`'s.
    """
    if case.device != "cpu":
        args = argparse.Namespace(frozen_lm_head=frozen, warmup=warmup, repeats=repeats)
        return measure_cuda(case, variant, args, tiles)
    from packing import LiveBytes

    inputs = make_inputs(case, frozen)
    time_s, cpu_s = timed(variant, inputs, tiles, warmup, repeats)
    mode = LiveBytes()
    with mode:
        step(variant, *inputs, tiles)
    return {"time_s": time_s, "cpu_time_s": cpu_s, "peak_bytes": mode.peak}


def resolve_tiles(case: Case, args: argparse.Namespace) -> tuple[int, int]:
    rows, vocab = DEFAULT_TILES.get(case.device, DEFAULT_TILES["cuda"])
    return args.row_tile or rows, args.vocab_tile or vocab


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--frozen-lm-head", action="store_true", help="lm_head weight without grad")
    p.add_argument("--quick", action="store_true", help="CPU case only, one timed run, no warmup")
    p.add_argument("--case", choices=[c.name for c in CASES], help="run only this case")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--row-tile", type=int, default=None, help="default: DEFAULT_TILES[device]")
    p.add_argument("--vocab-tile", type=int, default=None, help="default: DEFAULT_TILES[device]")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--compile-backend", default="inductor", help="for chunked_compiled")
    args = p.parse_args()
    args.warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1)
    args.repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    cases = {c.name: c for c in CASES}
    if args.child:
        tiles = {"row_tile": args.row_tile, "vocab_tile": args.vocab_tile}
        result = measure_cpu_child(cases[args.case], args.child, tiles, args)
        print(json.dumps(result))
        return
    selected = (
        [cases[args.case]]
        if args.case
        else [c for c in CASES if c.device == "cpu" or not args.quick]
    )
    for case in selected:
        if case.device == "cuda" and not torch.cuda.is_available():
            print(f"# {case.name}: no CUDA device, skipped", file=sys.stderr)
            continue
        run_case(case, args)


if __name__ == "__main__":
    main()
