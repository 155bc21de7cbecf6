"""Context parallelism on real ranks (gloo, FSDP2) against one process.

Each launch runs many cases (tests/support/cp_worker.py: a torchrun start-up costs seconds
on 2 cores):
- C = 2 (2 processes): every loss type, full fine-tuning (checkpointing, hidden-state
  offload, the sharded frozen reference for beta > 0), LoRA (adapters-off reference) and
  QLoRA (an nf4 base; skipped without bitsandbytes, except in CI, which installs it),
  plain, shared-prefix and multi-turn rows; then rank 1 is killed
  inside an attention
  all-to-all and rank 0 stops with one line naming it;
- dp 2 x cp 2 (4 processes): groups dealt to two shares (padding micro-batches on the
  lighter one) against one process; a sharded checkpoint taken inside a batch on the 2-D
  mesh resumes bitwise.
The single-process paths (every boundary case, C = 4) are tests/ops/test_context_parallel.py.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from support.cp_worker import CASES
from support.ranks import launch

WORKER = Path(__file__).resolve().parents[1] / "support" / "cp_worker.py"
HAS_BITSANDBYTES = importlib.util.find_spec("bitsandbytes") is not None
QUANTIZED = {name for name, setup, *_ in CASES if setup == "qlora"}  # need bitsandbytes


def close(got, want, rtol=1e-4):
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-6 + rtol * scale)


def assert_case_equal(name: str, got: dict, want: dict) -> None:
    assert sorted(got["passes"]) == sorted(want["passes"]), name
    for key, values in want["passes"].items():
        close(got["passes"][key], values, rtol=1e-5)
    assert sorted(got["grads"]) == sorted(want["grads"]) and want["grads"], name
    for param, grad in want["grads"].items():
        close(got["grads"][param], grad)
    for metric, value in want["metrics"].items():
        if metric.startswith("offload/"):  # per process: rank 0's share of the row
            continue
        assert got["metrics"][metric] == pytest.approx(value, rel=1e-4, abs=1e-6), (name, metric)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One launch at C = 2: every case (the QLoRA ones where bitsandbytes is installed),
    then rank 1 killed; the output directory, the ranks and the cases run."""
    out = tmp_path_factory.mktemp("cp2")
    names = [name for name, *_ in CASES if HAS_BITSANDBYTES or name not in QUANTIZED]
    ranks = launch(out, f"exact:{','.join(names)}+kill", str(out), "2", world_size=2,
                   worker=WORKER)  # fmt: skip
    return out, ranks, names


@pytest.mark.slow
def test_two_context_ranks_equal_one_process_and_a_killed_rank_stops_the_other(two_ranks):
    tmp_path, ranks, names = two_ranks
    rank0, rank1 = ranks
    assert rank1.code == -9, rank1.log[-3000:]  # it killed itself inside the all-to-all
    results = torch.load(tmp_path / "exact.pt", weights_only=False)
    assert sorted(results) == sorted(names)
    for name, result in results.items():
        if name not in QUANTIZED:  # the next test's
            assert_case_equal(name, result["sharded"], result["one"])
    assert results["full/plain/grpo-kl-is"]["one"]["passes"]  # old and reference passes ran
    assert results["full/plain/grpo-kl-is"]["sharded"]["metrics"]["offload/tensors"] > 0
    # the survivor: exit 1 within the timeout, one line naming rank 1 and the phase
    assert rank0.code == 1, rank0.log[-3000:]
    lines = [line for line in rank0.log.splitlines() if line.startswith("leangrpo: error:")]
    assert len(lines) == 1 and "rank 1" in lines[0] and "train" in lines[0], lines
    assert "stopped answering" in lines[0]
    assert "replicated 2x" in rank0.log  # the demo model's one key/value head, logged
    assert not list(tmp_path.glob("finished-*"))


@pytest.mark.slow
def test_two_context_ranks_equal_one_process_on_a_quantized_base(request):
    if not HAS_BITSANDBYTES:  # CI installs the qlora extra: there this case must run
        if os.environ.get("CI"):
            pytest.fail(
                "CI must test QLoRA under context parallelism, but bitsandbytes is not installed"
            )
        pytest.skip("QLoRA needs bitsandbytes: pip install 'leangrpo[qlora]'")
    tmp_path, _, names = request.getfixturevalue("two_ranks")  # the launch above
    results = torch.load(tmp_path / "exact.pt", weights_only=False)
    assert QUANTIZED and set(names) >= QUANTIZED
    for name in QUANTIZED:
        assert_case_equal(name, results[name]["sharded"], results[name]["one"])


@pytest.mark.exact
@pytest.mark.slow
def test_data_by_context_parallel_mesh_equals_one_process_and_resumes_exactly(tmp_path):
    few = "full/plain/grpo-kl-is,lora/prefix-multiturn/cispo"
    ranks = launch(tmp_path, f"exact:{few}+resume", str(tmp_path), "2", world_size=4,
                   worker=WORKER)  # fmt: skip
    for r, rank in enumerate(ranks):
        assert rank.code == 0, f"rank {r}:\n{rank.log[-3000:]}"
    results = torch.load(tmp_path / "exact.pt", weights_only=False)
    assert sorted(results) == sorted(few.split(","))
    for name, result in results.items():
        assert_case_equal(name, result["sharded"], result["one"])
    # two shares of unequal work: the lighter one ran a padding micro-batch
    assert results["full/plain/grpo-kl-is"]["sharded"]["padding"] > 0
    resumed = torch.load(tmp_path / "resume.pt", weights_only=False)
    straight, again = resumed["straight"], resumed["resumed"]
    assert sorted(straight) == sorted(again)
    for name, param in straight.items():
        assert torch.equal(again[name], param), name
    start = resumed["start"]
    assert max(float((straight[k] - start[k]).abs().max()) for k in start) > 1e-3  # it trained
