"""One copy of the weights: colocated vLLM sharing its tensors with the policy, vs two copies.

    .venv-vllm/bin/python benchmarks/shared_weights.py [--quick | --smallest] [--model DIR] [--modes full,lora]

Each (mode, variant) runs in a child process of its own, so its peak memory is its own,
through the trainer's own set-up (`rollout.factory.start_shared_engine`,
`model.policy.load_policy`, `rollout.factory.make_engines`):
- `two_copies` (the baseline): the policy loaded from disk, then the colocated engine with
  its own weights (on CPU prepacked for oneDNN), as `rollout.vllm.share_weights: false`,
  but with its engine core in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so that
  the trainer's memory and vLLM's are one figure;
- `shared`: the engine first, then the policy on views of its tensors
  (`share_weights: true`).
In each child: generation (a warm-up call, then `rounds` timed calls of P prompts x n
completions of up to T tokens, temperature 1, seeded alike), the trainer's standby call
(`engine.sleep()`: a no-op on CPU), one training step (forward + backward + AdamW on
`rows` x `tokens` random tokens: full fine-tuning, or LoRA r=16 on every linear layer), then `rounds` weight syncs
of what the trainer sends (`update_weights(policy.named_trainable_tensors())`): with two
copies today's file path (safetensors buckets, or a peft directory), shared in place (a
prefix-cache reset) or the adapter's tensors in memory.

Rows (one JSON object per line, DESIGN.md's format): case `memory` (`peak_bytes`: on CPU the
child's peak RSS, VmHWM; on CUDA the device memory in use, sampled after each phase, at
its highest, minus before start: vLLM's allocations included), `generate` (`time_s` per
call, `tokens_per_s`), `sync` (`time_s`, the median). Every `shared` row carries
`time_ratio` and `mem_ratio` (shared / two_copies), `generate` also `tokens_per_s_ratio`.
On CPU, cases `gemm/M<rows>/<layer>` time one linear layer of the model as each variant
serves it (`gemm_rows`: vLLM's prepacked oneDNN matmul vs F.linear on the shared weight).
The shared child checks every base parameter's storage pointer and offset against its
vLLM view after the syncs (`shared_params`, `unshared_params` on its memory row).

Sizes: `--quick` (full fine-tuning only, small calls), `--smallest` (full fine-tuning only,
the smallest calls and one gemm call each: what tests/rollout/test_vllm_sharing.py runs,
for the memory figures and the views; its times measure nothing), the default the rest.

Model: SmolLM2-135M-Instruct in fp32 (`leangrpo.model.smollm2`'s converted directory) on
CPU; `--model DIR` another; on CUDA without --model, Qwen2.5-1.5B's shape (models.py) with
random weights in bf16, saved to a temporary directory (no tokenizer: vLLM skips its own).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "src")]
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: JSON lines only
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

VARIANTS = ("two_copies", "shared")
KV_CACHE_BYTES = {"cpu": 64 << 20, "cuda": 2 << 30}  # the same KV cache in both variants
SIZES = {  # prompts, completions per prompt, max new tokens, timed rounds, the training
    # step's rows x tokens, calls timed per gemm case
    "smallest": dict(prompts=2, n=1, new=2, rounds=1, rows=1, tokens=8, gemm_repeats=1),
    "quick": dict(prompts=4, n=2, new=16, rounds=2, rows=4, tokens=64, gemm_repeats=10),
    "full": dict(prompts=8, n=4, new=32, rounds=3, rows=8, tokens=64, gemm_repeats=50),
}
PROMPT_TOKENS = 32


def device_name() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_model(device: str, work: Path) -> tuple[Path, bool]:
    """(model directory, whether it has a tokenizer)."""
    if device == "cuda":
        from models import build_model

        model = build_model("qwen2.5-1.5b", 4096, "cpu")
        model.save_pretrained(work / "qwen2.5-1.5b")
        return work / "qwen2.5-1.5b", False
    from leangrpo.model.smollm2 import find_converted, missing_reason, smollm2_dir

    found = smollm2_dir() if missing_reason() is None else find_converted()
    if found is None:
        raise SystemExit(f"no SmolLM2 directory: {missing_reason()}; or pass --model DIR")
    return found, True


def run_config(model: Path, mode: str, variant: str, device: str, tokenizer: bool) -> dict:
    kwargs = {"kv_cache_memory_bytes": KV_CACHE_BYTES[device]}
    if not tokenizer:
        kwargs["skip_tokenizer_init"] = True
    lora = {"enabled": mode == "lora", "r": 16, "alpha": 32}
    lora["target_modules"] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # fmt: skip
    return {
        "run": {"device": device, "output_dir": "/tmp/unused", "seed": 0},
        "model": {
            "name_or_path": str(model),
            "dtype": "float32" if device == "cpu" else "bfloat16",
            "gradient_checkpointing": False,
        },
        "lora": lora,
        "data": {"path": "unused.jsonl"},
        "rewards": {"functions": ["math"]},
        "rollout": {
            "engine": "vllm",
            "vllm": {
                "mode": "colocate",
                "share_weights": variant == "shared",
                "enforce_eager": True,
                "max_model_len": 512,
                "engine_kwargs": kwargs,
            },
        },
        "train": {"learning_rate": 1e-5},
    }


class Meter:
    """Peak memory of this process: VmHWM on CPU; device memory in use on CUDA (sampled)."""

    def __init__(self, device: str):
        import torch

        self.cuda = device == "cuda"
        self.start = self._in_use() if self.cuda else 0
        self.peak = self.start
        self.torch = torch

    def _in_use(self) -> int:
        import torch

        free, total = torch.cuda.mem_get_info()
        return total - free

    def sample(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.peak = max(self.peak, self._in_use())

    def peak_bytes(self) -> int:
        if self.cuda:
            self.sample()
            return self.peak - self.start
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmHWM in /proc/self/status")


def child(args) -> list[dict]:
    """One (mode, variant): set-up, generation, a training step, syncs; rows without ratios."""
    import torch

    from leangrpo.config import config_from_dict
    from leangrpo.contracts import Prompt, SamplingParams
    from leangrpo.model.policy import load_policy, load_tokenizer
    from leangrpo.rollout.factory import make_engines, start_shared_engine
    from leangrpo.rollout.vllm.views import unshared_parameters

    device, size = args.device, SIZES[args.size]
    meter = Meter(device)
    cfg = config_from_dict(run_config(args.model, args.mode, args.child, device, args.tokenizer))
    torch.manual_seed(0)
    tokenizer = load_tokenizer(cfg.model) if args.tokenizer else None
    dev = torch.device(device)
    t0 = time.perf_counter()
    started = start_shared_engine(cfg, dev)
    policy = started.build_policy(cfg, tokenizer, dev) if started else None
    if args.child == "shared" and policy is None:
        raise SystemExit("the shared variant could not share the weights (see the log)")
    policy = policy or load_policy(cfg, tokenizer, dev)
    engines = make_engines(cfg, policy, None, None, started=started and started.engine)
    setup_s = time.perf_counter() - t0
    meter.sample()
    engine = engines.rollout
    vocab = policy.model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [
        Prompt(uid=i, text="", ids=torch.randint(3, vocab, (PROMPT_TOKENS,), generator=gen).tolist())
        for i in range(size["prompts"])
    ]
    params = SamplingParams(temperature=1.0, max_new_tokens=size["new"], seed=5)
    engine.generate(prompts, params, size["n"], engine.version)  # warm-up
    times, tokens = [], 0
    for _ in range(size["rounds"]):
        t = time.perf_counter()
        groups = engine.generate(prompts, params, size["n"], engine.version)
        times.append(time.perf_counter() - t)
        tokens += sum(len(c.ids) for g in groups for c in g)
    meter.sample()
    engine.sleep()  # the trainer's standby while it trains (CPU: no sleep mode)
    step_s = train_step(policy, vocab, size["rows"], size["tokens"], dev)
    meter.sample()
    sync = []
    for version in range(1, size["rounds"] + 1):
        t = time.perf_counter()
        engine.update_weights(policy.named_trainable_tensors(), version)
        sync.append(time.perf_counter() - t)
    engine.generate(prompts[:1], params, 1, engine.version)  # the synced weights serve
    meter.sample()
    common = {"bench": "shared_weights", "device": args.device_label, "variant": args.child}
    memory = {
        **common,
        "case": f"{args.mode}/memory",
        "time_s": round(setup_s, 3),
        "peak_bytes": meter.peak_bytes(),
        "train_step_s": round(step_s, 3),
    }
    if started is not None and started.views is not None:
        base = [n for n, _ in policy.model.named_parameters() if "lora_" not in n]
        unshared = unshared_parameters(policy.model, started.views)
        memory.update(shared_params=len(base) - len(unshared), unshared_params=len(unshared))
    engines.close()
    return [
        memory,
        {
            **common,
            "case": f"{args.mode}/generate",
            "time_s": round(statistics.median(times), 4),
            "tokens_per_s": round(tokens / sum(times), 2),
            "peak_bytes": None,
        },
        {
            **common,
            "case": f"{args.mode}/sync",
            "time_s": round(statistics.median(sync), 5),
            "peak_bytes": None,
        },
    ]


def train_step(policy, vocab: int, rows: int, tokens: int, device) -> float:
    """Forward + backward + AdamW on random tokens: the optimizer state exists afterwards."""
    import torch

    t = time.perf_counter()
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, vocab, (rows, tokens), generator=gen).to(device)
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-5)
    loss = policy.model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def with_ratios(rows: list[dict]) -> list[dict]:
    """shared / two_copies for each case (the baseline's own rows carry none)."""
    base = {r["case"]: r for r in rows if r["variant"] == "two_copies"}
    for row in rows:
        ref = base.get(row["case"])
        if row["variant"] == "two_copies" or ref is None:
            continue
        row["time_ratio"] = round(row["time_s"] / ref["time_s"], 4) if ref["time_s"] else None
        if row.get("peak_bytes") and ref.get("peak_bytes"):
            row["mem_ratio"] = round(row["peak_bytes"] / ref["peak_bytes"], 4)
            row["saved_bytes"] = ref["peak_bytes"] - row["peak_bytes"]
        if "tokens_per_s" in row:
            row["tokens_per_s_ratio"] = round(row["tokens_per_s"] / ref["tokens_per_s"], 4)
    return rows


def case_rows(model: Path | None, modes: list[str], size: str, timeout_s: float = 600) -> list[dict]:
    """Every (mode, variant) in a child process, baseline first; rows with ratios."""
    device = device_name()
    label = device if device == "cpu" else _cuda_name()
    with tempfile.TemporaryDirectory(prefix="leangrpo-shared-bench-") as work:
        tokenizer = True
        if model is None:
            model, tokenizer = default_model(device, Path(work))
        rows = []
        for mode in modes:
            for variant in VARIANTS:
                rows += _run_child(model, mode, variant, size, device, label, tokenizer, timeout_s)
    return with_ratios(rows)


def gemm_rows(model: Path, batch_rows=(1, 8, 32), repeats: int = 50) -> list[dict]:
    """On CPU, what serving the shared tensors costs per linear layer: vLLM's prepacked
    oneDNN matmul (**baseline** `onednn_prepacked`, what two copies run) vs `F.linear` on
    the plain weight (`f_linear`, what sharing runs), at the model's shapes (q/k/v fused,
    o, gate/up fused, down, lm_head) for decode batches of `batch_rows` rows; mean of
    `repeats` calls after min(5, repeats) warm-up calls. Nothing on CUDA (the weights stay
    plain there)."""
    import torch
    from vllm import _custom_ops as ops

    if device_name() != "cpu" or not getattr(ops, "_supports_onednn", False):
        return []
    c = json.loads((model / "config.json").read_text())
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    kv = c.get("num_key_value_heads", heads)
    shapes = {  # name: (out, in)
        "qkv_proj": ((heads + 2 * kv) * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_up_proj": (2 * c["intermediate_size"], hidden),
        "down_proj": (hidden, c["intermediate_size"]),
        "lm_head": (c["vocab_size"], hidden),
    }

    def mean_s(fn, *args) -> float:
        for _ in range(min(5, repeats)):
            fn(*args)
        start = time.perf_counter()
        for _ in range(repeats):
            fn(*args)
        return (time.perf_counter() - start) / repeats

    rows = []
    for m in batch_rows:
        for name, (n, k) in shapes.items():
            weight, x = torch.randn(n, k), torch.randn(m, k)
            handle = ops.create_onednn_mm(weight.t(), 32)  # as vLLM's CPU dispatch builds it
            base = mean_s(ops.onednn_mm, handle, x, None)
            plain = mean_s(torch.nn.functional.linear, x, weight)
            case = f"gemm/M{m}/{name}"
            rows.append({"bench": "shared_weights", "device": "cpu", "case": case,
                         "variant": "onednn_prepacked", "time_s": round(base, 7)})  # fmt: skip
            rows.append({"bench": "shared_weights", "device": "cpu", "case": case,
                         "variant": "f_linear", "time_s": round(plain, 7),
                         "time_ratio": round(plain / base, 3)})  # fmt: skip
    return rows


def _cuda_name() -> str:
    import torch

    return torch.cuda.get_device_name()


def _run_child(model, mode, variant, size, device, label, tokenizer, timeout_s) -> list[dict]:
    command = [
        sys.executable, str(Path(__file__).resolve()), "--child", variant, "--mode", mode,
        "--model", str(model), "--size", size, "--device", device, "--device-label", label,
    ]  # fmt: skip
    if not tokenizer:
        command.append("--no-tokenizer")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # one process, one figure
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout_s)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not rows:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return [{"bench": "shared_weights", "case": f"{mode}/memory", "device": label,
                 "variant": variant, "error": " | ".join(tail)[:400]}]  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="full fine-tuning only, small calls")
    size.add_argument(
        "--smallest", action="store_true",
        help="full fine-tuning only, the smallest calls (the test's: memory and views, no speeds)",
    )  # fmt: skip
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--modes", default=None, help="full,lora (quick: full)")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="full", help=argparse.SUPPRESS)
    p.add_argument("--size", default="full", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    p.add_argument("--device-label", default="cpu", help=argparse.SUPPRESS)
    p.add_argument("--no-tokenizer", dest="tokenizer", action="store_false", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        for row in child(args):
            print(json.dumps(row), flush=True)
        return
    size = "smallest" if args.smallest else "quick" if args.quick else "full"
    modes = (args.modes or ("full,lora" if size == "full" else "full")).split(",")
    print(
        json.dumps({"bench": "shared_weights", "case": "env", "variant": "-",
                    "python": platform.python_version(), "vllm": _vllm_version()}),
        flush=True,
    )  # fmt: skip
    for row in case_rows(args.model, modes, size):
        print(json.dumps(row), flush=True)
    if args.model is not None or device_name() == "cpu":
        model = args.model or default_model("cpu", Path(tempfile.gettempdir()))[0]
        for row in gemm_rows(model, repeats=SIZES[size]["gemm_repeats"]):
            print(json.dumps(row), flush=True)


def _vllm_version() -> str | None:
    try:
        import vllm

        return vllm.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    main()
