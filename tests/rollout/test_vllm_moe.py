"""vLLM and mixtures of experts.

Unmarked (no vLLM): route records on the wire between `leangrpo serve` and the trainer
(and hostile ones refused), servers that do not return routed experts refused for routing
replay in one sentence, vLLM's routed-experts output turned into records.

Marked `vllm` (real vLLM, CPU build, .venv-vllm): vLLM 0.32's CPU build runs Qwen3-MoE
(its samples' log-probs are the model's) but cannot reload its weights in place (refused
in one sentence, the engine kept alive), and routing replay with it is refused at
start-up in one sentence (colocated, and `leangrpo serve --routed-experts`), before the
model loads: its routed-experts output needs Model Runner V2, which needs Triton on a GPU.
"""

from __future__ import annotations

import base64
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support.vllm_fakes import FakeLocal, Served

from leangrpo.contracts import Prompt, RolloutSample, SamplingParams, TurnRequest
from leangrpo.model.moe.routers import RoutingError
from leangrpo.model.moe.routes import routes_from_wire, routes_to_wire
from leangrpo.rollout.vllm.engine import VLLMEngine
from leangrpo.rollout.vllm.local import completion_from_output

PARAMS = SamplingParams(max_new_tokens=4, seed=0)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16])
def test_route_records_cross_the_wire(dtype):
    record = torch.randint(0, 200, (5, 3, 2)).to(dtype)
    back = routes_from_wire(routes_to_wire(record))
    assert back.dtype == dtype and torch.equal(back, record)


@pytest.mark.parametrize(
    "wire",
    [
        {"shape": [2, 2, 2], "dtype": "uint8", "data": base64.b64encode(b"\x00" * 7).decode()},
        {"shape": [2, 2, 2], "dtype": "float32", "data": base64.b64encode(b"\x00" * 32).decode()},
        {"shape": [4, 2], "dtype": "uint8", "data": base64.b64encode(b"\x00" * 8).decode()},
        {"shape": [2, 2, 2], "dtype": "uint8", "data": "not base64!"},
        {"shape": [2**40, 1, 1], "dtype": "uint8", "data": ""},
        {"shape": [1, 1, 1], "dtype": "uint8", "data": "AA==", "extra": 1},
        [1, 2, 3],
    ],
)
def test_hostile_records_on_the_wire_are_refused(wire):
    with pytest.raises((RoutingError, ValueError)):
        routes_from_wire(wire)


def test_servers_send_route_records_with_completions(tmp_path):
    """Single-turn groups and turns: each completion's record arrives as the server made
    it; one that does not fit the model is refused before it is packed."""
    local = FakeLocal()
    local.routes = True
    served = Served(local, tmp_path / "staging")
    try:
        engine = VLLMEngine.server([served.url], routed_experts=True)
        engine.update_weights({"w": torch.zeros(2)}.items(), 0)  # this run's weights: version 0
        prompt = Prompt(0, "", [3, 4, 5])
        groups = engine.generate([prompt], PARAMS, 2, 0)
        for c in groups[0]:
            t = torch.arange(len(c.ids))
            assert torch.equal(c.routes[:, 0].long(), torch.stack([t % 4, (t + 1) % 4], -1))
            assert c.routes.shape == (len(c.ids), 2, 2)
        turn = engine.generate_turns([TurnRequest([3, 4], 7, 4, key=0)], PARAMS, 0)[0]
        assert turn.routes.shape == (len(turn.ids), 2, 2)
        local.route_records = lambda c: torch.full((len(c.ids), 2, 2), 9, dtype=torch.uint8)
        bad = engine.generate([prompt], PARAMS, 2, 0)[0]
        from support.moe import moe_config, moe_policy

        from leangrpo.train.planning import plan_steps

        samples = [
            RolloutSample(0, prompt, c, reward=float(i), advantage=1.0) for i, c in enumerate(bad)
        ]
        with pytest.raises(RoutingError, match="names expert 9, outside"):
            plan_steps(samples, moe_config(), moe_policy())
        engine.close()
    finally:
        served.close()


def test_servers_without_routed_experts_are_refused_for_replay(tmp_path):
    served = Served(FakeLocal(), tmp_path / "staging")
    try:
        with pytest.raises(RoutingError, match=rf"{served.url} does not return.*--routed-experts"):
            VLLMEngine.server([served.url], routed_experts=True)
        VLLMEngine.server([served.url]).close()  # without replay: served as before
    finally:
        served.close()


def test_vllms_routed_experts_become_records():
    """vLLM returns (rows, layers, k) from `routed_experts_prompt_start` (the prompt's last
    position): one row per generated token, or the completion is refused."""

    def output(rows: int, tokens: int = 3, routed=True):
        logprobs = [{t: SimpleNamespace(logprob=-1.0)} for t in range(tokens)]
        experts = np.arange(rows * 4).reshape(rows, 2, 2).astype(np.uint16) % 5 if routed else None
        return SimpleNamespace(token_ids=list(range(tokens)), logprobs=logprobs, text="",
                               finish_reason="stop", routed_experts=experts)  # fmt: skip

    c = completion_from_output(output(3), 0, routes=True)
    assert c.routes.dtype == torch.uint8 and c.routes.shape == (3, 2, 2)
    assert completion_from_output(output(3), 0).routes is None
    with pytest.raises(RoutingError, match=r"shape \(4, 2, 2\) for a completion of 3 tokens"):
        completion_from_output(output(4), 0, routes=True)
    with pytest.raises(RoutingError, match="returned no routed experts"):
        completion_from_output(output(3, routed=False), 0, routes=True)


# -- real vLLM (CPU) -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_char_model(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE (head_dim 64, which vLLM's CPU attention takes) with the vLLM
    tests' character tokenizer."""
    from support.vllm_models import build_char_model

    path = tmp_path_factory.mktemp("moe") / "model"
    build_char_model(path, arch="qwen3_moe")
    return path


@pytest.mark.vllm
def test_routing_replay_on_vllms_cpu_build_is_refused_at_start_up(moe_char_model, tmp_path):
    start = time.monotonic()
    with pytest.raises(RoutingError, match="returns only from its Model Runner V2"):
        VLLMEngine.colocated(moe_char_model, routed_experts=True, work_dir=tmp_path)
    assert time.monotonic() - start < 60  # before any engine starts


@pytest.mark.vllm
def test_vllms_cpu_build_runs_a_mixture_of_experts_but_cannot_reload_it(moe_char_model, tmp_path):
    """Generation on Qwen3-MoE with colocated vLLM (CPU): its behaviour log-probs are the
    model's own (teacher-forced in transformers). A full weight sync is refused in one
    sentence before vLLM tries: its in-place reload fails on the CPU fused-MoE layers and
    the engine dies (seen: "The size of tensor a (64) must match ... (32)", then every
    forward fails); the engine still generates afterwards."""
    from support.vllm_models import mean_abs_logprob_gap
    from transformers import AutoModelForCausalLM

    from leangrpo.errors import RunError

    engine = VLLMEngine.colocated(
        moe_char_model, dtype="float32", enforce_eager=True, work_dir=tmp_path,
        engine_kwargs={"max_model_len": 64},
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(moe_char_model, dtype=torch.float32)
    try:
        prompts = [Prompt(i, "", [3 + i, 4, 5, 6]) for i in range(2)]
        groups = engine.generate(prompts, SamplingParams(max_new_tokens=4, seed=3), 2, 0)
        with pytest.raises(RunError, match="cannot load new weights into a mixture of experts"):
            engine.update_weights(model.state_dict().items(), 1)
        again = engine.generate(prompts[:1], SamplingParams(max_new_tokens=2, seed=3), 1, 0)
    finally:
        engine.close()
    assert all(len(c.ids) >= 1 and c.routes is None for g in groups for c in g) and again[0]
    assert mean_abs_logprob_gap(model, prompts, groups, SamplingParams()) < 1e-3


@pytest.mark.vllm
def test_leangrpo_serve_refuses_routed_experts_on_vllms_cpu_build_in_one_line(moe_char_model):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "leangrpo.rollout.vllm.server", str(moe_char_model),
         "--port", "0", "--routed-experts"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert "returns only from its Model Runner V2" in last and "Traceback" not in out.stderr


def test_a_full_fine_tuning_run_is_refused_an_engine_that_cannot_reload_weights():
    """make_vllm_engine (the trainer's): a colocated engine whose weights cannot be
    reloaded (vLLM's CPU build on a mixture of experts) is closed and refused at start-up
    for full fine-tuning; a LoRA run (adapters only) keeps it."""
    from support.configs import minimal_run

    from leangrpo.config import config_from_dict
    from leangrpo.errors import RunError
    from leangrpo.rollout.vllm.engine import make_vllm_engine

    closed = []

    class Refusing:
        backend = SimpleNamespace(reload_refused="vLLM cannot load new weights here")

        @classmethod
        def colocated(cls, *args, **kwargs):
            return cls()

        def close(self):
            closed.append(True)

    cfg = config_from_dict(minimal_run(rollout={"engine": "vllm"}))
    with pytest.raises(RunError, match="cannot load new weights here"):
        make_vllm_engine(cfg, None, Refusing)
    assert closed == [True]
    lora = config_from_dict(minimal_run(rollout={"engine": "vllm"}, lora={"enabled": True}))
    assert isinstance(make_vllm_engine(lora, None, Refusing), Refusing)
