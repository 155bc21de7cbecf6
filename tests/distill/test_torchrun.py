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
