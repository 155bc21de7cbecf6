"""The GPU suite: its CPU dry run end to end, the driver's caps, and the compiled log-probs.

The dry run is the CI guard of benchmarks/gpu_suite.py: every case runs through the same
code at tiny shapes on CPU. The gpu-marked tests here are among those the suite itself
runs on the device (`pytest -m gpu`), for the paths only CUDA has.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import time

import pytest
import torch
from support.configs import ROOT, SRC
from support.files import read_jsonl

from leangrpo.ops.logprobs.api import chunked_logprobs


def _values_and_grads(hidden, weight, bias, targets, **kw):
    params = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
    lp, ent = chunked_logprobs(params[0], params[1], targets, params[2], with_entropy=True, **kw)
    n = lp.shape[0]
    w = torch.linspace(-1.0, 2.0, n, dtype=lp.dtype, device=lp.device)
    loss = (lp * w).sum() + (ent * w.flip(0)).sum()
    return (lp, ent, *torch.autograd.grad(loss, params))


def _inputs(n, h, v, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * (2 / h**0.5)
    bias = torch.randn(v, generator=g, dtype=torch.float64)
    targets = torch.randint(0, v, (n,), generator=g)
    return [t.to(device=device, dtype=dtype) for t in (hidden, weight, bias)], targets.to(device)


@pytest.mark.parametrize(
    "filters, backend",
    [({}, "aot_eager"), ({"top_k": 20, "temperature": 0.7, "min_p": 0.05}, "eager")],
)
def test_compiled_chunked_path_traces_the_same_function(filters, backend):
    """compile=<backend>: dynamo captures the row loops (no silent eager fallback), equal results.

    aot_eager traces forward and backward as inductor does but generates no code, so it is
    the cheap CPU check of the compiled path (eager: capture only, with the filter passes);
    inductor itself is checked on CUDA below. 70 rows in tiles of 32: a ragged last tile,
    so the second shape recompiles with a dynamic row count.
    """
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    (hidden, weight, bias), targets = _inputs(70, 16, 300, torch.float64)
    kw = dict(row_tile=32, vocab_tile=128, **filters)
    eager = _values_and_grads(hidden, weight, bias, targets, **kw)
    compiled = _values_and_grads(hidden, weight, bias, targets, compile=backend, **kw)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert counters["stats"]["unique_graphs"] >= 2  # forward and backward both compiled
    assert not counters["graph_break"]


def test_logprobs_compile_config_reaches_the_head(tiny_model):
    """`logprobs.compile` is a documented config key, off by default, passed by model.score."""
    from support.configs import unvalidated
    from torch._dynamo.utils import counters

    from leangrpo.config.training import LogprobsConfig
    from leangrpo.contracts import Completion, Prompt, RolloutSample, SamplingParams
    from leangrpo.model.scoring import score
    from leangrpo.ops.attention.adapter import enable_packed_attention
    from leangrpo.train.packing import pack_samples

    assert LogprobsConfig().compile is False
    model = tiny_model()
    enable_packed_attention(model, "sdpa_segments")
    samples = [
        RolloutSample(0, Prompt(0, "", [1, 2, 3]), Completion([4, 5], "", [-1.0, -1.0], "stop", 0))
    ]
    batch = pack_samples(samples)
    cfg = LogprobsConfig(chunked=True, row_tile=None, vocab_tile=None, compile=False)
    eager = score(model, batch, SamplingParams(), cfg)[0]
    torch._dynamo.reset()
    counters.clear()
    # the config takes a bool (True = inductor); score hands the value to the head as it is,
    # so a backend name reaches it too: aot_eager, the cheap CPU check of the compiled path
    cfg = unvalidated(
        LogprobsConfig, chunked=True, row_tile=None, vocab_tile=None, compile="aot_eager"
    )
    compiled = score(model, batch, SamplingParams(), cfg)[0]
    assert counters["stats"]["unique_graphs"] >= 1
    torch.testing.assert_close(compiled, eager)


def test_padded_batch_hits_the_asked_padding():
    import packing

    for target in (0.4, 0.6):
        samples = packing.make_padded_batch(target, 2, 8, 512, 1000, (32, 64), seed=3)
        lengths = [s.num_tokens for s in samples]
        assert max(lengths) == 512
        assert abs(1 - sum(lengths) / (len(lengths) * 512) - target) < 0.005
        groups = {s.group_id: s.prompt.ids for s in samples}
        assert all(s.prompt.ids == groups[s.group_id] for s in samples)  # shared prompts


def test_driver_caps_a_slow_case_and_goes_on_after_a_failure(tmp_path):
    """A case over its cap is killed (rows so far kept), a raising case is one line."""
    import gpu_suite

    def slow(ctx):
        yield {"bench": "t", "case": "slow", "variant": "first"}
        time.sleep(60)
        yield {"bench": "t", "case": "slow", "variant": "never"}

    def broken(ctx):
        yield {"bench": "t", "case": "broken", "variant": "first"}
        raise ValueError("the one line")

    def fine(ctx):
        yield {"bench": "t", "case": "fine", "variant": "only"}

    with open(tmp_path / "log", "w") as log:
        outcomes = [
            gpu_suite.run_case(gpu_suite.CaseSpec(name, 5, fn), True, cap, "fork", log)
            for name, fn, cap in (("slow", slow, 3), ("broken", broken, 30), ("fine", fine, 30))
        ]
    status = {o.name: (o.status, [r["variant"] for r in o.rows]) for o in outcomes}
    assert status == {
        "slow": ("timeout", ["first"]),
        "broken": ("failed", ["first"]),
        "fine": ("ok", ["only"]),
    }
    assert outcomes[0].wall_s < 45  # killed at its cap, long before its sleep of 60 s ends
    assert outcomes[1].message == "ValueError: the one line"


def test_a_dry_run_passes_however_slow_its_cases_run(tmp_path, monkeypatch, capsys):
    """Budgets cap cases on the device only: a dry run's verdict is what its cases do,
    never how fast a loaded CI machine runs them (test_dry_run_end_to_end failed once
    there, on a case's cap). A dry run given a budget of 1 s still runs its case to the
    end; on the device that budget would have stopped it (caps are at least 5 s)."""
    import gpu_suite

    def slow(ctx):
        time.sleep(6)
        yield {"bench": "t", "case": "slow", "variant": "only", "time_s": 6.0}

    monkeypatch.setattr(gpu_suite, "CASES", [gpu_suite.CaseSpec("slow", 1, slow, ("time_s",))])
    monkeypatch.setattr(gpu_suite, "heavy_imports", lambda: None)
    argv = ["gpu_suite.py", "--dry-run", "--budget-s", "1", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    assert gpu_suite.main() == 0, capsys.readouterr().out[-2000:]
    (suite,) = [r for r in read_jsonl(tmp_path / "results.jsonl") if r["bench"] == "suite"]
    assert suite["variant"] == "ok" and suite["time_s"] >= 6 and suite["budget_s"] is None


def test_a_case_whose_rows_hold_an_error_or_lack_its_figures_fails(tmp_path):
    """t2_bench_qlora.py: benchmarks/qlora.py failed every variant (a stale import, each
    failure a row with an error) and the suite called the case ok. A row with an error
    fails its case (on the device, an out-of-memory row is a measurement), and so does a
    case none of whose rows carries the figures it exists for, unless it says it skipped."""
    import gpu_suite

    def rows(*made):
        return lambda ctx: iter(made)

    measured = {"bench": "t", "case": "c", "variant": "v", "time_s": 1.0, "peak_bytes": 2}
    failed = {**measured, "time_s": None, "peak_bytes": None, "error": "ImportError: gone"}
    oom = {**failed, "error": "CUDA out of memory"}
    skipped = {"bench": "t", "case": "c", "variant": "v", "skipped": "needs CUDA"}
    figures = ("time_s", "peak_bytes")
    cases = [  # name, rows, dry, expected status
        ("measured", rows(measured, failed | {"error": None}), True, "ok"),
        ("an_error", rows(measured, failed), True, "failed"),
        ("oom_dry", rows(measured, oom), True, "failed"),
        ("no_figures", rows({**measured, "peak_bytes": None}), True, "failed"),
        ("all_skipped", rows(skipped), True, "ok"),
        ("nothing", rows(), True, "failed"),
    ]
    with open(tmp_path / "log", "w") as log:
        outcomes = {
            name: gpu_suite.run_case(gpu_suite.CaseSpec(name, 5, fn, figures), dry, 30, "fork", log)
            for name, fn, dry, _ in cases
        }
    assert {n: o.status for n, o in outcomes.items()} == {n: want for n, _, _, want in cases}
    assert outcomes["an_error"].message == "row t/c/v holds an error: ImportError: gone"
    assert outcomes["no_figures"].message == (
        "no row carries time_s, peak_bytes, the figures this case measures"
    )
    assert gpu_suite.rows_problem([measured, oom], figures, dry=False) == ""  # on the device


def test_the_qlora_benchmark_measures_both_variants_on_the_dry_path():
    """benchmarks/qlora.py itself, as the suite's dry run calls it (tiny model, CPU)."""
    import qlora

    rows = list(qlora.case_rows(torch.device("cpu"), dry=True))
    assert [r["variant"] for r in rows] == ["fp32_lora", "nf4_qlora"]
    assert not any(r.get("error") for r in rows), rows
    for key in ("time_s", "peak_bytes", "weights_bytes", "live_peak_bytes"):
        assert all(r[key] for r in rows), key
    assert rows[1]["weights_ratio"] < 1 and rows[1]["mem_ratio"] > 0


def test_fetched_wheels_cover_what_pydantic_requires():
    """scripts/fetch_gpu_wheels.sh names every runtime requirement of pydantic, pinned."""
    script = (ROOT / "scripts" / "fetch_gpu_wheels.sh").read_text()
    pinned = {
        line.split("==")[0].strip().lower(): line.split("==")[1].split()[0]
        for line in script.splitlines()
        if "==" in line and not line.lstrip().startswith("#")
    }
    todo = ["pydantic"]
    while todo:
        name = todo.pop()
        assert name in pinned, f"{name} is not fetched"
        for req in importlib.metadata.requires(name) or []:
            if "extra ==" not in req:
                dep = req.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
                todo.append(dep.replace("_", "-"))
    assert "torch" not in pinned


@pytest.mark.slow
def test_spawned_children_run_the_same_cases(tmp_path):
    """--start spawn (the fallback when an import initialised CUDA) runs a case too."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--dry-run"]
    cmd += ["--only", "env", "--start", "spawn", "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = read_jsonl(tmp_path / "results.jsonl")
    assert [(r["bench"], r["variant"]) for r in rows] == [("env", "-"), ("suite", "ok")]


@pytest.mark.slow
def test_dry_run_end_to_end(tmp_path):
    """`gpu_suite.sh --dry-run`: every case ok, rows of every benchmark, no row holding an
    error, every case's rows carrying the figures it exists for, the summary written."""
    import gpu_suite

    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(SRC)}
    out = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), "--dry-run", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,  # a hang guard only (85-190 s on 2 cores): a hung case ends at DRY_HANG_S
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = read_jsonl(tmp_path / "results.jsonl")
    suite = {r["case"]: r["variant"] for r in rows if r["bench"] == "suite"}
    assert suite == {name: "ok" for name in suite} and len(suite) == 12, suite
    benches = {r["bench"] for r in rows}
    assert benches >= {
        "env",
        "pytest_gpu",
        "grpo_step",
        "hf_generation",
        "offload",
        "packing",
        "logprob_memory",
        "qlora",
        "shared_weights",  # a "no vLLM" row where it is not installed
        "context_parallel",
    }
    cp = {r["variant"]: r for r in rows if r["bench"] == "context_parallel"}
    assert sorted(cp) == ["C=1", "C=2"] and "mem_ratio" in cp["C=2"], cp  # 2 CPU ranks (gloo)
    for r in rows:  # the DESIGN.md row format
        assert {"bench", "case", "variant"} <= r.keys()
    specs = {c.name: c for c in gpu_suite.CASES}
    case_rows: list[dict] = []
    for r in rows:  # each case's rows come before its `suite` row
        if r["bench"] != "suite":
            case_rows.append(r)
            continue
        figures, made, case_rows = specs[r["case"]].figures, case_rows, []
        assert figures and not any(row.get("error") for row in made), (r["case"], made)
        if all("skipped" in row for row in made):  # e.g. shared_weights without vLLM
            assert made, r["case"]
            continue
        carried = [row for row in made if all(row.get(k) is not None for k in figures)]
        assert carried, f"{r['case']}: no row carries {figures}"
    cuda_only = [r for r in rows if "needs CUDA" in str(r.get("skipped", ""))]
    assert cuda_only  # GPU-only variants say so instead of vanishing
    assert "| grpo_8b | ok |" in (tmp_path / "summary.md").read_text()


# -- on the device --------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_inductor_compiled_chunked_matches_eager():
    """The inductor path itself, bf16 (kept small: it compiles a forward and a backward)."""
    (hidden, weight, bias), targets = _inputs(256, 64, 3000, torch.bfloat16, device="cuda")
    kw = dict(row_tile=128, vocab_tile=1024)
    eager = _values_and_grads(hidden, weight, bias, targets, **kw)
    compiled = _values_and_grads(hidden, weight, bias, targets, compile=True, **kw)
    for a, b in zip(compiled, eager):
        scale = max(b.abs().max().item(), 1.0)
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.gpu
def test_gpu_grpo_step_same_loss_with_features_on_and_off():
    """The real step on CUDA (bf16, torch varlen, pinned offload): the features change no math."""
    import grpo_step

    rows = list(grpo_step.case_rows("tiny-qwen2", torch.device("cuda")))
    assert [r["variant"] for r in rows] == ["all_off", "all_on"]
    assert all(r["updated"] for r in rows)
    assert rows[1]["offload_bytes"] > 0
    assert rows[1]["loss_diff_vs_baseline"] < 1e-2
