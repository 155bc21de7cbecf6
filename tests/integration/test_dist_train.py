"""`leangrpo train` under torchrun on 2 CPU ranks (gloo), against one process.

- exactness: a 2-rank run and a 1-rank run of the demo with the same global batch (same
  prompts, per-group seeds, one group per hf forward, twice the micro-batch budget for the
  single process) end with the same parameters: full fine-tuning in sync mode (mu = 2, so
  old log-prob passes and padding micro-batches run), LoRA in async mode at staleness 0;
- the final directory loads with from_pretrained / PeftModel;
- a 2-rank run killed (both processes) and resumed ends bitwise equal to the uninterrupted
  one; resuming it with another number of processes is refused in one sentence;
- a rank killed mid-run makes the other exit within distributed.timeout_s with one line
  naming it and the phase, leaving no process behind (reward workers included).

The multi-process tests are marked slow (each 2-rank run takes ~20-40 s on 2 busy cores).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.configs import DEMO, STEPS, demo_config
from support.torchrun import (
    descendants,
    final_tensors,
    finish,
    is_alive,
    kill_tree,
    logged_steps,
    max_abs_diff,
    start_ranks,
    torchrun,
    wait_for_logged_step,
)

from leangrpo.checkpoint.rundir import final_state
from leangrpo.config import config_from_dict
from leangrpo.train import Trainer


@pytest.fixture(scope="module", params=["full_sync", "lora_async"])
def runs(request, tmp_path_factory):
    """The 2-rank run (torchrun) and the 1-rank run of the same batches (in this process,
    overlapping the 2-rank one's start-up)."""
    mode, tmp = request.param, tmp_path_factory.mktemp(request.param)
    two = demo_config(tmp / "two", mode, 2)
    proc = torchrun(two)
    one = demo_config(tmp / "one", mode, 1)
    start = time.monotonic()
    Trainer(config_from_dict(one)).train()
    one_s = time.monotonic() - start
    log = finish(proc, two)
    return mode, tmp, two, log, one_s


@pytest.mark.slow
def test_two_ranks_end_with_the_parameters_of_one_process(runs):
    mode, tmp, _, _, _ = runs
    two, one = final_tensors(tmp / "two"), final_tensors(tmp / "one")
    diff = max_abs_diff(two, one)
    print(f"{mode}: max |param(2 ranks) - param(1 process)| = {diff:.3g}")
    assert diff <= 1e-5
    assert moved(one) > 1e-3, "training did not move the weights: the comparison proves nothing"


def moved(trained: dict[str, torch.Tensor]) -> float:
    """How far training moved the weights from the demo model (LoRA: lora_B starts at 0)."""
    if any("lora_B" in k for k in trained):
        return max(float(v.abs().max()) for k, v in trained.items() if "lora_B" in k)
    start = load_file(DEMO / "model" / "model.safetensors")
    return max(float((trained[k] - start[k]).abs().max()) for k in start if k in trained)


@pytest.mark.slow
def test_the_two_rank_run_logs_once_and_writes_a_loadable_final_model(runs):
    from transformers import AutoModelForCausalLM

    mode, tmp, two, log, _ = runs
    rows = [json.loads(x) for x in (tmp / "two" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == list(range(1, STEPS + 1))  # one row per step: rank 0 alone writes
    assert all(r["dist/imbalance"] >= 1.0 and "dist/wait_max" in r for r in rows if "loss" in r)
    if mode == "full_sync":  # the padding micro-batch really ran
        assert sum(r["dist/padding_micro_batches"] for r in rows if "loss" in r) > 0
    assert log.count("packed attention: backend") == 1  # rank 1 logs warnings only
    final = tmp / "two" / "final"
    assert final_state(final) == {"step": STEPS, "version": STEPS}  # rank 0 wrote its record
    if mode == "full_sync":
        model = AutoModelForCausalLM.from_pretrained(final)
        state = model.state_dict()
        for name, t in final_tensors(tmp / "two").items():
            assert torch.equal(state[name], t), name
        return
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(DEMO / "model")
    model = PeftModel.from_pretrained(base, final)
    assert any("lora_B" in n and p.abs().max() > 0 for n, p in model.named_parameters())


@pytest.mark.slow
def test_a_killed_two_rank_run_resumes_exactly(runs):
    """Both processes SIGKILLed after a checkpoint (inside a batch with mu = 2), then the
    same command again: the final parameters equal the uninterrupted run's bitwise."""
    mode, tmp, two, _, _ = runs
    if mode != "full_sync":
        pytest.skip("run once: full fine-tuning, mu = 2, sync")
    cfg = demo_config(tmp / "killed", mode, 2)
    proc = torchrun(cfg)
    marker = tmp / "killed" / "checkpoints" / "step-3" / "COMPLETE"
    deadline = time.monotonic() + 900  # a hang guard
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    kill_tree(proc)  # the agent and both ranks at once
    proc.wait()
    assert marker.exists()
    saved = sorted(int(p.parent.name[5:]) for p in marker.parents[1].glob("step-*/COMPLETE"))
    assert saved[-1] < STEPS and not (tmp / "killed" / "final").exists()
    log = finish(torchrun(cfg), cfg)
    assert f"at step {saved[-1]}" in log and "resumed from" in log
    assert max_abs_diff(final_tensors(tmp / "killed"), final_tensors(tmp / "two")) == 0.0
    # another number of processes: one sentence, before any model loads
    out = subprocess.run(
        [sys.executable, "-m", "leangrpo", "train", str((tmp / "killed").with_suffix(".yaml")),
         "--set", f"run.max_steps={STEPS + 2}"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    line = out.stderr.strip().splitlines()[-1]
    assert "written by 2 process(es) but this run has 1" in line, line


@pytest.mark.slow
def test_with_vllm_servers_rank_0_generates_and_broadcasts(tmp_path):
    """rollout.vllm.mode: server under torchrun: rank 0 alone talks to the server (a real
    `leangrpo serve` handler around a scripted engine) and broadcasts each batch; the 2-rank
    run ends with the parameters of one process using the same server."""
    from support.vllm_fakes import FakeLocal, Served
    from transformers import AutoModelForCausalLM

    class Varied(FakeLocal):  # completion k of a prompt reads "k": a reward with a spread
        uploads: dict[int, dict[str, torch.Tensor]]  # version -> the weights it then held

        def generate(self, prompt_ids, params, n, version, seeds=None, *, run):
            groups = super().generate(prompt_ids, params, n, version, seeds, run=run)
            for group in groups:
                for k, c in enumerate(group):
                    c.text = str(k)
            return groups

        def load_weight_files(self, paths, version, *, run):
            super().load_weight_files(paths, version, run=run)
            self.uploads = getattr(self, "uploads", {})
            self.uploads[version] = {k: v.clone() for k, v in self.weights.items()}

    servers = [Served(Varied(), tmp_path / f"staging{i}") for i in range(2)]
    odd = {"functions": [{"name": "format", "kwargs": {"pattern": "^[13]"}}]}
    try:
        cfgs = [
            demo_config(
                tmp_path / name,
                "full_sync",
                world,
                rollout={"engine": "vllm", "vllm": {"mode": "server", "urls": [server.url]}},
                rewards=odd,
                loss={"mu": 1},
                run={"max_steps": 4},
            )
            for name, world, server in (("two", 2, servers[0]), ("one", 1, servers[1]))
        ]
        for cfg in cfgs:
            del cfg["rollout"]["hf_prompts_per_forward"]
        proc = torchrun(cfgs[0])
        Trainer(config_from_dict(cfgs[1])).train()
        finish(proc, cfgs[0])
    finally:
        for server in servers:
            server.close()
    assert servers[0].local.served == servers[1].local.served  # the same prompts, once each
    held = [server.local.held[1] for server in servers]
    assert held == [4, 4]  # rank 0 pushed every version
    two, one = final_tensors(tmp_path / "two"), final_tensors(tmp_path / "one")
    assert moved(one) > 1e-3
    diff = max_abs_diff(two, one)
    print(f"vllm server: max |param(2 ranks) - param(1 process)| = {diff:.3g}")
    assert diff <= 1e-5
    # what rank 0 uploaded is the policy's gathered weights: version 0 the demo model's,
    # the last one the final model's (bitwise), every version the one process's uploads
    uploads = [server.local.uploads for server in servers]
    assert sorted(uploads[0]) == sorted(uploads[1]) == [0, 1, 2, 3, 4]
    start = AutoModelForCausalLM.from_pretrained(DEMO / "model").state_dict()
    assert set(start) == set(two)
    # a tied weight is written once, under its first name (rollout/vllm.py)
    assert set(uploads[0][0]) == set(start) - {"lm_head.weight"}
    for name, tensor in uploads[0][0].items():
        assert torch.equal(tensor, start[name]), name
        assert torch.equal(uploads[0][4][name], two[name]), name
    for version in range(1, 5):
        assert max_abs_diff(uploads[0][version], uploads[1][version]) <= 1e-5, version


# ------------------------------------------------------------------- a rank that dies


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process tree from /proc")
def test_a_killed_rank_stops_the_other_with_one_line_and_no_orphans(tmp_path):
    """Ranks launched as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR/PORT) but without
    its agent, which would otherwise SIGTERM the survivor itself."""
    timeout_s = 20
    cfg = demo_config(
        tmp_path / "run",
        "full_sync",
        2,
        run={"max_steps": 1000},
        distributed={"timeout_s": timeout_s},
    )
    procs, logs = start_ranks(cfg, tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 900  # a hang guard
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            if metrics.exists() and metrics.read_text().count('"loss"') >= 2:
                break
            time.sleep(0.1)
        assert all(p.poll() is None for p in procs), "a rank ended before the kill"
        family = descendants(procs[0].pid) | descendants(procs[1].pid)
        assert family, "no reward worker found under the ranks"
        killed_at = time.monotonic()
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[0].wait(timeout=timeout_s + 300)  # a hang guard
        took = time.monotonic() - killed_at
        procs[1].wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in logs:
            log.close()
    rank0 = (tmp_path / "rank0.log").read_text()
    assert procs[0].returncode == 1, rank0[-3000:]
    # the watch's timeout, then the exit (gloo's own timeout would be 30 min): a liveness bound
    assert took <= timeout_s + 60, f"rank 0 took {took:.1f} s to stop"
    lines = [x for x in rank0.splitlines() if x.startswith("leangrpo: error:")]
    assert len(lines) == 1, rank0[-3000:]
    assert "rank 1 (in " in lines[0] and "stopped answering" in lines[0], lines[0]
    assert any(f"during {p}" in lines[0] for p in ("generate", "score", "train", "sync")), lines[0]
    deadline = time.monotonic() + 60  # reward workers notice their parent's death within ~1 s
    while any(is_alive(pid) for pid in family) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in family if is_alive(pid)], "processes outlived the run"


@pytest.mark.slow
@pytest.mark.parametrize("who", ["rank 1 only", "torchrun's agent"])
def test_sigterm_stops_every_rank_at_one_step_with_its_checkpoint_and_resumes_exactly(
    runs, tmp_path, who
):
    """A SIGTERM reaching one rank (its peer learns of it in the all-reduce at the next
    step boundary), or torchrun's agent (which forwards it to every worker): every rank
    saves the same step, exits 143, rank 0 says so in one line, and the same command
    resumes it to the uninterrupted 2-rank run's parameters, bitwise."""
    import re

    mode, tmp, _, _, _ = runs
    if mode != "full_sync":
        pytest.skip("run once: full fine-tuning, mu = 2, sync")
    cfg = demo_config(tmp_path / "run", mode, 2)
    metrics = tmp_path / "run" / "metrics.jsonl"
    if who == "rank 1 only":
        procs, logs = start_ranks(cfg, tmp_path)
        try:
            wait_for_logged_step(procs, metrics, 4)
            os.kill(procs[1].pid, signal.SIGTERM)
            codes = [p.wait(timeout=600) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            for log in logs:
                log.close()
        texts = [(tmp_path / f"rank{r}.log").read_text() for r in range(2)]
        assert codes == [143, 143], texts[0][-2000:] + texts[1][-2000:]
        log = texts[0]
        assert "stopped by" not in texts[1]  # rank 0 alone says it
    else:
        proc = torchrun(cfg)
        try:
            wait_for_logged_step([proc], metrics, 4)
            proc.send_signal(signal.SIGTERM)  # the agent: it forwards SIGTERM to each rank
            proc.wait(timeout=600)  # torchrun SIGKILLs ranks still there after 30 s
        finally:
            if proc.poll() is None:
                kill_tree(proc)
                proc.wait()
        log = (tmp_path / "run").with_suffix(".log").read_text()
    found = re.findall(r"leangrpo: stopped by SIGTERM at step (\d+): checkpoint saved to "
                       r"(\S+); run the same command to resume", log)  # fmt: skip
    assert len(found) == 1, log[-4000:]
    step = int(found[0][0])
    saved = tmp_path / "run" / "checkpoints" / f"step-{step}"
    assert 4 <= step < STEPS and found[0][1] == str(saved)
    assert (saved / "COMPLETE").is_file() and max(logged_steps(metrics)) == step
    assert sorted(p.name for p in saved.glob("rng-*.pt")) == ["rng-0.pt", "rng-1.pt"]
    log = finish(torchrun(cfg), cfg)
    assert f"at step {step}" in log and "resumed from" in log
    assert max_abs_diff(final_tensors(tmp_path / "run"), final_tensors(tmp / "two")) == 0.0


@pytest.mark.slow
def test_per_rank_producers_stop_together_when_one_waits_in_an_exchange(tmp_path):
    """Rank 0's producer thread has started a batch (it waits in the batch's exchange) that
    rank 1's never starts: at the end of the run, rank 1 joins that exchange with an abort,
    so both threads end at once instead of rank 0's waiting for distributed.timeout_s."""
    from support.ranks import assert_ok, launch

    assert_ok(launch(tmp_path, "stop", "-", str(tmp_path)))
    rank0, rank1 = torch.load(tmp_path / "stop.pt", weights_only=False)
    assert rank0["entered"] == 1 and rank1["entered"] == 0  # the situation under test
    assert rank0["groups"] == rank1["groups"] == 2  # batch 0: both shares, on both ranks
    for seen in (rank0, rank1):
        assert not seen["alive"] and seen["error"] == "None", seen
        assert seen["took"] < 25.0, seen  # without the abort: the 30 s join, then a hang


@pytest.mark.slow
def test_per_rank_producers_stop_when_a_share_of_the_last_batch_fails(tmp_path):
    """dist_stop_mid_batch.py: both threads entered the last batch; rank 1's share of it
    fails before the exchange rank 0's thread waits in, either on the reward pool that
    shutdown closes while rank 1 still generates, or earlier. The failing thread (or, when
    it failed before shutdown, its main thread) joins the exchange with an abort marker:
    both ranks close at once and exit 0, instead of rank 0 joining its thread for 30 s and
    then aborting (SIGABRT) on the gloo operation still pending at exit."""
    from support.ranks import assert_ok, launch

    assert_ok(launch(tmp_path, "stop_mid_batch", "-", str(tmp_path)))
    rank0, rank1 = torch.load(tmp_path / "stop_mid.pt", weights_only=False)
    for case in ("closed", "failed"):
        assert rank0[case]["entered"] == rank1[case]["entered"] == 1, case  # the situation
        assert "RewardPool is closed" in rank1["closed"]["error"]
        assert "injected reward failure" in rank1["failed"]["error"]
        for seen in (rank0[case], rank1[case]):
            assert not seen["alive"], (case, seen)
            # rank 1 generates for 5 s in "closed"; without the abort: the 30 s join
            assert seen["took"] < 25.0, (case, seen)
        assert rank0[case]["error"] == "None", rank0[case]


def one_full_copy(mode: str) -> int:
    """Bytes of the policy's parameters and buffers as one process builds it (LoRA: with
    its adapters): one full copy of the weights."""
    from leangrpo.model.policy import load_policy

    cfg = config_from_dict(demo_config(Path("/tmp/unused"), mode, 1))
    model = load_policy(cfg, None, torch.device("cpu")).model
    tensors = [*model.parameters(), *model.buffers()]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.slow
def test_no_rank_holds_more_than_one_full_copy_during_set_up(tmp_path):
    """Every rank loaded the full model, deep-copied a full reference (beta > 0) and
    copied it again for its hf engine before sharding: 3 full copies per rank at the peak
    (2 with LoRA). Now the reference starts on the meta device and gets its shards from
    the policy's, and the engine's copy is built from the shards after sharding: after
    every stage of the set-up a rank holds at most one full copy in whole tensors (the
    storages alive, counted), plus the shards of the policy and the reference. A weight
    sync into the engine (sync mode) held every gathered tensor at once (a second full
    copy); the engine now copies each in as it is gathered."""
    import pickle

    from support.ranks import assert_ok, launch

    assert_ok(launch(tmp_path, "setup_memory", "-", str(tmp_path)))
    for rank in range(2):
        seen = pickle.loads((tmp_path / f"setup-{rank}.pt").read_bytes())
        for mode, sharded_models in (("full_sync", 2), ("lora_async", 1)):
            copy = one_full_copy(mode)
            stages = seen[mode]
            sync = stages.pop("sync", None)
            assert set(stages) == {"before", "loaded", "sharded", "engines", "built"}, stages
            base = stages["before"]["whole"]
            for stage, alive in stages.items():
                assert alive["whole"] - base <= 1.01 * copy, (rank, mode, stage, alive, copy)
                assert alive["shards"] <= 1.01 * sharded_models * copy / 2, (rank, mode, stage)
            assert stages["built"]["whole"] - base >= copy  # the engine's copy is counted
            if mode == "full_sync":  # the engine takes each gathered tensor as it comes
                assert 0 < sync["held_at_once"] <= 0.25 * copy, (rank, sync, copy)


# ------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus_with_nccl_and_bf16_mixed_precision_train_and_save(tmp_path):
    """The full path on 2 GPUs: nccl, bf16 compute with fp32 master weights and reduction;
    the run finishes, learns something and its final model loads. (bf16 is not bitwise
    comparable with one fp32 process; the CPU tests prove exactness.)"""
    from transformers import AutoModelForCausalLM

    cfg = demo_config(
        tmp_path / "run",
        "full_sync",
        2,
        run={"device": "cuda", "max_steps": 6},
        distributed={"param_dtype": "bfloat16", "reduce_dtype": "float32"},
    )
    finish(torchrun(cfg), cfg)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert moved(model.state_dict()) > 0


# ---------------------------------------------------------------- units: no processes


def test_torchrun_refuses_what_its_ranks_cannot_agree_on():
    from leangrpo.config import ConfigError
    from leangrpo.preflight import check_world

    def cfg(**sections):
        return config_from_dict(demo_config(Path("/tmp/unused"), "full_sync", 2, **sections))

    colocate = cfg(rollout={"engine": "vllm"})
    check_world(colocate, 1)  # one process: fine
    with pytest.raises(ConfigError, match="rollout.vllm.mode is 'colocate'.*mode: server"):
        check_world(colocate, 2)
    streaming = {"mode": "async", "min_groups_per_step": 2}
    with pytest.raises(ConfigError, match="pipeline.min_groups_per_step"):
        check_world(cfg(pipeline=streaming), 4)
    served = {"engine": "vllm", "vllm": {"mode": "server"}}
    check_world(cfg(pipeline=streaming, rollout=served), 4)  # rank 0 decides: fine


class _Follower:
    """A DistContext of a rank > 0 whose broadcast delivers rank 0's message."""

    distributed, is_main = True, False

    def __init__(self, message):
        self.message = message

    def broadcast_object(self, obj):
        return self.message


def test_ranks_follow_rank_0s_run_directory_without_its_lock(tmp_path, monkeypatch):
    from leangrpo.checkpoint.rundir import RunDir, RunDirError, check_world_size, open_run_dir
    from leangrpo.preflight import open_shared_run_dir

    cfg = config_from_dict(demo_config(tmp_path / "run", "full_sync", 2))
    leader = open_run_dir(cfg)
    follower = open_shared_run_dir(cfg, _Follower(leader.decision()))
    assert follower.decision() == leader.decision()
    follower.release()  # no lock: releasing it leaves rank 0's alone
    with pytest.raises(RunDirError, match="in use"):
        open_run_dir(cfg)
    leader.release()
    with pytest.raises(RunDirError, match="^already holds"):
        open_shared_run_dir(cfg, _Follower({"error": "already holds"}))
    step = tmp_path / "ckpt"
    step.mkdir()
    (step / "trainer_state.json").write_text('{"step": 3, "world_size": 2}')
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_world_size(step)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RunDirError, match="written by 2 process.*has 4.*torchrun on 2"):
        check_world_size(step)
    assert isinstance(RunDir.follower(leader.decision()).resume_from, type(None))


def test_a_batch_gathered_from_shares_has_the_whole_batchs_metrics():
    from leangrpo.contracts import Completion, Prompt, RolloutSample
    from leangrpo.distributed.rollout import merge_share_metrics

    rewards = [1.0, 0.0, None, 0.5, 0.25, 1.0]
    samples = [
        RolloutSample(i // 2, Prompt(i // 2, "", [1]), Completion([2], "", [-1.0], "stop", 0),
                      rewards={"math": r}, reward=r)
        for i, r in enumerate(rewards)
    ]  # fmt: skip
    per_rank = [
        {"reward/math/failures": 1.0, "reward/unscored": 1.0, "time/generate": 2.0,
         "time/rewards": 1.0, "reward/mean": 123.0},
        {"reward/math/failures": 0.0, "reward/unscored": 0.0, "time/generate": 1.0,
         "time/rewards": 0.5},
    ]  # fmt: skip
    merged = merge_share_metrics([(samples[:3], per_rank[0]), (samples[3:], per_rank[1])])
    scored = [r for r in rewards if r is not None]
    mean = sum(scored) / len(scored)
    assert merged["reward/mean"] == pytest.approx(mean)  # over the batch, not a rank's
    std = (sum((r - mean) ** 2 for r in scored) / len(scored)) ** 0.5
    assert merged["reward/std"] == pytest.approx(std)
    assert merged["reward/math/mean"] == pytest.approx(mean)
    assert merged["reward/math/failures"] == 1.0 and merged["reward/unscored"] == 1.0
    assert merged["time/generate"] == 2.0 and merged["dist/wait_generate"] == 1.5


def test_a_batch_gathered_from_shares_keeps_every_figure_of_its_shares():
    """share_metrics_dropped.py: only time/, */failures, */unscored and the reward means
    survived the gather, so under torchrun every multiturn/* figure and the sandbox's
    reward/<limit kind>_failures counts were missing from the step's row. The shares'
    figures merge by their rules: the multi-turn means are the whole batch's."""
    from leangrpo.contracts import Completion, Prompt, RolloutSample, Trajectory
    from leangrpo.distributed.rollout import merge_share_metrics
    from leangrpo.environments.metrics import trajectory_metrics

    def sample(i: int, turns: int) -> RolloutSample:
        segments = [(3, True), (2, False)] * (turns - 1) + [(3, True)]
        trajectory = Trajectory(segments, [0] * turns, [], stats={"tool_calls": float(i % 3)})
        completion = Completion([2], "", [-1.0], "stop", 0, trajectory)
        return RolloutSample(i // 2, Prompt(i // 2, "", [1]), completion, rewards={}, reward=1.0)

    samples = [sample(i, turns) for i, turns in enumerate([1, 3, 2, 2, 1, 4])]
    shares = [samples[:2], samples[2:]]  # unequal: means weigh by trajectories
    parts = [
        (share, {**trajectory_metrics(share), "reward/timeout_failures": float(n)})
        for n, share in enumerate(shares, start=1)
    ]
    merged = merge_share_metrics(parts)
    whole = trajectory_metrics(samples)
    for key, value in whole.items():
        assert merged[key] == pytest.approx(value), key
    assert merged["reward/timeout_failures"] == 3.0


def test_steps_are_dealt_to_ranks_whole_and_padded_to_one_count():
    from support.models import make_tiny_model

    from leangrpo.contracts import Completion, Prompt, RolloutSample
    from leangrpo.distributed.dealing import is_padding
    from leangrpo.model.policy import Policy
    from leangrpo.train.planning import plan_steps

    cfg = config_from_dict(
        demo_config(Path("/tmp/unused"), "full_sync", 2, packing={"shared_prefix": "off"})
    )
    policy = Policy(make_tiny_model(), None, None, torch.device("cpu"), is_lora=False)
    lengths = [[3, 3, 3, 3], [9, 8, 9, 9], [1, 1, 1, 1]]  # completion tokens per sample
    samples = [
        RolloutSample(g, Prompt(g, "", [1, 2]), Completion([5] * n, "", [-1.0] * n, "stop", g))
        for g, group in enumerate(lengths)
        for n in group
    ]
    ranks = [plan_steps(samples, cfg, policy, rank, 2) for rank in range(2)]
    assert [len(steps) for steps in ranks] == [1, 1]  # steps_per_generation = 1
    mbs = [steps[0].micro_batches for steps in ranks]
    assert len(mbs[0]) == len(mbs[1])  # the same forward/backward count on every rank
    real = [[mb for mb in rank if not is_padding(mb)] for rank in mbs]
    assert len(real[0]) != len(real[1])  # ... which needed a padding micro-batch
    tokens = sorted(int(mb.completion_lens.sum()) for rank in real for mb in rank)
    assert sum(tokens) == sum(map(sum, lengths))  # every sample once, over both ranks
    metrics = ranks[0][0].metrics
    assert metrics["dist/padding_micro_batches"] == abs(len(real[0]) - len(real[1]))
    assert ranks[0][0].versions == ranks[1][0].versions == [s.version for s in samples]
