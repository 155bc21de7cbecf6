"""Padded vs packed vs packed + shared prefix.  python benchmarks/packing.py [--quick]

GRPO-shaped batches (G completions per prompt; prompts uniform in [50, 300] tokens;
completions lognormal, clipped at 4x the median) through a random Qwen2-architecture model.
Cases: `score` (no-grad forward) and `train` (forward + backward); all variants compute
the backbone, then lm_head + log-softmax only at completion positions, so the difference
is the layout alone. Variants: `padded` (baseline: left-padded rows + attention_mask,
transformers SDPA), `packed` (one row, the leangrpo adapter), `packed_prefix` (each
group's prompt encoded once). Log-probs of the three are checked to agree.

peak_bytes: CUDA max_memory_allocated; on CPU the peak of live tensor bytes created during
the step (a dispatch mode that counts storages, measured in an extra untimed run).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from device_info import device_name  # noqa: E402

from leangrpo.contracts import Completion, Prompt, RolloutSample  # noqa: E402
from leangrpo.ops.attention.adapter import (  # noqa: E402
    PREFIX_BACKENDS,
    backend_unavailable_reason,
    enable_packed_attention,
    packed_model_kwargs,
    register_packed_attention,
)
from leangrpo.ops.logprobs.api import chunked_logprobs  # noqa: E402
from leangrpo.train.packing import pack_samples  # noqa: E402


def make_batch(groups, group_size, median, vocab, prompt_range=(50, 300), seed=0):
    rng = random.Random(seed)
    sigma = math.log(4) / 2.33  # the 99th percentile at ~4x the median, then clipped there
    samples = []
    for gid in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(*prompt_range))]
        for _ in range(group_size):
            n = max(1, min(4 * median, int(rng.lognormvariate(math.log(median), sigma))))
            comp = Completion([rng.randrange(vocab) for _ in range(n)], "", [0.0] * n, "stop", 0)
            samples.append(RolloutSample(gid, Prompt(gid, "", prompt), comp))
    return samples


def make_padded_batch(padding, groups, group_size, width, vocab, prompt_range, seed=0):
    """GRPO-shaped batch whose left-padded layout is `padding` padding (to ~0.5%).

    Each group shares one prompt (length uniform in `prompt_range`); sample i has total
    length P + (width - P) * u_i^k (u_i uniform, the first sample u = 1, so the padded width
    is `width`), with k found by bisection: larger k, shorter completions, more padding.
    """
    rng = random.Random(seed)
    prompt_lens = [rng.randint(*prompt_range) for _ in range(groups)]
    u = [1.0] + [rng.random() for _ in range(groups * group_size - 1)]

    def lengths(k: float) -> list[int]:
        out = []
        for i, ui in enumerate(u):
            p = prompt_lens[i // group_size]
            out.append(p + max(1, round((width - p) * ui**k)))
        return out

    def pad(k: float) -> float:
        return 1 - sum(lengths(k)) / (len(u) * width)

    lo, hi = 1e-3, 1e3
    for _ in range(60):  # geometric bisection: k spans six decades
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if pad(mid) < padding else (lo, mid)
    samples = []
    for i, total in enumerate(lengths(hi)):
        gid = i // group_size
        if i % group_size == 0:
            prompt = Prompt(gid, "", [rng.randrange(vocab) for _ in range(prompt_lens[gid])])
        n = total - len(prompt.ids)
        comp = Completion([rng.randrange(vocab) for _ in range(n)], "", [0.0] * n, "stop", 0)
        samples.append(RolloutSample(gid, prompt, comp))
    return samples


def variant_unavailable(backend: str, device) -> str | None:
    """Why a packed variant cannot run here (None when it can)."""
    reason = backend_unavailable_reason(backend, device.type)
    if reason is None and backend == "flex" and device.type != "cuda":
        # CPU runs flex unfused (and has no backward): nothing worth timing
        reason = "flex attention is fused only on CUDA: needs CUDA"
    return reason


def layout_rows(model, samples, device, repeats: int, backends, chunked: bool = True):
    """Score and train rows: padded (baseline) vs packed and packed_prefix per backend.

    Every variant's log-probs are first checked against the padded ones; a backend that
    cannot run here gets one `skipped` row per case.
    """
    padded, padded_tokens = padded_inputs(samples, device)
    plain = pack_samples(samples, device=device)
    prefix = pack_samples(samples, shared_prefix=True, device=device)
    padding = 1 - plain.num_tokens / padded_tokens
    info = {
        "bench": "packing",
        "device": device_name(device.type),
        "sequences": len(samples),
        "padding_fraction": round(padding, 4),
        "ideal_speedup": round(1 / (1 - padding), 4),
        "tokens": {
            "padded": padded_tokens,
            "packed": plain.num_tokens,
            "prefix": prefix.num_tokens,
        },
    }
    for case in ("score", "train"):
        train = case == "train"
        variants = {"padded": ("sdpa_segments", lambda: logprobs_padded(model, padded, chunked))}
        for backend in backends:
            for name, batch in (("packed", plain), ("packed_prefix", prefix)):
                label = f"{name}/{backend}"
                reason = variant_unavailable(backend, device)
                if reason is None and name == "packed_prefix" and backend not in PREFIX_BACKENDS:
                    continue  # no shared-prefix kernel: nothing to measure
                if reason is not None:
                    yield {**info, "case": case, "variant": label, "skipped": reason}
                    continue
                variants[label] = (backend, lambda b=batch: logprobs_packed(model, b, chunked))
        errors = _disagreement(model, variants, device)
        results = run_case(model, variants, train, device, repeats)
        base_t, base_peak = results["padded"]
        for name, (t, peak) in results.items():
            row = {**info, "case": case, "variant": name, "time_s": round(t, 5), "peak_bytes": peak}
            if name != "padded":
                row.update(
                    attention=variants[name][0],
                    logprob_diff_vs_padded=errors[name],
                    time_ratio=round(t / base_t, 4),
                    mem_ratio=round(peak / max(1, base_peak), 4),
                    speedup=round(base_t / t, 3),
                )
            yield row


def _disagreement(model, variants, device) -> dict[str, dict[str, float]]:
    """Max and mean |log-prob difference| of each variant against the padded baseline."""
    out = {}
    with torch.no_grad():
        ref = variants["padded"][1]()
        for name, (backend, step) in variants.items():
            register_packed_attention(backend, device.type)
            diff = (step() - ref).abs()
            out[name] = {"max": round(diff.max().item(), 5), "mean": round(diff.mean().item(), 6)}
    return out


def make_model(device, dtype, quick: bool):
    from transformers import AutoModelForCausalLM, Qwen2Config

    if quick:
        shape = dict(
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    else:
        shape = dict(
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=12,
            num_attention_heads=16,
            num_key_value_heads=4,
        )
    config = Qwen2Config(
        vocab_size=4096, max_position_embeddings=4096, tie_word_embeddings=False, **shape
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).train()


def padded_inputs(samples, device):
    seqs = [s.prompt.ids + s.completion.ids for s in samples]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    rows, cols, targets = [], [], []
    for i, (s, seq) in enumerate(zip(samples, seqs)):
        start = width - len(seq)
        ids[i, start:], mask[i, start:] = torch.tensor(seq), 1
        p, r = len(s.prompt.ids), len(s.completion.ids)
        rows += [i] * r
        cols += list(range(start + p - 1, start + p + r - 1))
        targets += s.completion.ids
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    index = (torch.tensor(rows), torch.tensor(cols))
    fields = (ids, mask, position_ids, *index, torch.tensor(targets))
    return [t.to(device) for t in fields], len(seqs) * width


def head_logprobs(model, hidden, targets, chunked: bool = False):
    """lm_head + log-softmax at the completion positions only: full logits, or chunked."""
    if chunked:
        return chunked_logprobs(hidden, model.lm_head.weight, targets)[0]
    return model.lm_head(hidden).float().log_softmax(-1).gather(-1, targets[:, None])[:, 0]


def logprobs_padded(model, inputs, chunked: bool = False):
    ids, mask, position_ids, rows, cols, targets = inputs
    hidden = model.model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state[rows, cols]
    return head_logprobs(model, hidden, targets, chunked)


def logprobs_packed(model, batch, chunked: bool = False):
    out = model.model(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        use_cache=False,
        **packed_model_kwargs(batch),
    )
    hidden = out.last_hidden_state[0].index_select(0, batch.completion_index)
    return head_logprobs(model, hidden, batch.targets, chunked)


class LiveBytes(TorchDispatchMode):
    """Peak bytes of storages created under the mode and still referenced (CPU peak proxy)."""

    def __init__(self):
        super().__init__()
        self.live, self.refs, self.peak = 0, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t)
        return out

    def _track(self, t):
        key = t.untyped_storage().data_ptr()
        if key not in self.refs:
            self.refs[key] = [t.untyped_storage().nbytes(), 0]
            self.live += self.refs[key][0]
            self.peak = max(self.peak, self.live)
        self.refs[key][1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key):
        entry = self.refs.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.live -= entry[0]
                del self.refs[key]


def run_once(model, step, train: bool, device) -> float:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    if train:
        step().sum().backward()
    else:
        with torch.no_grad():
            step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def peak_bytes(model, step, train: bool, device) -> int:
    """One (warm-up) step measured for peak memory."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run_once(model, step, train, device)
        return torch.cuda.max_memory_allocated() - base
    mode = LiveBytes()
    with mode:
        run_once(model, step, train, device)
    return mode.peak


def run_case(model, variants, train: bool, device, repeats: int) -> dict[str, tuple[float, int]]:
    """Variants interleaved round-robin (fair under a noisy machine); min time per variant."""
    peaks, times = {}, {name: [] for name in variants}
    for name, (backend, step) in variants.items():
        register_packed_attention(backend, device.type)
        peaks[name] = peak_bytes(model, step, train, device)
    for _ in range(repeats):
        for name, (backend, step) in variants.items():
            register_packed_attention(backend, device.type)
            times[name].append(run_once(model, step, train, device))
    return {name: (min(times[name]), peaks[name]) for name in variants}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU-sized run (~1-2 minutes)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads (default 1: on a shared, oversubscribed CPU, OpenMP barriers "
        "dominate many-small-op timings at 2+ threads)",
    )
    parser.add_argument(
        "--prompt-range",
        type=int,
        nargs=2,
        default=(50, 300),
        help="prompt lengths, uniform in [min, max]",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    quick = args.quick or device.type == "cpu"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    groups, group_size, median = (2, 8, 100) if quick else (8, 8, 300)
    repeats = args.repeats or (2 if quick else 5)
    model = make_model(device, dtype, quick)
    backend = enable_packed_attention(model, "auto")
    samples = make_batch(groups, group_size, median, model.config.vocab_size, args.prompt_range)
    padded, padded_tokens = padded_inputs(samples, device)
    plain = pack_samples(samples, device=device)
    prefix = pack_samples(samples, shared_prefix=True, device=device)
    real = plain.num_tokens
    prompt_tokens = sum(len(s.prompt.ids) for s in samples)
    info = {
        "bench": "packing",
        "device": device_name(device.type),
        "dtype": str(dtype).split(".")[-1],
        "backend": backend,
        "sequences": len(samples),
        "group_size": group_size,
        "padding_fraction": round(1 - real / padded_tokens, 4),
        "prompt_fraction": round(prompt_tokens / real, 4),
        "tokens": {"padded": padded_tokens, "packed": real, "packed_prefix": prefix.num_tokens},
    }
    prefix_backend = backend if backend in PREFIX_BACKENDS else "flex"
    _check_agreement(model, padded, plain, prefix, dtype, backend, prefix_backend)
    variants = {
        "padded": (backend, lambda: logprobs_padded(model, padded)),
        "packed": (backend, lambda: logprobs_packed(model, plain)),
        "packed_prefix": (prefix_backend, lambda: logprobs_packed(model, prefix)),
    }
    for case in ("score", "train"):
        results = run_case(model, variants, case == "train", device, repeats)
        base_t, base_peak = results["padded"]
        for name, (t, peak) in results.items():
            row = {
                **info,
                "case": case,
                "variant": name,
                "attention": variants[name][0],
                "time_s": round(t, 4),
                "peak_bytes": peak,
            }
            if name != "padded":
                row["time_ratio"] = round(t / base_t, 4)
                row["mem_ratio"] = round(peak / max(1, base_peak), 4)
                row["speedup"] = round(base_t / t, 3)
            print(json.dumps(row), flush=True)


def _check_agreement(model, padded, plain, prefix, dtype, backend, prefix_backend) -> None:
    device_type = plain.input_ids.device.type
    with torch.no_grad():
        register_packed_attention(backend, device_type)
        a = logprobs_padded(model, padded)
        b = logprobs_packed(model, plain)
        register_packed_attention(prefix_backend, device_type)
        c = logprobs_packed(model, prefix)
    tol = 1e-3 if dtype == torch.float32 else 0.1
    err = max((a - b).abs().max().item(), (b - c).abs().max().item())
    if err > tol:
        raise SystemExit(f"packed log-probs disagree with padded ones by {err:.3g} (> {tol})")


if __name__ == "__main__":
    main()
