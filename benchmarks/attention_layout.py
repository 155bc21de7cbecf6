"""The sdpa_segments backend's layouts on CPU, and the fit of ops/attention/batching.py's call cost.

    python benchmarks/attention_layout.py [--reps 9]

1. `fit`: one SDPA call's fixed cost c0 (200 segments of 2 tokens against one segment of
   400) and the cost per unit of area x H x D (one segment of 2048 against 1024), with a
   backward and without; prints c0 / unit, the constant ops/attention/batching.py uses
   (CALL_COST_GRAD, CALL_COST_NO_GRAD).
2. `layouts`: the attention op alone, forward + backward, on rows of segments of several
   length mixes: per-segment SDPA (`segments`), the batched plan of this checkout
   (`batched`), one SDPA call over the whole row with a block-diagonal mask (`mask`).
Median wall milliseconds, one thread. One JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
import torch.nn.functional as F


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def segment_run(heads, kv_heads, dim, count, length, grad, reps) -> float:
    n = count * length
    q, k, v = (torch.randn(1, h, n, dim, requires_grad=grad) for h in (heads, kv_heads, kv_heads))

    def run():
        outs = [
            F.scaled_dot_product_attention(
                q[:, :, a : a + length],
                k[:, :, a : a + length],
                v[:, :, a : a + length],
                is_causal=True,
                enable_gqa=True,
            )
            for a in range(0, n, length)
        ]
        if grad:
            torch.cat(outs, 2).sum().backward()

    return median_ms(run, reps) / 1e3


def fit(reps: int) -> None:
    for heads, kv_heads, dim in ((2, 1, 32), (8, 2, 64), (14, 2, 64)):
        row = {"bench": "attention_layout", "case": "fit", "heads": heads, "head_dim": dim}
        for grad in (True, False):
            c0 = (
                segment_run(heads, kv_heads, dim, 200, 2, grad, reps)
                - segment_run(heads, kv_heads, dim, 1, 400, grad, reps)
            ) / 199
            big = segment_run(heads, kv_heads, dim, 1, 2048, grad, reps)
            small = segment_run(heads, kv_heads, dim, 1, 1024, grad, reps)
            unit = (big - small) / (2048**2 - 1024**2) / (heads * dim)
            key = "grad" if grad else "no_grad"
            row[f"{key}_call_ms"] = round(c0 * 1e3, 4)
            row[f"{key}_unit_ps"] = round(unit * 1e12, 4)
            row[f"{key}_call_cost"] = round(c0 / unit) if unit > 0 else None
        print(json.dumps(row), flush=True)


def layouts(reps: int) -> None:
    from leangrpo.ops.attention import batching

    rng = random.Random(0)
    cases = {
        "128x10": [10] * 128,
        "128x(7-12)": [rng.randint(7, 12) for _ in range(128)],
        "64x32": [32] * 64,
        "16x128": [128] * 16,
        "4x512": [512] * 4,
        "16x(50-300)": [rng.randint(50, 300) for _ in range(16)],
        "1x500+31x20": [500] + [20] * 31,
    }
    heads, kv_heads, dim = 2, 1, 32  # the demo model's attention
    for name, lens in cases.items():
        bounds = [0]
        for n in lens:
            bounds.append(bounds[-1] + n)
        n = bounds[-1]
        q, k, v = (torch.randn(1, h, n, dim) for h in (heads, kv_heads, kv_heads))
        doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        idx = torch.arange(n)
        mask = (doc[:, None] == doc[None, :]) & (idx[:, None] >= idx[None, :])
        plan = batching.plan_causal(bounds, batching.call_cost(heads * dim, True), "cpu")

        def segments(q, k, v, bounds=bounds):
            return torch.cat(
                [
                    F.scaled_dot_product_attention(
                        q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, enable_gqa=True
                    )
                    for a, b in zip(bounds[:-1], bounds[1:])
                ],
                2,
            )

        def batched(q, k, v, plan=plan):
            return batching.run_plan(q, k, v, plan, dim**-0.5, 0.0)

        def masked(q, k, v, mask=mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

        variants = {"segments": segments, "batched": batched, "mask": masked}
        row = {"bench": "attention_layout", "case": name, "tokens": n, "calls": len(plan.calls)}
        for variant, fn in variants.items():

            def step(fn=fn, qkv=(q, k, v)):
                leaves = [t.detach().requires_grad_() for t in qkv]
                fn(*leaves).sum().backward()

            row[f"{variant}_ms"] = round(median_ms(step, reps), 3)
        print(json.dumps(row), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args()
    torch.set_num_threads(1)
    fit(args.reps)
    layouts(args.reps)


if __name__ == "__main__":
    main()
