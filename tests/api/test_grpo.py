"""`leangrpo.GRPO(...).train()` from a script: the CLI's run (checks, sandboxed workers, the
trainer, its log lines and summary), a `TrainResult` back, the process still alive with no
worker left; a function defined in the script runs in the reward workers; a second session
resumes; a stop signal saves a checkpoint and raises instead of exiting; what cannot be
sent is refused before anything starts."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
from support.configs import DEMO, DEMO_YAML, ROOT

from leangrpo.api.grpo import GRPO
from leangrpo.api.shipping import ShippingError

SCRIPT = """
import json, os, sys
import psutil
import leangrpo
from leangrpo.stopping import RunStopped

TRAINER = os.getpid()

def exact(prompts, completions, answer, **columns):  # defined in __main__: sent by value
    elsewhere = os.getpid() != TRAINER
    return [float(elsewhere and c.strip() == str(a)) for c, a in zip(completions, answer)]

run = leangrpo.GRPO(
    "examples/demo.yaml",
    reward_funcs=[exact],
    eval_dataset=EVAL,
    run={"output_dir": OUT, "max_steps": STEPS},
    eval={"num_prompts": 8, "every_steps": 0},
    checkpoint={"every_steps": 1},
    logging={"samples_every": 0},
)
try:
    result = run.train()
    print("RESULT", json.dumps({"step": result.step, "eval": result.eval, "curve": result.eval_curve,
          "final": str(result.final_dir), "run_dir": str(result.run_dir),
          "reward": result.metrics.get("reward/mean")}))
except RunStopped as stop:
    print("STOPPED", stop.step)
print("CHILDREN", len(psutil.Process().children(recursive=True)))
import gc
from leangrpo.train.trainer import Trainer
print("TRAINERS", sum(isinstance(o, Trainer) for o in gc.get_objects()))  # the run is freed
print("STILL HERE")
"""


def script(out, steps: int) -> str:
    head = f"OUT = {str(out)!r}\nSTEPS = {steps}\nEVAL = {str(DEMO / 'eval.jsonl')!r}\n"
    return head + textwrap.dedent(SCRIPT)


def run_script(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=timeout
    )


def lines_with(text: str, head: str) -> list[str]:
    return [line.removeprefix(head + " ") for line in text.splitlines() if line.startswith(head)]


def test_train_from_a_script_returns_its_result_and_a_second_session_resumes(tmp_path):
    out = tmp_path / "run"
    first = run_script(script(out, 2))
    assert first.returncode == 0, first.stderr[-3000:]
    (result,) = [json.loads(x) for x in lines_with(first.stdout, "RESULT")]
    assert result["step"] == 2 and result["run_dir"] == str(out)
    assert result["final"] == str(out / "final") and (out / "final").is_dir()
    assert [step for step, _ in result["curve"]] == [0, 2]
    assert result["eval"]["eval/reward"] == result["curve"][-1][1] > 0  # scored elsewhere
    assert result["reward"] > 0 and lines_with(first.stdout, "CHILDREN") == ["0"]
    assert lines_with(first.stdout, "TRAINERS") == ["0"]
    assert "STILL HERE" in first.stdout.splitlines()
    # logged as the CLI logs: its INFO lines, a progress line, the summary
    assert "INFO leangrpo: starting 1 reward worker(s) ..." in first.stderr
    assert "INFO leangrpo: loading the model" in first.stderr
    assert "leangrpo: finished at step 2" in first.stdout
    second = run_script(script(out, 4))  # a new session sends `exact` again: a resume
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr and "differ from its config" not in second.stderr
    (again,) = [json.loads(x) for x in lines_with(second.stdout, "RESULT")]
    assert again["step"] == 4 and [step for step, _ in again["curve"]] == [0, 2, 4]


def test_a_stop_signal_saves_a_checkpoint_and_raises_instead_of_exiting(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", script(out, 500)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not list((out / "checkpoints").glob("step-2")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    (stopped,) = lines_with(stdout, "STOPPED")
    assert (out / "checkpoints" / f"step-{stopped}" / "COMPLETE").is_file()
    assert "STILL HERE" in stdout.splitlines() and lines_with(stdout, "CHILDREN") == ["0"]


def test_what_cannot_be_sent_is_refused_before_anything_starts():
    lock = threading.Lock()

    def guarded(prompts, completions, **columns):
        with lock:
            return [0.0] * len(completions)

    before = len(psutil.Process().children(recursive=True))
    with pytest.raises(ShippingError, match=r"reward_funcs\[0\] \('guarded'\) cannot be sent"):
        GRPO(DEMO_YAML, reward_funcs=[guarded])
    assert len(psutil.Process().children(recursive=True)) == before


def test_train_result_hands_out_final_only_when_it_holds_the_newest_weights(tmp_path):
    """A run finished at step 2 (final/), then extended and stopped at step 10: final/ is
    step 2's, so `TrainResult.final_dir` is None, not a model ten steps stale."""
    from leangrpo.api.grpo import TrainResult
    from leangrpo.checkpoint.manifest import record_files, write_complete
    from leangrpo.checkpoint.rundir import write_final_state

    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    write_final_state(out / "final", 2, 2)
    (out / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(11)))
    for step in (2, 10):
        checkpoint = out / "checkpoints" / f"step-{step}"
        checkpoint.mkdir(parents=True)
        (checkpoint / "trainer_state.json").write_text(json.dumps({"step": step}))
        write_complete(checkpoint, step, record_files(checkpoint))
        result = TrainResult.read(out)
        assert result.final_dir == (out / "final" if step == 2 else None), step
    assert result.step == 10
