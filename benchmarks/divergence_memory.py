"""Peak memory and time of the distillation divergence (generalised JSD) between a student's
and a teacher's next-token distributions, forward + backward into the student.

Baseline: both models' full logits (N, V) in fp32 with autograd -> log_softmax -> the
divergence term by term (`leangrpo.ops.logprobs.divergence.naive_divergence`).
Variants: leangrpo's `chunked_divergence` (row x vocabulary tiles, online log-sum-exp, the
student's log-probs and entropy from the same sweep, recomputing backward) and TRL's
`ChunkedDivergenceFunction` (its torch path on CPU) when TRL is installed (the `bench`
extra). Student hidden states and lm_head weight both trainable; the teacher's detached.

Memory (CPU): one subprocess per variant, peak RSS (ru_maxrss) minus RSS after the inputs
were created (`peak_bytes`); on CUDA torch.cuda.max_memory_allocated minus the inputs.

    python benchmarks/divergence_memory.py --quick   # N 1024, V 32768
    python benchmarks/divergence_memory.py           # N 4096, V 49152 (SmolLM2's vocabulary)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time

import torch

from leangrpo.ops.logprobs.divergence import chunked_divergence, naive_divergence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device_info import device_name  # noqa: E402

BENCH = "divergence_memory"
VARIANTS = ["baseline", "chunked", "trl"]  # baseline first
BETA, TEMPERATURE = 0.5, 0.7


def inputs(n: int, hs: int, ht: int, vocab: int, device: str):
    g = torch.Generator().manual_seed(0)
    student = [torch.randn(n, hs, generator=g), 0.02 * torch.randn(vocab, hs, generator=g)]
    teacher = [torch.randn(n, ht, generator=g), 0.02 * torch.randn(vocab, ht, generator=g)]
    targets = torch.randint(0, vocab, (n,), generator=g)
    student = [t.to(device).requires_grad_(True) for t in student]
    return student, [t.to(device) for t in teacher], targets.to(device)


def run(variant: str, student, teacher, targets) -> float:
    """One forward + backward; returns the mean divergence."""
    hs, ws = student
    ht, wt = teacher
    if variant == "trl":
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        div, _ = ChunkedDivergenceFunction.apply(hs, ws, None, ht, wt, None, BETA, TEMPERATURE)
    else:
        fn = chunked_divergence if variant == "chunked" else naive_divergence
        div = fn(hs, ws, ht, wt, targets, beta=BETA, temperature=TEMPERATURE)[0]
    div.mean().backward()
    return float(div.mean())


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(args) -> dict:
    torch.set_num_threads(args.threads)
    student, teacher, targets = inputs(args.n, args.hs, args.ht, args.vocab, args.device)
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss_bytes()
    t0 = time.perf_counter()
    value = run(args.child, student, teacher, targets)
    if args.device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"time_s": time.perf_counter() - t0, "peak_bytes": peak, "divergence": value}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    for name, default in (("n", 4096), ("hs", 576), ("ht", 960), ("vocab", 49152)):
        p.add_argument(f"--{name}", type=int, default=default)
    args = p.parse_args()
    if args.quick:
        args.n, args.vocab = 1024, 32768
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    case = f"N{args.n}_Hs{args.hs}_Ht{args.ht}_V{args.vocab}_beta{BETA}"
    device = device_name(args.device, threads=args.threads)
    base = None
    for variant in VARIANTS:
        row = {"bench": BENCH, "case": case, "device": device, "variant": variant}
        if variant == "trl" and importlib.util.find_spec("trl") is None:
            print(json.dumps({**row, "skipped": "TRL is not installed"}), flush=True)
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--child", variant,
               "--device", args.device, "--threads", str(args.threads),
               "--n", str(args.n), "--hs", str(args.hs), "--ht", str(args.ht),
               "--vocab", str(args.vocab)]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        if out.returncode or not lines:
            print(json.dumps({**row, "error": (out.stderr.strip().splitlines() or ["?"])[-1]}))
            continue
        row.update(json.loads(lines[-1]))
        if base is None:
            base = row
        else:
            row["time_ratio"] = row["time_s"] / base["time_s"]
            row["mem_ratio"] = row["peak_bytes"] / base["peak_bytes"]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
