"""benchmarks/vs_trl.py's plumbing, without TRL: it must not rot between benchmark runs.

The leangrpo side of case a (the bundled demo) runs for 2 steps in-process through the
same `run_variant` the benchmark's subprocesses call; the parent's summary and ratios are
checked on hand-made run records; and with TRL absent the script prints one line.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest
import vs_trl  # benchmarks/ (conftest.py)
from support.configs import ROOT
from vs_trl_cases import prepare_case


def run(step_s: float, peak: int, final: float = 0.5) -> dict:
    return {
        "step_s": step_s, "step_cpu_s": step_s / 2, "generate_s": 0.1, "reward_s": 0.2,
        "score_train_s": step_s - 0.3, "other_s": 0.0, "total_s": 10.0, "first_step_end_s": 3.0,
        "final_eval": final, "steps": 3, "tokens_per_step": 100.0, "peak_bytes": peak,
    }  # fmt: skip


def test_summary_ratios_are_leangrpo_over_trl(monkeypatch):
    records = {"trl": [run(2.0, 400), run(4.0, 600)], "leangrpo": [run(1.0, 300), run(3.0, 300)]}
    calls = {k: iter(v) for k, v in records.items()}
    monkeypatch.setattr(vs_trl, "run_child", lambda variant, *a: next(calls[variant]))
    monkeypatch.setattr(vs_trl, "prepare_case", lambda *a: None)
    args = type("A", (), {"only": None, "device": "cpu", "repeats": 2})()
    trl, lean = vs_trl.run_case(vs_trl.CASES["a"], args)
    assert (trl["variant"], lean["variant"]) == ("trl", "leangrpo")
    assert trl["time_s"] == 3.0 and lean["time_s"] == 2.0  # medians over runs
    assert lean["time_ratio"] == pytest.approx(2.0 / 3.0)
    assert lean["mem_ratio"] == pytest.approx(300 / 600)  # peak = max over runs
    assert lean["paired_time_ratios"] == [0.5, 0.75]
    assert "time_ratio" not in trl
    for key in ("bench", "case", "device", "variant", "time_s", "peak_bytes"):
        assert key in lean and key in trl


def test_without_trl_the_script_prints_one_line_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(vs_trl, "has_trl", lambda: False)
    monkeypatch.setattr(sys, "argv", ["vs_trl.py", "--quick"])
    vs_trl.main()
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "TRL is not installed" in json.loads(lines[0])["skipped"]


@pytest.mark.slow
def test_leangrpo_side_of_the_demo_case_runs(tmp_path, monkeypatch):
    from vs_trl_runs import run_variant

    monkeypatch.chdir(ROOT)  # examples/demo.yaml's paths are relative to the repository root
    case = replace(vs_trl.CASES["a"], steps=2, eval_prompts=4)
    prepare_case(case, tmp_path, ROOT)
    result = run_variant("leangrpo", case, tmp_path, "cpu")
    assert result["steps"] == 2 and result["step_s"] > 0
    assert result["peak_bytes"] >= result["peak_rss_self_bytes"] > 0
    assert 0.0 <= result["final_eval"] <= 1.0
    assert result["tokens_per_step"] > 0 and result["generate_s"] > 0


@pytest.mark.slow
def test_leangrpo_side_of_the_multi_turn_tools_case_runs(tmp_path, monkeypatch):
    """Case e: examples/tools_demo.yaml (the environment and its tool) through the trainer;
    the eval is greedy multi-turn trajectories with the tool."""
    from vs_trl_runs import run_variant

    monkeypatch.chdir(ROOT)
    case = replace(vs_trl.CASES["e"], steps=2, eval_prompts=4)
    prepare_case(case, tmp_path, ROOT)
    result = run_variant("leangrpo", case, tmp_path, "cpu")
    assert result["steps"] == 2 and result["generate_s"] > 0
    assert result["peak_bytes"] > result["peak_rss_self_bytes"] > 0  # workers counted
    assert 0.0 <= result["final_eval"] <= 1.0


def test_the_distill_case_has_a_row_per_variant_with_ratios_against_trl(monkeypatch):
    """--case distill: TRL's DistillationTrainer is the baseline of leangrpo's three rows
    (jsd, sampled, jsd with an nf4 teacher)."""
    records = {"trl": run(2.0, 400), "leangrpo": run(1.0, 200), "leangrpo_sampled": run(0.5, 100),
               "leangrpo_nf4": run(1.5, 300)}  # fmt: skip
    monkeypatch.setattr(vs_trl, "run_child", lambda variant, *a: records[variant])
    import vs_trl_distill

    monkeypatch.setattr(vs_trl_distill, "prepare", lambda workdir: None)
    args = type("A", (), {"only": None, "device": "cpu", "repeats": None})()
    rows = vs_trl.run_case(vs_trl.CASES["distill"], args)
    assert [r["variant"] for r in rows] == ["trl", "leangrpo", "leangrpo_sampled", "leangrpo_nf4"]
    assert "time_ratio" not in rows[0]
    ratios = {r["variant"]: (r["time_ratio"], r["mem_ratio"]) for r in rows[1:]}
    assert ratios == {"leangrpo": (0.5, 0.5), "leangrpo_sampled": (0.25, 0.25),
                      "leangrpo_nf4": (0.75, 0.75)}  # fmt: skip
