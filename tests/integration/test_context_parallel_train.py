"""`leangrpo train` with distributed.context_parallel_size: 2 under torchrun (gloo, CPU).

The demo's full fine-tuning run (mu = 2, a KL term through the sharded reference,
checkpointed layers), 6 steps:
- C = 2 on 2 processes (one data-parallel share: both ranks train on every micro-batch,
  each on half of every row) ends with the parameters of one process on the same batches
  (same prompts, per-group seeds, micro-batch budget), and logs the same figures once;
- the async run at max_staleness 0, stopped by SIGTERM on one rank after step 4 (every
  rank saves the same step) and resumed from a checkpoint inside a batch, ends bitwise
  with the parameters of the uninterrupted sync run: async at staleness 0 equals sync at
  C = 2, and the sharded checkpoint of the 1 x 2 mesh resumes exactly.
Step-level exactness (every loss type, LoRA, dp 2 x cp 2) is tests/distributed/test_context_parallel.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
from support.configs import demo_config
from support.torchrun import (
    final_tensors,
    finish,
    logged_steps,
    max_abs_diff,
    start_ranks,
    torchrun,
    wait_for_logged_step,
)

from leangrpo.config import config_from_dict
from leangrpo.train import Trainer

STEPS = 6


def cp_run(out, world_size: int, context: int, mode: str = "sync") -> dict:
    cfg = demo_config(out, "full_sync", world_size, run={"max_steps": STEPS},
                      train={"micro_batch_tokens": 64},  # one share: the whole batch, as 1 process
                      distributed={"context_parallel_size": context})  # fmt: skip
    if mode == "async":
        cfg["pipeline"] = {"mode": "async", "max_staleness": 0, "stall_timeout_s": 60}
    return cfg


def rows(out) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if '"loss"' in x]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The C = 2 run (torchrun) and one process on the same batches (in this process,
    overlapping the torchrun's start-up)."""
    tmp = tmp_path_factory.mktemp("cp")
    two = cp_run(tmp / "two", 2, 2)
    proc = torchrun(two)
    start = time.monotonic()
    Trainer(config_from_dict(cp_run(tmp / "one", 1, 1))).train()
    one_s = time.monotonic() - start
    log = finish(proc, two)
    return tmp, log, one_s


@pytest.mark.slow
def test_two_context_ranks_train_like_one_process(runs):
    tmp, log, _ = runs
    diff = max_abs_diff(final_tensors(tmp / "two"), final_tensors(tmp / "one"))
    print(f"C = 2: max |param(C = 2) - param(1 process)| = {diff:.3g}")
    assert diff <= 1e-5
    assert "1 data-parallel x 2 context-parallel (Ulysses)" in log
    assert "replicated 2x" in log  # the demo model's one key/value head
    two, one = rows(tmp / "two"), rows(tmp / "one")
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))  # rank 0 alone logs
    for a, b in zip(two, one):  # the share's figures once, not once per rank
        assert a["packing/tokens"] == b["packing/tokens"]
        assert a["packing/micro_batches"] == b["packing/micro_batches"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["loss/tokens"] == b["loss/tokens"]


@pytest.mark.slow
def test_async_at_staleness_0_stopped_and_resumed_equals_sync(runs, tmp_path):
    tmp, _, _ = runs
    cfg = cp_run(tmp_path / "run", 2, 2, mode="async")
    metrics = tmp_path / "run" / "metrics.jsonl"
    procs, logs = start_ranks(cfg, tmp_path)
    try:
        wait_for_logged_step(procs, metrics, 4)
        os.kill(procs[1].pid, signal.SIGTERM)  # one rank; the other learns at the boundary
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for f in logs:
            f.close()
    texts = [(tmp_path / f"rank{r}.log").read_text() for r in range(2)]
    assert codes == [143, 143], texts[0][-2000:] + texts[1][-2000:]
    found = re.findall(r"stopped by SIGTERM at step (\d+): checkpoint saved", texts[0])
    assert len(found) == 1, texts[0][-3000:]
    step = int(found[0])
    assert 4 <= step < STEPS and max(logged_steps(metrics)) == step
    checkpoints = tmp_path / "run" / "checkpoints"
    assert (checkpoints / f"step-{step}" / "COMPLETE").is_file()
    # resume inside a batch (mu = 2: batches end at even steps), where each rank takes back
    # its own share's old and reference log-probs: the SIGTERM's checkpoint when odd, else
    # the step-3 one (checkpoint.every_steps = 3)
    inside = step if step % 2 else 3
    cfg["run"]["resume"] = str(checkpoints / f"step-{inside}")
    log = finish(torchrun(cfg), cfg)
    assert f"at step {inside}" in log and "resumed from" in log
    assert max_abs_diff(final_tensors(tmp_path / "run"), final_tensors(tmp / "two")) == 0.0
