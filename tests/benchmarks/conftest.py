"""benchmarks/ on sys.path, as the benchmark scripts run (they import each other by module
name): the tests here import them the same way."""

from __future__ import annotations

import sys

from support.configs import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
