"""A training run whose every tool call is hostile (issue 27, "Sandbox"): the tool demo
with a parser that ignores the model and calls every tool of support/hostile_tools.py
in its turn, and a reward that prints without end. The run finishes; each limit reached is
counted in metrics.jsonl; nothing reached the trainer or outlived the run."""

from __future__ import annotations

import json
import os
import signal

import psutil
from support.configs import ROOT
from support.hostile_tools import HOSTILE
from support.sandboxes import require_namespace

from leangrpo.config import config_from_dict
from leangrpo.train import Trainer

TOOLS_DEMO = ROOT / "examples" / "tools_demo"


def test_a_run_through_hostile_tools_finishes_with_each_limit_counted(tmp_path, monkeypatch):
    require_namespace()
    tag = f"3000.{os.getpid()}"  # marks what leave_processes starts
    args = {
        "attack": {"pid": os.getpid(), "signals": True},
        "leave_processes": {"tag": tag},
        "write_file": {"path": str(tmp_path / "pwned")},
        "connect": {"port": 9},
        "allocate": {"mb": 4096},
        "fork_bomb": {"attempts": 64},
        "flood": {"mb": 8},
        "big": {"mb": 1},
        "spin": {"seconds": 30},
    }
    assert sorted(args) == sorted(HOSTILE)
    monkeypatch.setenv("LEANGRPO_TEST_TOOL_ARGS", json.dumps(args))
    out = tmp_path / "run"
    sandbox = {"max_processes": 8, "max_output_bytes": 65536, "pass_env": ["LEANGRPO_TEST_TOOL_ARGS"]}
    cfg = {
        "run": {"output_dir": str(out), "seed": 1, "max_steps": 2, "device": "cpu", "num_threads": 1},
        "model": {"name_or_path": str(TOOLS_DEMO / "model"), "dtype": "float32"},
        "data": {"path": str(TOOLS_DEMO / "train.jsonl"), "eval_path": str(TOOLS_DEMO / "eval.jsonl"),
                 "chat_template": True},
        "rewards": {"functions": [{"name": "math", "kwargs": {"answer_column": "answer"}},
                                  {"name": "support.hostile_tools:flooding_reward", "weight": 0.0}],
                    "num_workers": 1, "timeout_s": 5.0, "sandbox": {"max_output_bytes": 65536}},
        "environment": {"tools": [f"support.hostile_tools:{name}" for name in HOSTILE],
                        "tool_parser": "support.hostile_tools:every_tool", "max_turns": 1,
                        "max_total_tokens": 192, "num_workers": 1, "tool_timeout_s": 0.5,
                        "max_tool_result_chars": 4000, "memory_limit_mb": 2048, "sandbox": sandbox},
        "rollout": {"num_generations": 2, "prompts_per_batch": 2, "max_new_tokens": 64},
        "train": {"learning_rate": 1e-3, "micro_batch_tokens": 4096},
        "eval": {"every_steps": 0, "num_prompts": 2},
        "checkpoint": {"every_steps": 0, "save_final_model": False},
        "logging": {"progress_bar": False, "samples_every": 0},
    }  # fmt: skip
    received = []
    previous = signal.signal(signal.SIGWINCH, lambda *a: received.append(a))
    try:
        Trainer(config_from_dict(cfg)).train()
    finally:
        signal.signal(signal.SIGWINCH, previous)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "multiturn/tool_calls" in r]
    assert [r["step"] for r in steps] == [1, 2]  # the run finished
    stepped = [r["multiturn/tool_calls"] / len(HOSTILE) for r in steps]  # turns ended on EOS
    assert sum(stepped) > 0, steps
    for row, share in zip(steps, stepped):  # each turn that ran the tools hit each limit once
        for kind in ("timeout", "memory", "output", "process"):
            assert row.get(f"multiturn/tool_limit/{kind}", 0.0) == share, (kind, row)
        assert row.get("multiturn/tool_truncated", 0.0) == share  # big's megabyte, cut
        assert row["multiturn/env_errors"] == 0.0
        assert row["reward/output_failures"] == 4.0  # the flooding reward, each sample
        assert row["reward/unscored"] == 0.0  # its weight is 0: the samples stay scored
    assert received == [] and not (tmp_path / "pwned").exists()
    left = [p for p in psutil.process_iter(["cmdline"]) if tag in " ".join(p.info["cmdline"] or [])]
    assert left == []
