"""The CLI: instant --help, and one clear sentence (no traceback) for each bad input."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from support.configs import DEMO, DEMO_MODEL, ROOT
from support.files import copy_demo_model, read_jsonl, write_jsonl
from support.processes import run_cli


def test_help_is_fast():
    """Instant because it imports no torch (checked as such: a bound on the wall clock
    decided the verdict on a loaded machine)."""
    out = run_cli("--help", probe=True)
    assert out.returncode == 0 and "train" in out.stdout
    assert out.stdout.strip().endswith("torch imported: False")


def test_train_help_and_a_missing_config_do_not_import_torch(tmp_path):
    out = run_cli("train", "--help", probe=True)
    assert out.returncode == 0 and "--set" in out.stdout
    assert out.stdout.strip().endswith("torch imported: False")
    out = run_cli("train", str(tmp_path / "missing.yaml"), probe=True)
    assert out.returncode == 2 and "missing.yaml' does not exist" in out.stderr
    assert out.stdout.strip().endswith("torch imported: False")


def test_merge_refuses_what_it_cannot_merge_before_torch_is_imported(tmp_path):
    """`leangrpo merge` (the schedule-extension refusal's advice for LoRA runs): no adapter,
    a full model, or an output directory that exists: one sentence each, no torch."""
    (tmp_path / "out").mkdir()
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    for source, out, expected in [
        (tmp_path, tmp_path / "merged", "holds no LoRA adapter (adapter_config.json)"),
        (DEMO_MODEL, tmp_path / "merged", "holds a full model, not a LoRA adapter"),
        (tmp_path / "adapter", tmp_path / "out", "exists already"),
    ]:
        got = run_cli("merge", str(source), str(out), probe=True)
        assert got.returncode == 2 and expected in got.stderr, got.stderr
        assert got.stderr.startswith("leangrpo: error: ") and got.stderr.count("\n") == 1
        assert got.stdout.strip().endswith("torch imported: False")


def base_config(tmp_path: Path) -> dict:
    return {
        "run": {"output_dir": str(tmp_path / "run"), "device": "cpu"},
        "model": {"name_or_path": str(DEMO_MODEL)},
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
    return str(copy_demo_model(tmp, damage))


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
    "a file named .parquet that is not Parquet": (
        lambda c, t: c["data"].update(path=text_file(t / "fake.parquet", "not parquet\n")),
        ["fake.parquet is not a Parquet file (it starts with b'not '"],
    ),
    "CSV with an unclosed quote": (
        lambda c, t: c["data"].update(path=text_file(t / "d.csv", 'prompt,answer\n"1+1=,2\n')),
        ["d.csv line 2: a quoted field opens there and is never closed"],
    ),
    "a 5 MB prompt": (
        lambda c, t: c["data"].update(path=data_copy(t, set_prompt(3, "1+" * (5 << 19) + "1="))),
        ["row 3 (line 4) has 5242882 bytes of text, more than the 58 tokens allowed"],
    ),
}
if importlib.util.find_spec("vllm") is None:
    BAD_INPUTS["vLLM not installed"] = (
        lambda c, t: c["rollout"].update(engine="vllm"),
        ["rollout.engine: vllm (rollout.vllm.mode: colocate) runs vLLM in this process, but "
         "vLLM is not installed", "pip install 'leangrpo[vllm]'"],
    )  # fmt: skip


def text_file(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


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
    return run_cli(*args, probe=probe)


def metric_steps(out: Path) -> list[int]:
    return [row["step"] for row in read_jsonl(out / "metrics.jsonl")]


def test_run_directory_is_locked_finished_refused_and_overwritten(tmp_path):
    out = tmp_path / "run"
    first = train_demo(out)
    assert first.returncode == 0, first.stderr
    rows = read_jsonl(out / "metrics.jsonl")
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


def test_a_finished_run_prints_a_summary_and_a_run_without_eval_logs_no_empty_row(tmp_path):
    """The end of a run: a few human lines (first -> last eval and reward, time, where the
    files are), not a Python dict; without an eval set no `{"step": N}` row is written."""
    out = tmp_path / "run"
    done = train_demo(out)
    assert done.returncode == 0, done.stderr
    summary = done.stdout.strip().splitlines()[-5:]
    assert summary[0].startswith("leangrpo: finished at step 2 in "), summary
    assert summary[1].startswith("  eval/reward") and "(step 0) ->" in summary[1]
    assert summary[2].startswith("  reward/mean") and "(step 2)" in summary[2]
    assert f"files in {out}/: metrics.jsonl" in summary[3] and "checkpoints/" in summary[3]
    assert summary[4] == f"  plots and a summary: leangrpo report {out}"
    assert "{" not in done.stdout
    bare = tmp_path / "bare"
    done = train_demo(bare, "data.eval_path=null")
    assert done.returncode == 0, done.stderr
    rows = read_jsonl(bare / "metrics.jsonl")
    assert all(set(row) != {"step"} for row in rows), rows[-1]
    assert "no evaluation" in done.stdout


def test_train_says_what_it_does_from_the_start_and_starts_workers_before_torch(tmp_path):
    """From the first second a line says what is happening; the environment and reward
    workers start before the trainer imports torch (their imports overlap it)."""
    out = run_cli(
        "train", "examples/tools_demo.yaml", "--set", f"run.output_dir={tmp_path / 'run'}",
        "--set", "run.max_steps=1", "--set", "eval.num_prompts=8",
        "--set", "logging.progress_bar=false", timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    said = [line for line in out.stderr.splitlines() if line.startswith("INFO leangrpo: ")]
    expected = [
        "starting 1 environment worker(s) and 1 reward worker(s) ...",
        "loading torch ...",
        "loading transformers, the tokenizer and the prompts ...",
        "loading the model examples/tools_demo/model (float32) ...",
        "evaluating on 8 held-out prompts ...",
        "training: 1 steps of 16 prompts x 8 completions",
    ]
    positions = [next(i for i, line in enumerate(said) if line.endswith(e)) for e in expected]
    assert positions == sorted(positions), said
    assert "starting 1 environment worker(s) ..." not in out.stderr  # not started twice


def tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` and its bytes, the lock file left out."""
    files = (p for p in root.rglob("*") if p.is_file() and p.name != ".lock")
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


BAD_REWARD = "def words(prompts, completions, **columns):\n    return ['many'] * len(completions)\n"


def test_overwrite_keeps_the_earlier_run_until_the_new_one_has_a_checkpoint(tmp_path):
    """run.overwrite used to delete the earlier run before checks that then refused the
    run. Now a check after tokenising, or a failure in the run's first batch, leaves it
    whole; a run that writes a checkpoint replaces it."""
    out = tmp_path / "run"
    assert train_demo(out, "run.max_steps=1").returncode == 0
    before = tree(out)
    late = train_demo(out, "run.overwrite=true", "train.micro_batch_tokens=10")
    assert late.returncode == 2 and "train.micro_batch_tokens (10)" in late.stderr
    assert tree(out) == before
    (tmp_path / "bad.py").write_text(BAD_REWARD)
    functions = f"rewards.functions=[{{name: {tmp_path / 'bad.py'}:words}}]"
    failed = train_demo(out, "run.overwrite=true", functions)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr
    assert "reward 'words' failed on all 8 samples of a batch the same way" in failed.stderr
    assert "the earlier run" in failed.stderr and "is back in place" in failed.stderr
    assert tree(out) == before
    fresh = train_demo(out, "run.overwrite=true", "run.max_steps=2")
    assert fresh.returncode == 0, fresh.stderr
    assert max(metric_steps(out)) == 2 and not (out / ".replaced-run").exists()


def test_damaged_checkpoints_resume_from_the_newest_intact_one_or_stop_in_one_sentence(tmp_path):
    out = tmp_path / "run"
    every = ("checkpoint.every_steps=1", "checkpoint.keep_last=2")
    assert train_demo(out, *every).returncode == 0  # step-1 and step-2
    (out / "checkpoints" / "step-2" / "optimizer.pt").unlink()
    again = train_demo(out, "run.max_steps=3", *every)
    assert again.returncode == 0, again.stderr
    assert (
        "resuming from step-1, the newest intact checkpoint: step-2 is damaged "
        "(optimizer.pt is missing)" in again.stderr
    )
    assert re.search(r"resumed from \S*step-1 at step 1", again.stderr)
    assert "kept the damaged checkpoint step-2 as" in again.stderr  # not pruned by step-2's save
    kept = ["damaged-step-2", "step-2", "step-3"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == kept
    for step in (2, 3):  # both damaged: nothing to resume exactly
        weights = out / "checkpoints" / f"step-{step}" / "model" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    none = train_demo(out, "run.max_steps=4", *every, probe=True)
    assert none.returncode == 2 and "Traceback" not in none.stderr
    message = none.stderr.strip()
    assert message.count("\n") == 0 and message.startswith("leangrpo: error: No intact checkpoint")
    assert "step-3 is damaged (model/model.safetensors holds 100 bytes, not the" in message
    assert "set run.overwrite: true to start this run again" in message
    assert none.stdout.strip() == "torch imported: False"  # refused before anything loads


def test_version_and_check_run_the_checks_of_train_and_write_nothing(tmp_path):
    version = run_cli("--version")
    assert version.returncode == 0 and re.fullmatch(r"leangrpo \S+\n", version.stdout)
    cfg = base_config(tmp_path)
    ok = run_cli("check", write(tmp_path, cfg))
    assert ok.returncode == 0, ok.stderr
    assert f"run directory: {tmp_path / 'run'}: a fresh start (to be created)" in ok.stdout
    assert "prompts: 2000 to train on, 0 to evaluate; the longest has" in ok.stdout
    assert ok.stdout.strip().endswith("leangrpo check: OK (nothing was written to the run directory)")
    assert not (tmp_path / "run").exists()
    for case in ("a 5 MB prompt", "micro-batch below max_new_tokens", "missing column"):
        bad = base_config(tmp_path)
        BAD_INPUTS[case][0](bad, tmp_path)
        checked = run_cli("check", write(tmp_path, bad))
        trained = run_cli("train", write(tmp_path, bad))
        assert checked.returncode == trained.returncode == 2
        assert checked.stderr == trained.stderr  # the same check, the same sentence
    late = base_config(tmp_path)
    late["train"] = {"micro_batch_tokens": 10}  # found after tokenising, in the set-up
    checked = run_cli("check", write(tmp_path, late))
    assert checked.returncode == 2 and "train.micro_batch_tokens (10) is smaller" in checked.stderr
    loaded = run_cli("check", write(tmp_path, cfg), "--model")
    assert loaded.returncode == 0, loaded.stderr
    assert "model: loaded on cpu, 187,200 parameters, 187,200 of them trained" in loaded.stdout


def test_check_describes_a_run_directory_without_touching_it(tmp_path):
    out = tmp_path / "run"
    assert train_demo(out, "checkpoint.every_steps=1").returncode == 0
    before = tree(out)
    args = ["check", "examples/demo.yaml", "--set", f"run.output_dir={out}", *SHORT_DEMO]
    finished = run_cli(*args)
    assert finished.returncode == 0 and "is already finished" in finished.stdout
    resumed = run_cli(*args, "--set", "run.max_steps=3")
    assert f"resumes from {out / 'checkpoints' / 'step-2'} (step 2, its files verified)" in (
        resumed.stdout
    )
    replaced = run_cli(*args, "--set", "run.overwrite=true")
    assert "run.overwrite replaces the earlier run there (checkpoints, final, metrics.jsonl" in (
        replaced.stdout
    )
    assert tree(out) == before


PROBE_LOCK = (
    "import sys, time; from pathlib import Path; from leangrpo.checkpoint.rundir import RunLock\n"
    "RunLock(Path(sys.argv[1])); print('locked', flush=True); time.sleep(300)\n"
)


def test_prompt_past_the_context_or_the_micro_batch_is_refused_before_the_model(tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2"}] * 20 + [{"prompt": "9" * 126, "answer": "9"}]
    data = write_jsonl(tmp_path / "train.jsonl", rows)
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


SLEEPING_REWARD = """
import json, subprocess, time

EVAL = {{json.loads(line)["prompt"] for line in open({eval_path!r})}}

def sleepy(prompts, completions, **columns):
    if prompts[0] not in EVAL:  # training batches (a call holds one sample: rewards/pool.py)
        subprocess.Popen(["sleep", "301"])  # a process the reward starts: must die too
        time.sleep(300)
    return [1.0] * len(completions)
"""


def sleeping(pid: int) -> list:
    """The `sleep 301` processes below `pid`: the sleepy reward is in flight."""
    import psutil

    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if child.cmdline() == ["sleep", "301"]:
                found.append(child)
        except psutil.Error:
            pass
    return found


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ctrl_c_ends_the_run_promptly_without_orphans(tmp_path, mode):
    """Ctrl-C while a reward call is in flight: the run used to wait for the reward's own
    time limit (here 300 s) before exiting (async). The batch being made is abandoned (sync:
    in the main thread; async: the trainer's wait for it) and the step reached, 0, saved."""
    import psutil

    out = tmp_path / "run"
    eval_path = str(ROOT / "examples" / "demo" / "eval.jsonl")
    (tmp_path / "sleepy.py").write_text(SLEEPING_REWARD.format(eval_path=eval_path))
    sets = {
        "run.output_dir": out,
        "run.max_steps": 500,
        "pipeline.mode": mode,
        "logging.progress_bar": "false",
        "rewards.functions": f"[{tmp_path / 'sleepy.py'}:sleepy]",
        "rewards.timeout_s": 300,
        "eval.num_prompts": 4,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "leangrpo", "train", "examples/demo.yaml"]
        + [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 600  # until the reward is in flight: its `sleep 301` runs
    while time.time() < deadline and not sleeping(proc.pid) and proc.poll() is None:
        time.sleep(0.2)
    assert sleeping(proc.pid), "the reward was never called"
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGINT)
    try:  # a hang guard, below the reward's 300 s: the run does not wait for it
        _, stderr = proc.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        proc.kill()  # (not communicate(): orphans would hold its stderr open)
        proc.wait()
        pytest.fail("Ctrl-C waited on the reward in flight")
    assert proc.returncode == 130, stderr[-3000:]
    line = stderr.strip().splitlines()[-1]
    saved = out / "checkpoints" / "step-0"
    assert line == f"leangrpo: stopped by SIGINT at step 0: checkpoint saved to {saved}; " + (
        "run the same command to resume"
    )
    assert (saved / "COMPLETE").is_file() and "Traceback" not in stderr
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"orphans left: {alive}"


# -- stop signals: a checkpoint at the step reached, then exit 128 + signal ------------------

STOP_DEMO = {  # 8 steps of 2 per batch (mu 2): a stop can fall inside a batch
    "run.max_steps": 8,
    "loss.mu": 2,
    "checkpoint.every_steps": 5,
    "checkpoint.keep_last": 3,
    "eval.every_steps": 0,
    "eval.num_prompts": 8,
    "logging.progress_bar": "false",
    "logging.samples_every": 0,
}
STOPPED = re.compile(
    r"^leangrpo: stopped by SIGTERM at step (\d+): checkpoint saved to (\S+); "
    r"run the same command to resume$"
)


def demo_command(out: Path, sets: dict, script: str | None = None) -> list[str]:
    head = ["-c", script] if script else ["-m", "leangrpo"]
    sets = {**sets, "run.output_dir": out}
    return [sys.executable, *head, "train", "examples/demo.yaml"] + [
        arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")
    ]


def start_demo(out: Path, sets: dict, script: str | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        demo_command(out, sets, script), cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def wait_for_step(proc: subprocess.Popen, out: Path, step: int, limit_s: float = 600) -> None:
    """Until metrics.jsonl has a row for `step` (the run is training)."""
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + limit_s
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and step in metric_steps_so_far(metrics):
            return
        time.sleep(0.02)
    proc.kill()
    pytest.fail(f"the run never logged step {step}: {proc.communicate()[1][-2000:]}")


def metric_steps_so_far(metrics: Path) -> set[int]:
    lines = metrics.read_text().splitlines()
    return {json.loads(x)["step"] for x in lines if x.endswith("}")}  # the last may be torn


def final_weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "final" / "model.safetensors")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigterm_saves_the_step_it_reached_and_the_resumed_run_equals_the_straight_one(
    tmp_path, mode
):
    """SIGTERM (what SLURM, Kubernetes and spot instances send) used to end the run with
    nothing saved since the last scheduled checkpoint (step 5 here, if any)."""
    import torch

    sets = {**STOP_DEMO, "pipeline.mode": mode, "pipeline.max_staleness": 0}
    straight = subprocess.run(demo_command(tmp_path / "straight", sets), cwd=ROOT,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
    assert straight.returncode == 0, straight.stderr[-3000:]

    out = tmp_path / "stopped"
    proc = start_demo(out, sets)
    wait_for_step(proc, out, 3)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)  # a hang guard
    assert proc.returncode == 143, stderr[-3000:]
    line = stderr.strip().splitlines()[-1]
    found = STOPPED.match(line)
    assert found, line
    step = int(found.group(1))
    assert 3 <= step < 8 and Path(found.group(2)) == out / "checkpoints" / f"step-{step}"
    assert (out / "checkpoints" / f"step-{step}" / "COMPLETE").is_file()
    assert not (out / "final").exists() and "Traceback" not in stderr
    assert max(metric_steps_so_far(out / "metrics.jsonl")) == step

    resumed = subprocess.run(demo_command(out, sets), cwd=ROOT, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {step}" in resumed.stderr and "resumed from" in resumed.stderr
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 9))  # each step once
    expected, got = final_weights(tmp_path / "straight"), final_weights(out)
    assert sorted(expected) == sorted(got)
    assert all(torch.equal(expected[k], got[k]) for k in expected), "resume is not exact"


# The CLI, with the stop checkpoint's save slowed down once it has written the model files
SLOW_STOP_SAVE = """
import os, sys, time
from pathlib import Path
from leangrpo import stopping
from leangrpo.checkpoint import local as checkpoint
from leangrpo.cli import main

real = checkpoint.save_model_weights

def slow(model, directory, for_resume):
    real(model, directory, for_resume)
    if stopping._active is not None and stopping._active.requested:  # the stop's save
        mark = Path(os.environ["LEANGRPO_TEST_MARK"])  # written whole, then renamed: the
        part = mark.with_name(mark.name + ".part")  # test reads it as soon as it exists
        part.write_text(str(Path(directory).parent))
        os.replace(part, mark)
        time.sleep(600)

checkpoint.save_model_weights = slow
sys.exit(main(sys.argv[1:]))
"""


def test_a_second_sigterm_during_the_stop_checkpoint_exits_at_once_leaving_the_last_one(
    tmp_path,
):
    import os

    from leangrpo.checkpoint.rundir import latest_checkpoint

    out, mark = tmp_path / "run", tmp_path / "saving"
    sets = {**STOP_DEMO, "checkpoint.every_steps": 2}
    proc = subprocess.Popen(
        demo_command(out, sets, SLOW_STOP_SAVE), cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, env={**os.environ, "LEANGRPO_TEST_MARK": str(mark)},
    )  # fmt: skip
    wait_for_step(proc, out, 3)
    proc.send_signal(signal.SIGTERM)
    first = time.monotonic()
    while not mark.exists() and proc.poll() is None and time.monotonic() < first + 300:
        time.sleep(0.02)
    assert mark.exists(), proc.communicate()[1][-3000:]
    half = Path(mark.read_text())  # the stop checkpoint's directory, model files written
    time.sleep(max(0.0, first + 1.5 - time.monotonic()))  # past the repeat window
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)  # the save sleeps 600 s: it did not wait
    assert proc.returncode == 143, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        "leangrpo: second SIGTERM: exiting now; the last complete checkpoint is intact"
    )
    assert half.name.startswith(".tmp-step-") and (half / "model").is_dir()
    last = latest_checkpoint(out)  # the half-written one is not taken for a checkpoint
    assert last is not None and last.name in {"step-2", "step-4", "step-6"}
    assert int(last.name[5:]) < int(half.name.split("-")[2])
    again = subprocess.run(demo_command(out, sets), cwd=ROOT, capture_output=True, text=True,
                           timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {last} at step {last.name[5:]}" in again.stderr
    assert not half.exists()  # the next save removed it


# -- leangrpo eval ---------------------------------------------------------------------------

EVAL_RUN = ["eval.every_steps=1", "checkpoint.every_steps=1", "checkpoint.keep_last=5"]
QLORA = ["lora.enabled=true", "lora.r=4", "lora.alpha=8", "train.learning_rate=0.01"]
if importlib.util.find_spec("bitsandbytes") is not None:
    QLORA.append("model.quantization=nf4")  # the CI installs it: QLoRA's final/ is an adapter


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """Two 2-step demo runs that evaluate (8 prompts) after every step: full fine-tuning,
    and (Q)LoRA, whose checkpoints and final/ hold an adapter."""
    runs = {}
    for name, extra in (("full", EVAL_RUN), ("qlora", [*EVAL_RUN, *QLORA])):
        out = tmp_path_factory.mktemp(name) / "run"
        done = train_demo(out, *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = out
    return runs


def run_eval(*args: str, probe: bool = False) -> subprocess.CompletedProcess:
    return run_cli("eval", *map(str, args), probe=probe, timeout=300)


def logged_eval(out: Path, step: int) -> dict:
    (row,) = [r for r in read_jsonl(out / "metrics.jsonl") if r["step"] == step and "eval/reward" in r]
    return {k: v for k, v in row.items() if k.startswith("eval/")}


def last_eval_row(path: Path) -> dict:
    return read_jsonl(path)[-1]


@pytest.mark.parametrize("name", ["full", "qlora"])
def test_eval_scores_final_and_checkpoints_as_the_run_logged_them(trained, name, tmp_path):
    """final/ (a full model or a (Q)LoRA adapter) and each checkpoint give the eval/*
    figures the run logged at that step (greedy, the run's own eval prompts)."""
    out = trained[name]
    for target, step in ((out, 2), (out / "checkpoints" / "step-1", 1)):
        done = run_eval(target)
        assert done.returncode == 0, done.stderr[-3000:]
        row = last_eval_row(out / "eval.jsonl")
        assert row["step"] == step and row["eval/version"] == step
        figures = {k: v for k, v in row.items() if k.startswith("eval/")}
        assert figures == logged_eval(out, step), (target, figures)
        assert f"eval/reward {'':<{len('eval/completion_length') - len('eval/reward')}}" in done.stdout
        assert f"written to {out / 'eval.jsonl'}" in done.stdout


def test_eval_on_other_data_rewards_and_sampled(trained, tmp_path):
    """--data, --rewards, --num-prompts and sampling (--temperature, --num-generations):
    the figures of those prompts and functions; a sampled scoring is seeded (run.seed)."""
    out = trained["full"]
    data = tmp_path / "few.jsonl"
    write_jsonl(data, [{"prompt": "12+30=", "answer": 42}, {"prompt": "1+1=", "answer": 2},
                       {"prompt": "20+20=", "answer": 40}])  # fmt: skip
    args = [out / "checkpoints" / "step-2", "--data", data, "--rewards", "math", "length",
            "--set", "rewards.functions[1].kwargs={target: 2}", "--num-prompts", "2",
            "--temperature", "1.0", "--num-generations", "3", "--out", tmp_path / "e.jsonl"]  # fmt: skip
    rows = []
    for _ in range(2):
        done = run_eval(*args)
        assert done.returncode == 0, done.stderr[-3000:]
        rows.append(last_eval_row(tmp_path / "e.jsonl"))
    assert rows[0] == rows[1]  # seeded
    row = rows[0]
    assert row["data"] == str(data) and row["step"] == 2
    assert set(row) >= {"eval/reward/math", "eval/reward/length", "eval/failures"}
    assert 0 <= row["eval/reward/math"] <= 1 and row["eval/failures"] == 0
    assert not (out / "eval.jsonl").exists() or all(
        r["data"] != str(data) for r in read_jsonl(out / "eval.jsonl")
    )
    lone = tmp_path / "elsewhere" / "final"  # outside its run: the settings given
    shutil.copytree(out / "final", lone)
    done = run_eval(lone, "--config", out / "config.yaml", "--num-prompts", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    row = last_eval_row(tmp_path / "elsewhere" / "eval.jsonl")
    assert row["checkpoint"] == str(lone) and row["step"] == 2  # the step final/ records


def damaged_copies(trained: dict[str, Path], tmp: Path) -> list[tuple[Path, str]]:
    """Copies of the runs' files, each damaged one way, and the sentence each must give."""
    full, qlora = trained["full"], trained["qlora"]
    cases = []

    def copy(src: Path, name: str) -> Path:
        dst = tmp / name
        shutil.copytree(src, dst)
        return dst

    ckpt = copy(full / "checkpoints" / "step-2", "truncated-ckpt")
    weights = ckpt / "model" / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size // 2])
    cases.append((ckpt, f"is damaged (model/model.safetensors holds {size // 2} bytes, not the {size} it was written with)"))
    flipped = copy(full / "checkpoints" / "step-1", "flipped-ckpt")
    blob = bytearray((flipped / "model" / "model.safetensors").read_bytes())
    blob[-5] ^= 0xFF  # inside a tensor: only the checksum can tell
    (flipped / "model" / "model.safetensors").write_bytes(bytes(blob))
    cases.append((flipped, "model/model.safetensors does not match its checksum"))
    partial = copy(full / "checkpoints" / "step-1", "partial-ckpt")
    (partial / "COMPLETE").unlink()
    (partial / "config.yaml").unlink()
    cases.append((partial, "is not complete (no COMPLETE marker"))
    final = copy(full / "final", "truncated-final")
    (final / "model.safetensors").write_bytes((final / "model.safetensors").read_bytes()[:100])
    cases.append((final, "truncated-final' is damaged: "))
    adapter = copy(qlora / "final", "bad-adapter")
    (adapter / "adapter_config.json").write_text("{not json")
    cases.append((adapter, "adapter_config.json' cannot be read as JSON"))
    sharded = tmp / "sharded"
    (sharded / "dcp").mkdir(parents=True)
    cases.append((sharded, "is a sharded (torchrun) checkpoint"))
    run = copy(full, "all-damaged-run")
    shutil.rmtree(run / "final")
    for step_dir in (run / "checkpoints").iterdir():
        (step_dir / "trainer_state.json").write_text("{}")
    cases.append((run, "has no final/ and no intact checkpoint (step-2 is damaged: trainer_state.json holds 2 bytes"))
    cases.append((tmp / "nowhere", "'nowhere' does not exist".replace("'nowhere'", str(tmp / "nowhere") + "'")))
    (tmp / "empty").mkdir()
    cases.append((tmp / "empty", "holds no run, checkpoint or model"))
    lone = copy(full / "final", "lone-final")  # outside its run: no settings
    cases.append((lone, "no config.yaml beside"))
    return cases


def test_eval_refuses_what_is_damaged_in_one_sentence_before_torch(trained, tmp_path):
    for target, expected in damaged_copies(trained, tmp_path):
        done = run_eval(target, probe=True)
        assert done.returncode == 2, (target, done.stderr[-2000:])
        assert done.stderr.startswith("leangrpo: error: ") and done.stderr.count("\n") == 1, done.stderr
        assert expected in done.stderr, (target, done.stderr)
        assert done.stdout.strip().endswith("torch imported: False"), target


def test_eval_refuses_non_finite_weights(trained, tmp_path):
    """A valid file whose adapter tensors are NaN (a diverged run, a bad copy): refused once
    loaded, naming a tensor."""
    from safetensors.torch import load_file, save_file

    adapter = tmp_path / "run"
    shutil.copytree(trained["qlora"], adapter)
    file = adapter / "final" / "adapter_model.safetensors"
    tensors = {k: v.fill_(float("nan")) for k, v in load_file(file).items()}
    save_file(tensors, file)
    done = run_eval(adapter)
    assert done.returncode == 2 and "holds non-finite weights (" in done.stderr, done.stderr[-2000:]
    assert done.stderr.count("leangrpo: error:") == 1


def test_eval_of_a_multi_turn_run_scores_its_trajectories_as_the_run_did(tmp_path):
    out = tmp_path / "tools"
    sets = ["run.max_steps=1", "eval.num_prompts=4", "rollout.prompts_per_batch=4",
            "rollout.num_generations=2", "logging.progress_bar=false", "logging.samples_every=0",
            f"run.output_dir={out}"]  # fmt: skip
    done = run_cli("train", "examples/tools_demo.yaml", *[x for s in sets for x in ("--set", s)], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    scored = run_eval(out)
    assert scored.returncode == 0, scored.stderr[-3000:]
    row = last_eval_row(out / "eval.jsonl")
    timing = ("_s", "in_flight_mean")  # seconds, and a time-weighted mean: the clock's
    figures = {k: v for k, v in row.items() if k.startswith("eval/") and not k.endswith(timing)}
    logged = {k: v for k, v in logged_eval(out, 1).items() if not k.endswith(timing)}
    assert figures == logged and "eval/multiturn/turns" in figures


def test_a_full_disk_outside_a_checkpoint_is_one_sentence(monkeypatch, capsys):
    """A write that meets ENOSPC (metrics.jsonl, a rewritten log at a resume) ended in an
    OSError traceback; checkpoints say it themselves (tests/checkpoint/test_local.py)."""
    import errno
    import os

    from leangrpo import cli

    def full(args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/run/metrics.jsonl")

    monkeypatch.setattr(cli, "_dispatch", full)
    assert cli.main(["report", "/run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("leangrpo: error: no space left on the disk writing /run/metrics.jsonl")
    assert "\n" not in err and "Traceback" not in err
