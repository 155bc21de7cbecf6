"""The CLI: instant --help, and one clear sentence (no traceback) for each bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo"


# Runs the CLI and reports, on its last stdout line, whether torch was ever imported.
PROBE = (
    "import atexit, sys\n"
    "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules))\n"
    "from leangrpo.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def run_cli(*args: str, timeout: float = 120, probe: bool = False) -> subprocess.CompletedProcess:
    head = ["-c", PROBE] if probe else ["-m", "leangrpo"]
    return subprocess.run(
        [sys.executable, *head, *args],
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


def test_train_help_and_a_missing_config_do_not_import_torch(tmp_path):
    out = run_cli("train", "--help", probe=True)
    assert out.returncode == 0 and "--set" in out.stdout
    assert out.stdout.strip().endswith("torch imported: False")
    out = run_cli("train", str(tmp_path / "missing.yaml"), probe=True)
    assert out.returncode == 2 and "missing.yaml' does not exist" in out.stderr
    assert out.stdout.strip().endswith("torch imported: False")


def base_config(tmp_path: Path) -> dict:
    return {
        "run": {"output_dir": str(tmp_path / "run"), "device": "cpu"},
        "model": {"name_or_path": str(DEMO / "model")},
        "data": {"path": str(DEMO / "train.jsonl")},
        "rewards": {"functions": [{"name": "math"}]},
        "rollout": {"max_new_tokens": 6},  # the demo model has 64 positions
    }


def write(tmp_path: Path, cfg: dict) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def model_copy(tmp: Path, damage) -> str:
    """The demo model copied to tmp and damaged by `damage(directory)`."""
    directory = Path(shutil.copytree(DEMO / "model", tmp / "model"))
    damage(directory)
    return str(directory)


def data_copy(tmp: Path, edit) -> str:
    """The demo's train.jsonl with `edit(lines)` applied."""
    lines = (DEMO / "train.jsonl").read_bytes().splitlines(keepends=True)
    edit(lines)
    (tmp / "train.jsonl").write_bytes(b"".join(lines))
    return str(tmp / "train.jsonl")


def set_prompt(row: int, text: str):
    def edit(lines):
        lines[row] = (json.dumps({**json.loads(lines[row]), "prompt": text}) + "\n").encode()

    return edit


def truncate_weights(directory: Path) -> None:
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])


BAD_INPUTS = {
    "unknown key": (
        lambda c, t: (
            c["train"].update(learning_rat=1e-4)
            if "train" in c
            else c.update(train={"learning_rat": 1e-4})
        ),
        ["learning_rat", "learning_rate"],
    ),
    "wrong type": (
        lambda c, t: c.update(rollout={"num_generations": "eight"}),
        ["rollout.num_generations"],
    ),
    "missing data file": (
        lambda c, t: c["data"].update(path="nowhere/train.jsonl"),
        ["nowhere/train.jsonl"],
    ),
    "missing column": (lambda c, t: c["data"].update(prompt_column="question"), ["question"]),
    "reward not found": (
        lambda c, t: c["rewards"].update(functions=[{"name": "mypkg.nope:score"}]),
        ["mypkg.nope"],
    ),
    "negative learning rate": (
        lambda c, t: c.update(train={"learning_rate": -1e-4}),
        ["train.learning_rate"],
    ),
    "one generation": (
        lambda c, t: c.update(rollout={"num_generations": 1}),
        ["rollout.num_generations"],
    ),
    "infinite learning rate": (
        lambda c, t: c.update(train={"learning_rate": float("inf")}),
        ["'train.learning_rate' = inf", "finite number"],
    ),
    "infinite beta": (
        lambda c, t: c.update(loss={"beta": float("inf")}),
        ["'loss.beta' = inf", "finite number"],
    ),
    "nan reward weight": (
        lambda c, t: c["rewards"]["functions"][0].update(weight=float("nan")),
        ["'rewards.functions[0].weight' = nan"],
    ),
    "negative seed": (lambda c, t: c["run"].update(seed=-1), ["'run.seed'"]),
    "huge seed": (lambda c, t: c["run"].update(seed=2**40), ["'run.seed'", "4294967295"]),
    "empty output dir": (
        lambda c, t: c["run"].update(output_dir=""),
        ["'run.output_dir'", "current directory"],
    ),
    "output dir under a file": (
        lambda c, t: c["run"].update(output_dir=str(DEMO / "train.jsonl" / "run")),
        ["run.output_dir", "train.jsonl' is a file"],
    ),
    "absurd temperature": (
        lambda c, t: c.update(rollout={"temperature": 1e6}),
        ["'rollout.temperature'", "less than or equal to 10"],
    ),
    "infinite reward timeout": (
        lambda c, t: c["rewards"].update(timeout_s=float("inf")),
        ["'rewards.timeout_s'"],
    ),
    "empty stop string": (lambda c, t: c.update(rollout={"stop": [""]}), ["'rollout.stop'"]),
    "every reward weight zero": (
        lambda c, t: c["rewards"]["functions"][0].update(weight=0),
        ["weight is 0"],
    ),
    "micro-batch below max_new_tokens": (
        lambda c, t: c.update(train={"micro_batch_tokens": 100}, rollout={"max_new_tokens": 100}),
        ["train.micro_batch_tokens (100) must exceed rollout.max_new_tokens (100)"],
    ),
    "missing model directory": (
        lambda c, t: c["model"].update(name_or_path=str(t / "no" / "model")),
        ["model.name_or_path", "no such directory"],
    ),
    "truncated weights": (
        lambda c, t: c["model"].update(name_or_path=model_copy(t, truncate_weights)),
        ["model.safetensors is truncated (1000 bytes"],
    ),
    "broken safetensors header": (
        lambda c, t: c["model"].update(
            name_or_path=model_copy(
                t, lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64)
            )
        ),
        ["model.safetensors is not a valid safetensors file: its header claims"],
    ),
    "invalid config.json": (
        lambda c, t: c["model"].update(
            name_or_path=model_copy(t, lambda d: (d / "config.json").write_text("{oops"))
        ),
        ["config.json is not valid JSON (line 1"],
    ),
    "no weights": (
        lambda c, t: c["model"].update(
            name_or_path=model_copy(t, lambda d: (d / "model.safetensors").unlink())
        ),
        ["holds no weights"],
    ),
    "resume path typo": (
        lambda c, t: c["run"].update(resume=str(t / "run" / "checkpoints" / "step-4O")),
        ["run.resume", "step-4O' does not exist"],
    ),
    "empty prompt at row 30": (
        lambda c, t: c["data"].update(path=data_copy(t, set_prompt(30, ""))),
        ["train.jsonl' row 30 (line 31) has an empty prompt", "data.empty_prompts"],
    ),
    "whitespace prompt": (
        lambda c, t: c["data"].update(path=data_copy(t, set_prompt(5, " \n "))),
        ["row 5 (line 6) has an empty prompt"],
    ),
    "non-UTF-8 data file": (
        lambda c, t: c["data"].update(
            path=data_copy(t, lambda lines: lines.__setitem__(7, b'{"prompt": "1\xff2"}\n'))
        ),
        ["train.jsonl line 8 is not UTF-8 text"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_gives_one_clear_error(tmp_path, case):
    mutate, must_mention = BAD_INPUTS[case]
    cfg = base_config(tmp_path)
    mutate(cfg, tmp_path)
    out = run_cli("train", write(tmp_path, cfg), probe=True)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    message = out.stderr.strip()
    assert message.count("\n") == 0, message
    for word in must_mention:
        assert word in message
    assert out.stdout.strip() == "torch imported: False"  # found by the cheap checks
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # failed before any model loaded


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (
            b"run:\n  seed: 1\nmodel: {name_or_path: m}\nrun:\n  max_steps: 2\n",
            "'run' twice (lines 1 and 4)",
        ),
        ("run:\n  seed: 1\n".encode("utf-16"), "UTF-16 or UTF-32"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "binary file"),
    ],
)
def test_unreadable_config_file_gives_one_clear_error(tmp_path, content, expected):
    path = tmp_path / "cfg.yaml"
    path.write_bytes(content)
    out = run_cli("train", str(path), probe=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert expected in out.stderr and out.stderr.strip().count("\n") == 0
    assert out.stdout.strip() == "torch imported: False"


SHORT_DEMO = [
    "--set",
    "run.max_steps=2",
    "--set",
    "eval.num_prompts=8",
    "--set",
    "logging.progress_bar=false",
    "--set",
    "logging.samples_every=0",
]


def train_demo(out: Path, *overrides: str, probe: bool = False) -> subprocess.CompletedProcess:
    extra = [x for o in overrides for x in ("--set", o)]
    args = ["train", "examples/demo.yaml", "--set", f"run.output_dir={out}", *SHORT_DEMO, *extra]
    return run_cli(*args, probe=probe, timeout=300)


def metric_steps(out: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_run_directory_is_locked_finished_refused_and_overwritten(tmp_path):
    out = tmp_path / "run"
    first = train_demo(out)
    assert first.returncode == 0, first.stderr
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["data/prompts"] == 2000 and rows[0]["data/dropped_prompts"] == 0
    assert "eval/reward" in rows[0]  # the data counts share the step-0 row
    assert (out / "checkpoints" / "step-2" / "config.yaml").is_file()
    steps = metric_steps(out)

    again = train_demo(out, probe=True)  # a finished run: one line, nothing loads
    assert again.returncode == 0 and "already finished" in again.stdout
    assert again.stdout.strip().endswith("torch imported: False")
    never = train_demo(out, "run.resume=never", probe=True)
    assert never.returncode == 2 and "already holds an earlier run" in never.stderr
    changed = train_demo(out, "run.max_steps=3", "train.learning_rate=1e-3", probe=True)
    assert changed.returncode == 2 and "train.learning_rate 0.0002 -> 0.001" in changed.stderr
    assert changed.stdout.strip().endswith("torch imported: False")
    assert metric_steps(out) == steps  # nothing was appended by the refused runs

    holder = subprocess.Popen(
        [sys.executable, "-c", PROBE_LOCK, str(out)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        busy = train_demo(out, "run.max_steps=3", probe=True)
        assert busy.returncode == 2 and f"in use by another leangrpo run (pid {holder.pid})" in (
            busy.stderr
        )
    finally:
        holder.kill()
        holder.wait()

    fresh = train_demo(out, "run.overwrite=true", "run.max_steps=1")
    assert fresh.returncode == 0, fresh.stderr
    assert metric_steps(out)[0] == 0 and max(metric_steps(out)) == 1  # one run per file
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-1"]


PROBE_LOCK = (
    "import sys, time; from pathlib import Path; from leangrpo.rundir import RunLock\n"
    "RunLock(Path(sys.argv[1])); print('locked', flush=True); time.sleep(300)\n"
)


def test_prompt_past_the_context_or_the_micro_batch_is_refused_before_the_model(tmp_path):
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": "1+1=", "answer": "2"}] * 20 + [{"prompt": "9" * 126, "answer": "9"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = train_demo(tmp_path / "run", f"data.path={data}")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    message = out.stderr.strip().splitlines()[-1]
    assert (
        "row 20 has 126 prompt tokens, more than the 58 allowed by the model's context" in message
    )
    assert "64 positions (config.json max_position_embeddings)" in message
    assert "data.overlong_prompts" in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    out = train_demo(tmp_path / "run", "train.micro_batch_tokens=10")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "train.micro_batch_tokens (10) is smaller than the longest sequence" in out.stderr


def test_cuda_without_a_gpu_is_one_sentence(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    out = train_demo(tmp_path / "run", "run.device=cuda")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "run.device is 'cuda' but" in out.stderr and "set run.device: cpu" in out.stderr


def test_report_skips_a_torn_line(tmp_path):
    rows = [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}]
    text = json.dumps(rows[0]) + '\n{"step": 2, "lo\n' + json.dumps(rows[1]) + "\n"
    (tmp_path / "metrics.jsonl").write_text(text)
    out = run_cli("report", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "2 records, last step 2" in out.stdout and "skipped 1 line(s)" in out.stderr


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
