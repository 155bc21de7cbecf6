"""The CLI: instant --help, and one clear sentence (no traceback) for each bad input."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo"


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "leangrpo", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_help_is_fast():
    t0 = time.perf_counter()
    out = run_cli("--help")
    assert out.returncode == 0 and "train" in out.stdout
    assert time.perf_counter() - t0 < 2.0


def base_config(tmp_path: Path) -> dict:
    return {
        "run": {"output_dir": str(tmp_path / "run"), "device": "cpu"},
        "model": {"name_or_path": str(DEMO / "model")},
        "data": {"path": str(DEMO / "train.jsonl")},
        "rewards": {"functions": [{"name": "math"}]},
    }


def write(tmp_path: Path, cfg: dict) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


BAD_INPUTS = {
    "unknown key": (
        lambda c: (
            c["train"].update(learning_rat=1e-4)
            if "train" in c
            else c.update(train={"learning_rat": 1e-4})
        ),
        ["learning_rat", "learning_rate"],
    ),
    "wrong type": (
        lambda c: c.update(rollout={"num_generations": "eight"}),
        ["rollout.num_generations"],
    ),
    "missing data file": (
        lambda c: c["data"].update(path="nowhere/train.jsonl"),
        ["nowhere/train.jsonl"],
    ),
    "missing column": (lambda c: c["data"].update(prompt_column="question"), ["question"]),
    "reward not found": (
        lambda c: c["rewards"].update(functions=[{"name": "mypkg.nope:score"}]),
        ["mypkg.nope"],
    ),
    "negative learning rate": (
        lambda c: c.update(train={"learning_rate": -1e-4}),
        ["train.learning_rate"],
    ),
    "one generation": (
        lambda c: c.update(rollout={"num_generations": 1}),
        ["rollout.num_generations"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_gives_one_clear_error(tmp_path, case):
    mutate, must_mention = BAD_INPUTS[case]
    cfg = base_config(tmp_path)
    mutate(cfg)
    out = run_cli("train", write(tmp_path, cfg))
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    message = out.stderr.strip()
    assert message.count("\n") == 0, message
    for word in must_mention:
        assert word in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # failed before any model loaded


def test_set_override_reaches_the_config(tmp_path):
    out = run_cli("plan", write(tmp_path, base_config(tmp_path)), "--set", "lora.enabled=true")
    assert out.returncode == 0, out.stderr
    assert "total" in out.stdout


def test_ctrl_c_ends_the_run_promptly_without_orphans(tmp_path):
    import signal

    import psutil

    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "leangrpo",
            "train",
            "examples/demo.yaml",
            "--set",
            f"run.output_dir={out}",
            "--set",
            "run.max_steps=500",
            "--set",
            "pipeline.mode=async",
            "--set",
            "logging.progress_bar=false",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or metrics.read_text().count("\n") < 3):
        time.sleep(0.5)
    assert metrics.exists(), "the run never started"
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "reward workers run as child processes"
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert time.time() - t0 < 30
    assert proc.returncode == 130
    assert "interrupted" in stderr
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"orphans left: {alive}"
