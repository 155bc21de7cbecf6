"""A distillation teacher under torchrun (2 CPU ranks, gloo, one launch for both
objectives): sharded like the reference by `shard_policy`; `sampled`: scored through its
FSDP root in the no-grad passes, resharded after them, each sample's teacher log-probs
equal to one process's; `jsd`: its forward in the step through its FSDP root (the head
copied while gathered), the step's loss, divergence and gradients equal to one process's
on all the samples, the teacher resharded after the step."""

from __future__ import annotations

import pytest
import torch
from support.configs import ROOT
from support.distill_worker import distill_run
from support.models import save_demo_teacher
from support.ranks import assert_ok, launch

from leangrpo.config import config_from_dict
from leangrpo.distill.teacher import load_teacher, teacher_logprobs
from leangrpo.train.packing import pack_samples

WORKER = ROOT / "tests" / "support" / "distill_worker.py"


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One 2-rank launch running both scenarios; (output directory, teacher directory)."""
    out = tmp_path_factory.mktemp("distill2")
    teacher = save_demo_teacher(out / "teacher")
    assert_ok(launch(out, "teacher+jsd", str(teacher), str(out), worker=WORKER))
    return out, teacher


@pytest.mark.slow
def test_a_sharded_teacher_scores_like_one_process(launched):
    from support.dist_worker import batches

    tmp_path, teacher = launched
    ranks = torch.load(tmp_path / "teacher.pt", weights_only=False)

    cfg = config_from_dict(distill_run(str(teacher), tmp_path))
    model = load_teacher(cfg, torch.device("cpu"))
    samples = [s for g in batches()[0] for s in g]
    sampling = cfg.rollout.sampling_params()
    scored = {}
    for seen in ranks:
        assert seen["whole"] == []  # every teacher parameter is a shard again after the passes
        assert seen["loss"] == ranks[0]["loss"] and seen["reverse_kl"] > 0
        scored.update(seen["logprobs"])
    by_ids = {tuple(s.completion.ids): s for s in samples}
    assert len(by_ids) == len(samples) and sorted(scored) == sorted(by_ids)  # each once
    for ids, values in scored.items():
        mb = pack_samples([by_ids[ids]])
        want = teacher_logprobs(model, mb, sampling, cfg.logprobs)
        torch.testing.assert_close(values, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_no_rank_holds_more_than_its_shards_and_one_unit_of_the_teacher_while_it_loads(tmp_path):
    """The trainer's torchrun set-up (load_teacher staged, then shard_policy) on 2 ranks:
    at any moment a rank holds, in memory of its own, at most its shards of the teacher
    and one FSDP unit (the plan's 1/W and a gathered unit), never the whole teacher: it
    is read from its memory-mapped files and sharded onto the device unit by unit."""
    teacher = save_demo_teacher(tmp_path / "teacher")
    assert_ok(launch(tmp_path, "load", str(teacher), str(tmp_path), "staged", worker=WORKER))
    for seen in torch.load(tmp_path / "load.pt", weights_only=False):
        assert seen["shards"] < 0.6 * seen["whole"]  # 1/2 of it, and padding
        assert seen["peak"] <= seen["shards"] + seen["unit"] < seen["whole"], seen


@pytest.mark.slow
def test_the_teacher_is_gathered_a_unit_at_a_time_under_shard_grad_op_as_planned(tmp_path):
    """shard_grad_op keeps the policy's gathered layers for its backward; the frozen
    teacher has none, so its units are resharded after their forward all the same: during
    its passes a rank holds at most what `leangrpo plan` counts as gathered (root with the
    tied embeddings + two layers), well under the whole teacher (three layers)."""
    import json

    from leangrpo.planner.plan import dims_from_json, model_bytes, teacher_gathered

    teacher = save_demo_teacher(tmp_path / "teacher")
    assert_ok(launch(tmp_path, "gathered", str(teacher), str(tmp_path), "shard_grad_op",
                     worker=WORKER))  # fmt: skip
    ranks = torch.load(tmp_path / "gathered.pt", weights_only=False)
    cfg = config_from_dict(distill_run(str(teacher), tmp_path))
    dims = dims_from_json(json.loads((teacher / "config.json").read_text()))
    planned = teacher_gathered(cfg, dims, model_bytes(cfg, "cpu"))
    whole = dims.params * 4
    assert dims.layers == 3 and planned < whole
    for seen in ranks:
        assert 0 < seen["peak"] <= planned, (seen, planned, whole)
        assert seen["after"] == 0  # released after the passes


@pytest.mark.slow
def test_jsd_on_two_ranks_equals_one_process(launched):
    tmp_path, _ = launched
    result = torch.load(tmp_path / "jsd.pt", weights_only=False)
    got, want = result["ranks"], result["one"]
    assert got["whole"] == [[], []]  # the teacher is all shards again after the step
    assert got["padding"] >= 1  # a rank dealt fewer groups ran the teacher on padding too
    assert want["metrics"]["loss/distill/jsd"] > 0
    for name in ("loss", "loss/distill/jsd", "loss/entropy", "grad_norm"):
        assert got["metrics"][name] == pytest.approx(want["metrics"][name], rel=1e-4), name
    assert sorted(got["grads"]) == sorted(want["grads"]) and want["grads"]
    for name, grad in want["grads"].items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6 + 1e-4 * scale)
