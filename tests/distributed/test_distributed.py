"""Data-parallel training on 2 CPU ranks (gloo) against one process, and failure handling.

The multi-process cases launch tests/dist_worker.py once per rank (RANK, WORLD_SIZE,
MASTER_ADDR/PORT as torchrun would set them), each in its own session, so the test can
check that no process is left behind. Unit tests of dealing and padding run in-process.
The multi-process tests are marked slow: on 2 busy CPU cores the module fixture (train +
resume + the reference) takes ~50 s per mode and each failure case ~23 s.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support import dist_worker as W
from support.ranks import assert_ok, launch

from leangrpo.config.training import LogprobsConfig
from leangrpo.distributed.context import DistContext
from leangrpo.distributed.dealing import deal_groups, equal_micro_batch_plan, group_cost, pad_plan


@pytest.fixture(scope="module", params=["full", "lora"])
def run(request, tmp_path_factory):
    """The 2-rank run, its resume in fresh processes, and the 1-process reference."""
    mode = request.param
    out = tmp_path_factory.mktemp(f"dist-{mode}")
    assert_ok(launch(out, "train", mode, str(out)))
    assert_ok(launch(out, "resume", mode, str(out)))
    return SimpleNamespace(
        mode=mode,
        out=out,
        sharded=torch.load(out / "result.pt", weights_only=False),
        resumed=torch.load(out / "resume.pt", weights_only=False),
        reference=W.reference_run(mode),
    )


@pytest.mark.slow
def test_sharded_logprobs_and_gradients_equal_one_process(run):
    sharded, ref = run.sharded, run.reference
    assert sorted(sharded["logprobs"]) == sorted(ref["logprobs"])
    for uid, lp in ref["logprobs"].items():
        torch.testing.assert_close(sharded["logprobs"][uid], lp, rtol=1e-5, atol=1e-5)
    if run.mode == "full":  # the sharded frozen reference (beta > 0) scores like the copy
        for uid, lp in ref["ref_logprobs"].items():
            torch.testing.assert_close(sharded["ref_logprobs"][uid], lp, rtol=1e-5, atol=1e-5)
        assert sharded["offloaded"] > 0  # hidden-state offload ran inside the sharded layers
    assert sorted(sharded["grads"]) == sorted(ref["grads"])
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(sharded["grads"][name], grad, rtol=1e-5, atol=1e-6)
    assert sharded["padded"] > 0  # some rank ran empty micro-batches to keep step with the other
    assert all(x >= 1.0 for x in sharded["imbalance"])
    assert sharded["reduced"] == {"rank": 0.5, "one": 1.0} and sharded["everyone"] == [0, 1]
    assert "PackedScorer" in sharded["refused"]


@pytest.mark.slow
def test_other_strategies_and_mixed_precision_give_the_same_gradients(run):
    if run.mode != "full":
        pytest.skip("run once, with full fine-tuning")
    ref = run.reference["grads"]
    strategies = run.sharded["strategy_grads"]
    for key in ("shard_grad_op/off/full", "no_shard/off/full"):
        for name, grad in ref.items():
            torch.testing.assert_close(strategies[key][name], grad, rtol=1e-5, atol=1e-6)
    untied = W.reference_step0_grads("untied")
    assert "lm_head.weight" in untied and "lm_head.weight" not in ref
    for name, grad in untied.items():
        got = strategies["full_shard/off/untied"][name]
        torch.testing.assert_close(got, grad, rtol=1e-5, atol=1e-6)
    # bf16 compute, fp32 reduce: against the same arithmetic done in one process (bf16 is
    # 10-20% away from fp32 on this tiny random model, so fp32 is no yardstick here)
    for name, grad in W.reference_mixed_grads().items():
        mixed = strategies["full_shard/bfloat16/full"][name]
        assert mixed.dtype == torch.float32  # the sharded master weights' dtype
        assert (mixed - grad).norm() <= 1e-5 * grad.norm() + 1e-7, name


# Parameters after W.STEPS AdamW steps: AdamW moves an entry whose gradient is ~0 (a key
# bias, which softmax ignores) by up to lr x grad / eps, so rounding-level gradient
# differences (the ranks' micro-batches are padded into other SDPA shapes than the single
# process's) reach ~lr / 300 (measured 3e-5 at lr 1e-2), and the later steps' gradients
# (norms 1e-5 relative apart) start from those weights; step 0's gradients are compared
# at 1e-6 above.
PARAM_TOL = 1e-2 * W.LR


@pytest.mark.slow
def test_sharded_training_ends_with_the_same_parameters(run):
    sharded, ref = run.sharded, run.reference
    # step 0 on the same weights; later steps on weights PARAM_TOL apart (see above)
    assert sharded["grad_norms"][0] == pytest.approx(ref["grad_norms"][0], rel=1e-5)
    assert sharded["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-4)
    full = dict(sharded["sync"]) if run.mode == "full" else None
    tol = PARAM_TOL
    for name, param in ref["params"].items():
        if full is not None:
            assert (full[name] - param).abs().max() <= tol, name
    if run.mode == "lora":
        adapters = dict(sharded["sync"])
        for name in ref["params"]:
            if "lora_" in name:
                assert (adapters[name] - ref["params"][name]).abs().max() <= tol, name


@pytest.mark.slow
def test_weight_sync_gathers_what_the_unsharded_policy_sends(run):
    sharded, ref = run.sharded, run.reference
    want = ref["sync"]
    got = sharded["sync"]
    assert [n for n, _ in got] == [n for n, _ in want]  # names and order
    for (name, g), (_, w) in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert (g - w).abs().max() <= PARAM_TOL, name
    for (name, g16), (_, g) in zip(sharded["sync_bf16"], got):
        assert g16.dtype == torch.bfloat16 and torch.equal(g16, g.to(torch.bfloat16)), name
    if run.mode == "lora":
        assert all("lora_" in n for n, _ in got)


@pytest.mark.slow
def test_checkpoint_resumes_identically_in_fresh_processes(run):
    sharded, resumed = run.sharded, run.resumed
    path = Path(sharded["checkpoint"])
    assert path.name == f"step-{W.STEPS}" and (path / "COMPLETE").is_file()
    assert sorted(p.name for p in path.iterdir() if p.name.startswith("rng-")) == [
        "rng-0.pt",
        "rng-1.pt",
    ]
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]
    assert resumed["state"]["step"] == W.STEPS and resumed["state"]["world_size"] == 2
    saved = dict(sharded["sync"])  # everything (full), the adapter (LoRA)
    restored = dict(resumed["sync"])  # always the whole state dict
    assert saved and set(saved) <= set(restored)
    for name, t in saved.items():
        assert torch.equal(restored[name], t), name
    before, after = sharded["optimizer"], resumed["optimizer"]
    assert sorted(before["state"]) == sorted(after["state"])
    for key, slots in before["state"].items():
        for slot, value in slots.items():
            assert torch.equal(torch.as_tensor(after["state"][key][slot]), torch.as_tensor(value))


@pytest.mark.slow
def test_final_directory_loads_with_from_pretrained(run):
    from transformers import AutoModelForCausalLM

    final = run.out / "run" / "final"
    if run.mode == "full":
        model = AutoModelForCausalLM.from_pretrained(final)
        state = model.state_dict()
        for name, t in run.sharded["sync"]:
            assert torch.equal(state[name], t), name
        return
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(W.DEMO_MODEL)
    model = PeftModel.from_pretrained(base, final)
    params = dict(model.named_parameters())
    for name, t in run.sharded["sync"]:
        assert torch.equal(params[name], t), name


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus_with_nccl_match_one_process(tmp_path):
    """The same run on 2 GPUs (nccl; bf16 mixed precision among the strategies) against the
    fp32 CPU reference; GPU kernels differ from the CPU's, hence the looser tolerance."""
    assert_ok(
        launch(tmp_path, "train", "full", str(tmp_path), env={"LEANGRPO_TEST_DEVICE": "cuda"})
    )
    sharded = torch.load(tmp_path / "result.pt", weights_only=False)
    ref = W.reference_run("full")
    for uid, lp in ref["logprobs"].items():
        torch.testing.assert_close(sharded["logprobs"][uid], lp, rtol=1e-4, atol=1e-4)
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(sharded["grads"][name], grad, rtol=1e-3, atol=1e-5)
    params = dict(sharded["sync"])
    for name, param in ref["params"].items():
        assert (params[name] - param).abs().max() <= 1e-4, name
    offloaded = sharded["strategy_grads"]["full_shard/off/offload"]
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(offloaded[name], grad, rtol=1e-3, atol=1e-5)
    mixed = sharded["strategy_grads"]["full_shard/bfloat16/full"]
    for name, grad in W.reference_mixed_grads().items():
        assert (mixed[name] - grad).norm() <= 1e-2 * grad.norm() + 1e-6, name


@pytest.mark.slow
def test_no_parameter_of_policy_or_reference_stays_gathered_between_passes(tmp_path):
    """dist_ref_root_memory.py: FSDP2 never reshards a root after a no-grad forward, so the
    sharded reference kept its root unit (embeddings, tied lm_head, final norm) gathered
    on every rank for the whole run, and the policy kept it until its first backward
    (under shard_grad_op every unit stayed gathered). After the no-grad passes and after
    every step, every parameter of both is a shard again, under every strategy."""
    assert_ok(launch(tmp_path, "reshard", "-", str(tmp_path)))
    for rank, seen in enumerate(torch.load(tmp_path / "reshard.pt", weights_only=False)):
        assert sorted(seen) == ["full_shard", "no_shard", "shard_grad_op"]
        for sharding, stages in seen.items():
            assert len(stages) >= 3, stages  # the no-grad passes and at least 2 steps
            for stage, held in stages.items():
                assert held == {"policy": [], "reference": []}, (rank, sharding, stage)


@pytest.mark.slow
def test_a_checkpoint_missing_a_ranks_files_is_never_marked_complete(tmp_path):
    """Rank 1 writes its part of a sharded checkpoint where rank 0 cannot see it (an
    output_dir that is not one filesystem for every rank): rank 0 used to write COMPLETE
    after the barrier all the same. Now both ranks stop with the sentence naming rank 1's
    missing files, and no COMPLETE marker exists."""
    import pickle

    ranks = launch(tmp_path, "unshared", "-", str(tmp_path))
    assert [rank.code for rank in ranks] == [1, 1]  # a failure inside ctx.phase is fatal
    rank0, rank1 = (pickle.loads((tmp_path / f"unshared-{r}.pt").read_bytes()) for r in (0, 1))
    assert rank0["markers"] == rank1["markers"] == []
    assert not (tmp_path / "run" / "checkpoints" / "step-1").exists()
    # every rank raises the sentence; the one that records it second in the store then
    # reports the other's instead ("rank R stops during checkpoint: rank P failed ...")
    own = [seen["error"] for seen in (rank0, rank1) if seen["error"].startswith("Checkpoint")]
    assert own, (rank0, rank1)
    sentence = own[0]
    assert sentence.startswith("CheckpointError: checkpoint .tmp-step-1-")
    assert "rng-1.pt, dcp/__1_0.distcp missing in" in sentence and "rng-0.pt" not in sentence
    assert "one filesystem that every rank sees" in sentence
    for rank, seen in enumerate((rank0, rank1)):
        peer = f"rank {rank} stops during checkpoint: rank {1 - rank} failed during checkpoint"
        victim = f"DistributedError: {peer}: CheckpointError: checkpoint .tmp-step-1-"
        assert seen["error"] == sentence or seen["error"].startswith(victim), seen["error"]


def test_missing_rank_files_are_named_from_the_dcp_metadata(tmp_path):
    """Every rank's rng file, and every file DCP's metadata names, at least as long as it
    says: what rank 0 checks before it marks a sharded checkpoint COMPLETE."""
    import torch.distributed.checkpoint as dcp

    from leangrpo.checkpoint.sharded import _missing_rank_files

    tmp = tmp_path / ".tmp-step-3-x"
    dcp.save({"a": torch.arange(6.0), "b": torch.ones(4)}, checkpoint_id=tmp / "dcp")
    for rank in range(2):
        torch.save({}, tmp / f"rng-{rank}.pt")
    assert _missing_rank_files(tmp, 2) is None
    (tmp / "rng-1.pt").unlink()
    shard = tmp / "dcp" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])  # one byte short of what the metadata says
    missing = _missing_rank_files(tmp, 2)
    assert "rng-1.pt, dcp/__0_0.distcp missing in" in missing and "not marked COMPLETE" in missing
    (tmp / "dcp" / ".metadata").unlink()
    assert "dcp/.metadata" in _missing_rank_files(tmp, 2)


# ------------------------------------------------------------------------------ failures


@pytest.mark.slow
@pytest.mark.parametrize("how", ["raise", "kill", "hang"])
def test_a_failing_rank_stops_the_other_with_one_line(tmp_path, how):
    timeout_s = 10.0
    ranks = launch(tmp_path, "fail", how, str(tmp_path), str(timeout_s))
    rank0, rank1 = ranks
    assert rank1.code != 0
    assert rank0.code == 1, rank0.log[-3000:]
    lines = [line for line in rank0.log.splitlines() if line.startswith("leangrpo: error:")]
    assert len(lines) == 1, rank0.log[-3000:]
    assert "rank 1" in lines[0] and "train" in lines[0], lines[0]
    if how == "raise":
        assert "ValueError: injected failure" in lines[0]
        assert "rank 1 failed during train" in rank1.log
    elif how == "kill":
        assert "stopped answering" in lines[0]
    else:  # the collective timed out; rank 1, still asleep, is stopped by its heartbeat thread
        assert "timeout_s=10 s waiting for rank 1 in generate" in lines[0], lines[0]
        assert "leangrpo: error: rank 1 stops during generate" in rank1.log
    assert not list(tmp_path.glob("finished-*"))


# ---------------------------------------------------------------------- unit: no processes


def test_deal_groups_balances_tokens_and_is_deterministic():
    groups = [[10, 12], [3, 4], [30, 2], [8, 8], [5, 5], [20, 1], [7, 9]]  # 22 7 32 16 10 21 16
    deal = deal_groups(groups, 3)
    # heaviest first to the least loaded rank: 32->r0, 22->r1, 21->r2, 16->r2, 16->r1,
    # 10->r0, 7->r2
    assert deal.groups == [[2, 4], [0, 6], [1, 3, 5]]
    assert deal.tokens == [42, 38, 44] and deal.cost == [42.0, 38.0, 44.0]
    assert deal.imbalance == pytest.approx(44 / 38)
    assert deal.metrics() == {"dist/imbalance": deal.imbalance, "dist/max_rank_tokens": 44.0}
    assert deal_groups(groups, 3).groups == deal.groups  # the same on every rank
    assert deal_groups(groups, 1).groups == [list(range(7))]


def test_deal_groups_by_attention_cost_spreads_long_sequences():
    groups = [[30], [10, 10, 10], [15, 15], [15, 15]]  # 30 tokens each; attention 900/300/450/450
    by_tokens = deal_groups(groups, 2, "tokens")
    by_attention = deal_groups(groups, 2, "attention")
    assert by_tokens.imbalance == 1.0
    token_deal_attention = [
        sum(group_cost(groups[g], "attention") for g in r) for r in by_tokens.groups
    ]
    assert max(token_deal_attention) == 1350.0
    assert by_attention.cost == [1200.0, 900.0] and by_attention.groups == [[0, 1], [2, 3]]
    assert group_cost([32], "attention") == 1024.0
    with pytest.raises(ValueError, match="balance"):
        group_cost([1], "flops")


def test_deal_with_fewer_groups_than_ranks_reports_infinite_imbalance():
    deal = deal_groups([[5, 5]], 2)
    assert deal.groups[1] == [] and deal.imbalance == float("inf")


def test_single_process_context_has_no_collectives():
    ctx = DistContext()
    assert ctx.all_reduce([1.0, 2.0]) == [1.0, 2.0] and ctx.all_true(False) is False
    assert ctx.barrier() == 0.0 and ctx.gather_to_main({"a": 1}) == [{"a": 1}]
    assert equal_micro_batch_plan(ctx, [[0], [1, 2]]) == [[0], [1, 2]]
    with ctx.phase("train"):
        pass
    with pytest.raises(ValueError, match="unknown phase"), ctx.phase("idle"):
        pass
    assert pad_plan([[0]], 3) == [[0], [], []]
    with pytest.raises(ValueError):
        pad_plan([[0], [1]], 1)


def test_one_process_never_initialises_a_process_group(monkeypatch):
    import torch.distributed as dist

    from leangrpo.distributed.context import init_distributed
    from leangrpo.distributed.fsdp import _offload_policy, shard_model

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    ctx = init_distributed(W.dist_cfg(timeout_s=5.0), "cpu")
    assert not ctx.distributed and ctx.is_main and not dist.is_initialized()
    with pytest.raises(ValueError, match="single process"):
        shard_model(torch.nn.Linear(2, 2), W.dist_cfg(), ctx)
    with pytest.raises(ValueError, match="distributed.cpu_offload"):
        _offload_policy(W.dist_cfg(cpu_offload=True), ctx)
    ctx.shutdown()  # nothing to leave


def test_padding_micro_batch_changes_no_gradient():
    """Forward + zero-gradient backward through every module: gradients stay bit-identical."""
    from support.models import make_tiny_model

    from leangrpo.contracts import SamplingParams
    from leangrpo.distributed.dealing import is_padding, padding_batch, padding_pass
    from leangrpo.model.scoring import PackedScorer, install_chunked_head
    from leangrpo.ops.attention.adapter import enable_packed_attention

    model = make_tiny_model("qwen2").train()
    enable_packed_attention(model, "sdpa_segments")
    install_chunked_head(model)
    scorer = PackedScorer(model)
    logprobs = LogprobsConfig(chunked=True, row_tile=None, vocab_tile=None)
    samples, uids = W.flatten(W.batches()[0], [0, 1])
    real = W.micro_batches(samples, uids)[0]
    lp, ent = scorer(real, SamplingParams(), logprobs, with_entropy=True)
    (lp.sum() + ent.sum()).backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    pad = padding_batch(3)
    assert is_padding(pad) and not is_padding(real)
    seen = []
    model.model.layers[-1].register_forward_hook(lambda *a: seen.append(1))
    padding_pass(scorer, pad, SamplingParams(top_k=2), logprobs, backward=True, with_entropy=True)
    assert seen  # it did run the layers (and so would gather each FSDP unit)
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, before[name]), name


def test_a_ranks_own_error_is_its_own_whatever_words_it_holds():
    """dist_own_error_misread.py: an error of this rank whose text says "timeout" (a
    PipelineStallError names pipeline.stall_timeout_s) was taken for a failed collective,
    so the rank blamed a healthy peer ("a collective failed and no rank reported why")
    and exited 1 instead of printing its own sentence (exit 2). Classified by type now."""
    import threading

    import torch.distributed as dist

    from leangrpo.distributed.watch import _Watch, looks_like_comm_error
    from leangrpo.pipeline.producers import PipelineStallError

    stall = PipelineStallError("waited 600 s ... (pipeline.stall_timeout_s = 600)")
    own = [stall, RuntimeError("socket timeout: gloo connection reset"), TimeoutError("http")]
    assert [looks_like_comm_error(exc) for exc in own] == [False, False, False]

    store = dist.HashStore()
    watch = _Watch(rank=0, world_size=2, timeout_s=4.0, store=store)
    stop = threading.Event()

    def peer_beats():  # rank 1: alive, waiting in the next broadcast
        n = 0
        while not stop.is_set():
            n += 1
            store.set(f"{watch.prefix}beat/1", f"{n} generate")
            time.sleep(0.05)

    threading.Thread(target=peer_beats, daemon=True).start()
    try:
        time.sleep(0.2)
        victim_error = watch.failure("generate", stall)
    finally:  # failure() is fatal: stop the backstop before its grace period ends
        stop.set()
        watch._stop.set()
    assert victim_error is None  # this rank is the origin: its own error is re-raised (exit 2)
    record = json.loads(store.get(f"{watch.prefix}failures").decode())
    assert record["origin"] and record["error"].startswith("PipelineStallError")


def test_a_failed_collective_is_told_by_its_type_and_origin():
    """A peer's failure: torch.distributed's error types, PeerStopped (ProductionAborted),
    a RuntimeError raised inside a torch.distributed communication call (what gloo raises),
    or an error explicitly caused by one of those."""
    import torch.distributed as dist

    from leangrpo.distributed.watch import PeerStopped, looks_like_comm_error
    from leangrpo.pipeline.producers import ProductionAborted

    try:
        raise RuntimeError("rollout producer failed") from ProductionAborted("peer stopped")
    except RuntimeError as exc:
        caused_by_a_peer = exc
    gloo_timeout = _gloo_timeout()
    assert type(gloo_timeout) is RuntimeError and "Timed out" in str(gloo_timeout)
    peers = [dist.DistNetworkError("x"), PeerStopped("x"), caused_by_a_peer, gloo_timeout]
    assert [looks_like_comm_error(exc) for exc in peers] == [True] * 4


def _gloo_timeout() -> RuntimeError:
    """What gloo raises when a peer never joins: a 2-member group in this process (one
    thread per member to connect), then an all-reduce that only member 0 enters."""
    import threading

    import torch.distributed as dist

    store, groups = dist.HashStore(), {}

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=0.5))

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        dist.all_reduce(torch.zeros(1), group=groups[0])
    except RuntimeError as exc:
        return exc
    raise AssertionError("the all-reduce without its peer did not fail")
