"""`leangrpo train` on a mixture of experts under torchrun (2 CPU ranks, gloo, FSDP2),
with routing replay (and the router's aux loss where the micro-batches are one process's),
against one process on the same batches:

- data parallel: full fine-tuning (sync, mu 2: the old pass, a KL term through the
  sharded reference, checkpointed layers, padding micro-batches) and LoRA on attention,
  experts and routers (async at staleness 0; every rank generates its share with its own
  hf engine copy, whose route records are exchanged with the samples) end with one
  process's parameters and log the same moe/* figures;
- context parallel (C = 2, the aux loss on): each rank replays the records of its half of
  every row, the aux loss's counts summed over the group;
- both ranks killed inside a batch and resumed from the sharded checkpoint (the batch in
  progress holds the samples and their records) end bitwise with the uninterrupted run.
Marked slow: each 2-rank run takes ~30-60 s on 2 busy cores.
"""

from __future__ import annotations

import json
import time

import pytest
from support.configs import STEPS, demo_config
from support.moe import save_moe_model
from support.torchrun import final_tensors, finish, kill_tree, max_abs_diff, torchrun

from leangrpo.config import config_from_dict
from leangrpo.train import Trainer


def moe_config(out, mode: str, world: int, model_dir, context: int = 1) -> dict:
    """The demo's torchrun run on the MoE, replaying routes. The aux loss is per
    micro-batch (not linear in its tokens), so it is on only where the ranks' micro-batches
    are one process's: context parallelism (one share, the same budget)."""
    cfg = demo_config(out, mode, world, model={"name_or_path": str(model_dir)})
    cfg["rollout"]["routing_replay"] = True
    if context > 1:  # one share: the whole batch, as one process
        cfg["train"].update(micro_batch_tokens=64, router_aux_loss_coef=0.01)
        cfg["distributed"]["context_parallel_size"] = context
    return cfg


def rows(out) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if '"loss"' in x]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_moe_model(tmp_path_factory.mktemp("moe") / "qwen3_moe")


@pytest.fixture(scope="module", params=["full_sync", "lora_async", "context_parallel"])
def runs(request, tmp_path_factory, model_dir):
    case, tmp = request.param, tmp_path_factory.mktemp(request.param)
    mode = "full_sync" if case == "context_parallel" else case
    context = 2 if case == "context_parallel" else 1
    two = moe_config(tmp / "two", mode, 2, model_dir, context)
    proc = torchrun(two)
    one = moe_config(tmp / "one", mode, 1, model_dir)
    if context > 1:
        one["train"].update(micro_batch_tokens=64, router_aux_loss_coef=0.01)
    start = time.monotonic()
    Trainer(config_from_dict(one)).train()
    log = finish(proc, two)
    return case, tmp, log, time.monotonic() - start


@pytest.mark.slow
def test_two_moe_ranks_train_like_one_process(runs):
    case, tmp, log, _ = runs
    diff = max_abs_diff(final_tensors(tmp / "two"), final_tensors(tmp / "one"))
    print(f"{case}: max |param(2 ranks) - param(1 process)| = {diff:.3g}")
    assert diff <= 1e-5
    two, one = rows(tmp / "two"), rows(tmp / "one")
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    for a, b in zip(two, one):
        assert a["moe/route_tokens"] == b["moe/route_tokens"] > 0
        assert a["moe/routing_flips"] == pytest.approx(b["moe/routing_flips"], abs=1e-9)
        if case == "context_parallel":
            assert a["moe/aux_loss"] == pytest.approx(b["moe/aux_loss"], rel=1e-4)
    if case == "context_parallel":
        assert "1 data-parallel x 2 context-parallel (Ulysses)" in log


@pytest.mark.slow
def test_a_killed_two_rank_moe_run_resumes_exactly(runs, model_dir):
    case, tmp, _, _ = runs
    if case != "full_sync":
        pytest.skip("run once: full fine-tuning, mu = 2, sync")
    cfg = moe_config(tmp / "killed", case, 2, model_dir)
    proc = torchrun(cfg)
    marker = tmp / "killed" / "checkpoints" / "step-3" / "COMPLETE"
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    kill_tree(proc)
    proc.wait()
    assert marker.exists()
    log = finish(torchrun(cfg), cfg)
    assert "resumed from" in log
    assert max_abs_diff(final_tensors(tmp / "killed"), final_tensors(tmp / "two")) == 0.0
