"""benchmarks/first_step.py's plumbing: ratios against TRL from alternating runs, and the
leangrpo side measured for real (the tool demo's CLI until its first step's row)."""

from __future__ import annotations

import first_step  # benchmarks/ (conftest.py)
import pytest


def test_ratios_are_leangrpo_over_trl_from_medians(monkeypatch):
    runs = {"trl": iter([{"time_s": 20.0, "peak_bytes": 600}, {"time_s": 30.0, "peak_bytes": 800}]),
            "leangrpo": iter([{"time_s": 10.0, "peak_bytes": 300}, {"time_s": 24.0, "peak_bytes": 500}])}  # fmt: skip
    monkeypatch.setattr(first_step, "run_trl", lambda case, timeout: next(runs["trl"]))
    monkeypatch.setattr(first_step, "run_leangrpo", lambda case, workdir, timeout: next(runs["leangrpo"]))
    trl, lean = first_step.run_case("demo", ["trl", "leangrpo"], 2, 60)
    assert trl["time_s"] == 25.0 and lean["time_s"] == 17.0
    assert lean["time_ratio"] == pytest.approx(17 / 25)
    assert lean["mem_ratio"] == pytest.approx(400 / 700)
    assert lean["paired_time_ratios"] == [0.5, 0.8] and "time_ratio" not in trl
    for key in ("bench", "case", "device", "variant", "time_s", "peak_bytes"):
        assert key in lean and key in trl


@pytest.mark.slow
def test_the_leangrpo_side_times_a_real_first_step(tmp_path):
    one = first_step.run_leangrpo("tools_demo", tmp_path, timeout=600)
    assert "error" not in one, one
    assert one["time_s"] > 0 and one["peak_bytes"] > 100 * 2**20
    again = first_step.run_leangrpo("tools_demo", tmp_path, timeout=600)  # a fresh directory
    assert again["time_s"] > 1.0, "a second run must not see the first one's metrics"
