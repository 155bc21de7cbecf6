"""README's "From Python" section, run as written: each Python block in a fresh interpreter
(in a directory of its own beside the repository's examples/, so its runs/ stay there),
then the checks below on what it left in its namespace: the demo learns and `evaluate`
gives its last eval/reward back; the tools demo's environment, defined in the block,
learns to call its tool. CPU-sized: 20 and 15 steps of the bundled tiny models."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from support.configs import ROOT

CHECKS = [
    # the demo: greedy accuracy climbs; evaluate() scores final/ as the run's last evaluation
    "assert result.eval_curve[0][1] < 0.8 < result.eval_curve[-1][1], result.eval_curve\n"
    "assert scored.metrics['eval/reward'] == result.eval['eval/reward']\n"
    "assert result.final_dir == result.run_dir / 'final' and result.step == 20\n",
    # the tools demo: accuracy and tool calls climb from about 0
    "assert result.eval_curve[0][1] < 0.1 < 0.5 < result.eval_curve[-1][1], result.eval_curve\n"
    "assert result.eval['eval/multiturn/tool_calls'] > 0.5\n",
]


def python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## From Python\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_section_has_the_blocks_these_checks_are_for():
    blocks = python_blocks()
    assert len(blocks) == len(CHECKS)
    assert "examples/demo.yaml" in blocks[0] and "examples/tools_demo.yaml" in blocks[1]


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CHECKS)))
def test_the_readme_python_block_runs_as_written(tmp_path, index):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    code = python_blocks()[index] + "\n" + CHECKS[index]
    env = {**os.environ, "LEANGRPO_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
