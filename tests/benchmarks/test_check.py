"""benchmarks/check.py's plumbing: a cold check then one with the record, in one fresh
cache per repeat; a check that fails raises (the benchmark exits non-zero, no error row)."""

from __future__ import annotations

import check  # benchmarks/ (conftest.py)
import pytest


def test_each_repeat_is_a_cold_check_then_one_with_its_record(monkeypatch):
    caches = []

    def fake(config, cache, timeout):
        caches.append(cache)
        cold = caches.count(cache) == 1
        return {
            "time_s": 4.0 if cold else 1.0,
            "cpu_s": 3.0 if cold else 0.5,
            "peak_bytes": 300 if cold else 50,
        }

    monkeypatch.setattr(check, "check_once", fake)
    runs = check.run_case("demo", 2, 60)
    assert caches[0] == caches[1] != caches[2] == caches[3]  # one fresh cache per repeat
    cold = check.summarise("demo", "cold", runs["cold"], "cpu")
    record = check.summarise("demo", "record", runs["record"], "cpu")
    assert (cold["time_s"], record["time_s"], record["cpu_s"]) == (4.0, 1.0, 0.5)
    for key in ("bench", "case", "device", "variant", "time_s", "peak_bytes"):
        assert key in cold and key in record


def test_a_real_check_is_measured_and_a_failing_one_raises(tmp_path):
    one = check.check_once("examples/demo.yaml", tmp_path / "cache", timeout=300)
    assert one["time_s"] > 0 and one["cpu_s"] > 0 and one["peak_bytes"] > 10 * 2**20
    with pytest.raises(RuntimeError, match="leangrpo check missing.yaml failed"):
        check.check_once("missing.yaml", tmp_path / "cache", timeout=300)
