"""`leangrpo plan`: config.json read without torch, each switch moves its own term, the
peak rule, and the copies of the trainer's constants kept equal.
(tests/planner/test_plan_measured.py checks the figures against what autograd really does.)"""

from __future__ import annotations

import json
import re

import pytest
import yaml
from support.configs import minimal_run, updated
from support.processes import run_cli, run_python

from leangrpo.config import config_from_dict
from leangrpo.planner.plan import (
    TERMS,
    TRAINING_PASS,
    Dims,
    PlanError,
    dims_from_json,
    plan_memory,
)

LLAMA_8B = Dims(
    vocab=128256,
    hidden=4096,
    intermediate=14336,
    layers=32,
    heads=32,
    kv_heads=8,
    head_dim=128,
    tied=False,
)
QWEN3_8B = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": False,
}
QWEN25_15B = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}


def config(**sections):
    cfg = minimal_run(
        model={"dtype": "bfloat16"},
        rollout={"max_new_tokens": 2048, "num_generations": 8},
        train={"micro_batch_tokens": 20480},
        run={"device": "cuda"},
    )
    return config_from_dict(updated(cfg, sections))


def plan(world_size: int = 1, **sections):
    return plan_memory(config(**sections), dims=LLAMA_8B, world_size=world_size)


def test_parameter_counts_of_published_models():
    assert abs(LLAMA_8B.params - 8.03e9) / 8.03e9 < 0.01
    assert abs(dims_from_json(QWEN25_15B).params - 1.544e9) / 1.544e9 < 0.001  # q/k/v biases
    qwen3 = dims_from_json(QWEN3_8B)
    assert qwen3.qk_norm and abs(qwen3.params - 8.19e9) / 8.19e9 < 0.01
    multimodal = {"model_type": "llava", "text_config": {**QWEN25_15B}}
    assert dims_from_json(multimodal) == dims_from_json(QWEN25_15B)


def test_an_unknown_model_type_or_a_partial_config_is_one_clear_error():
    with pytest.raises(PlanError, match="model_type 'gpt2' is not one leangrpo plan can count"):
        dims_from_json({"model_type": "gpt2", "n_embd": 768})
    partial = {k: v for k, v in QWEN25_15B.items() if k != "intermediate_size"}
    with pytest.raises(PlanError, match="intermediate_size missing"):
        dims_from_json(partial)


def test_each_switch_lowers_its_own_term():
    full = plan(logprobs={"chunked": False})
    frozen_head = {"enabled": True, "r": 16}  # a trained head adds its (V, H) gradient to both
    full_logits = plan(logprobs={"chunked": False}, lora=frozen_head)
    assert plan(lora=frozen_head)["lm_head"] < full_logits["lm_head"] / 50
    lora = plan(lora={"enabled": True, "r": 16})
    assert lora["adamw_state"] < full["adamw_state"] / 50  # fp32 adapters on a bf16 base
    model = {"dtype": "bfloat16", "gradient_checkpointing": True}
    ckpt = plan(model=model, lora=frozen_head)
    offloaded = plan(model=model, lora=frozen_head, offload={"activations": "hidden_states"})
    assert offloaded["activations"] < ckpt["activations"] < lora["activations"]
    # full fine-tuning peaks at the bottom layer's backward, every gradient made, one
    # layer input left: offloading the inputs cannot lower that
    ckpt_full = plan(model=model)
    assert (
        plan(model=model, offload={"activations": "hidden_states"})["total"] == ckpt_full["total"]
    )
    assert offloaded["offloaded_to_host"] > 0 == ckpt["offloaded_to_host"]
    assert plan(loss={"beta": 0.1})["reference_copy"] == full["weights"]
    assert plan(loss={"beta": 0.1}, lora={"enabled": True})["reference_copy"] == 0


def test_persistent_terms_are_exact():
    full = plan()
    b = 2
    assert full["weights"] == LLAMA_8B.params * b + LLAMA_8B.buffer_bytes
    assert full["gradients"] == LLAMA_8B.params * b
    assert full["adamw_state"] == 2 * LLAMA_8B.params * b  # step counters live on the host
    lora = plan(lora={"enabled": True, "r": 16})  # fp32 adapters on a bf16 base
    adapters = 32 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))
    assert lora["gradients"] == 4 * adapters and lora["adamw_state"] == 8 * adapters
    only_q = plan(lora={"enabled": True, "r": 16, "target_modules": ["q_proj"]})
    assert only_q["gradients"] == 4 * 32 * 16 * (4096 + 4096)


def test_peak_is_the_larger_phase_or_both_when_generation_overlaps():
    sync = plan(loss={"beta": 0.1})
    persistent = sum(
        sync[k] for k in ("weights", "reference_copy", "generation_copy", "adamw_state")
    )
    train = sync[TRAINING_PASS]
    assert train <= sync["gradients"] + sync["activations"] + sync["lm_head"]
    assert sync["total"] == persistent + max(train, sync["kv_cache"])
    overlapped = plan(pipeline={"mode": "async"})
    assert overlapped["generation_copy"] == overlapped["weights"]
    assert overlapped["total"] > plan()["total"] + overlapped["kv_cache"] - 1
    assert plan(rollout={"engine": "vllm"})["kv_cache"] == 0  # vLLM sizes its own


def test_fsdp_shards_what_each_rank_holds():
    one, two = plan(), plan(world_size=2)
    assert two["gradients"] == one["gradients"] // 2
    assert two["weights"] < 0.6 * one["weights"]  # its shard plus two gathered layers
    kept = plan(world_size=2, distributed={"sharding": "no_shard"})
    assert kept["weights"] == one["weights"] and kept["gradients"] == one["gradients"]


def test_kv_cache_follows_the_longest_decode_call():
    base = dict(rollout={"prompts_per_batch": 4}, data={"max_prompt_tokens": 1000})
    train = plan(**base)["kv_cache"]
    per_row_token = 2 * 32 * 8 * 128 * 2
    assert train == (2 * 32 * 32 * 3047 * 8 * 128 * 2) + 32 * 3047 * 8 * 128 * 2
    assert per_row_token * 32 * 3047 < train
    greedy_eval = plan(eval={"every_steps": 5, "num_prompts": 64, "temperature": 0.0}, **base)
    assert greedy_eval["kv_cache"] == 2 * train  # 64 rows (one per prompt) against 32


def test_constants_copied_from_torch_modules_stay_equal():
    from leangrpo.ops.attention import adapter as attention
    from leangrpo.ops.logprobs import api as logprobs
    from leangrpo.ops.logprobs import divergence
    from leangrpo.planner import plan as planner

    assert planner.DEFAULT_TILES == logprobs.DEFAULT_TILES == divergence.DEFAULT_TILES
    assert planner.AUTO_MIN_PROMPT_FRACTION == attention.AUTO_MIN_PROMPT_FRACTION
    for setting in ("auto", "on", "off"):
        for prompt in (4, 64, 400):
            cfg = config(packing={"shared_prefix": setting}, rollout={"max_new_tokens": 100})
            stats = {"prompt_fraction": prompt / (prompt + 100), "group_size": 8}
            expected = attention.choose_shared_prefix(setting, "sdpa_segments", stats)
            assert planner.shared_prefix(cfg, prompt, "segments") == expected


def test_cli_plans_without_importing_torch(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN25_15B))
    cfg = minimal_run(model={"name_or_path": str(model)}, run={"device": "cpu"})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    probe = (
        "import sys; from leangrpo.cli import main; code = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(code)"
    )
    out = run_python(probe, "plan", str(path), "--tokens", "2048", "--world-size", "1")
    assert out.returncode == 0, out.stderr
    assert "one micro-batch of 2048 tokens" in out.stdout
    assert all(f"  {term} " in out.stdout for term in (*TERMS, "total"))
    (model / "config.json").write_text(json.dumps({**QWEN25_15B, "model_type": "mamba"}))
    out = run_cli("plan", str(path))
    assert out.returncode == 2 and "model_type 'mamba'" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_multi_turn_kv_is_every_trajectorys_cache_or_the_budget():
    env = {"tools": ["t.py:f"], "max_total_tokens": 3000}
    base = dict(environment=env, data={"chat_template": True}, rollout={"prompts_per_batch": 4})
    per_position = 2 * 32 * 8 * 128 * 2  # K and V, every layer, bf16
    unbounded = plan(**base)["kv_cache"]
    assert unbounded == 32 * 3008 * per_position  # 32 trajectories, width in steps of 64
    assert plan(world_size=2, **base)["kv_cache"] == unbounded // 2
    bounded = plan(**updated(base, {"rollout": {"kv_cache_tokens": 10_000}}))["kv_cache"]
    assert bounded == 10_000 * per_position


def test_the_slot_width_step_is_the_engines():
    from leangrpo.planner import plan as planner
    from leangrpo.rollout.hf import turns

    assert planner.SLOT_WIDTH_STEP == turns.WIDTH_STEP


def small_context_model(tmp_path, positions: int = 64):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(
        json.dumps({**QWEN25_15B, "max_position_embeddings": positions})
    )
    return model


def test_prompts_are_planned_within_the_models_positions(tmp_path):
    """A 64-position model: the default 512-token prompt is cut to the room left (and
    says so); a prompt length given that cannot fit is refused, naming the room."""
    from leangrpo.planner.plan import planned_prompt_tokens

    model = small_context_model(tmp_path)
    cfg = config_from_dict(
        minimal_run(model={"name_or_path": str(model)}, rollout={"max_new_tokens": 6})
    )
    tokens, why = planned_prompt_tokens(cfg)
    assert tokens == 58 and "64 positions" in why
    with pytest.raises(PlanError, match="at most 58 tokens"):
        planned_prompt_tokens(cfg, 512)
    too_long = updated(minimal_run(model={"name_or_path": str(model)}), {})
    too_long["data"]["max_prompt_tokens"] = 100
    with pytest.raises(PlanError, match="data.max_prompt_tokens = 100 does not fit"):
        planned_prompt_tokens(config_from_dict(too_long))
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(minimal_run(model={"name_or_path": str(model)})))
    out = run_cli("plan", str(path), "--prompt-tokens", "512")
    assert out.returncode == 2 and "does not fit" in out.stderr and "Traceback" not in out.stderr


def plan_lines(stdout: str) -> dict[str, float]:
    """The GiB figures of a rendered plan's term lines."""
    figures = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] == "GiB":
            figures[parts[0]] = float(parts[1])
    return figures


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_total_is_explained_as_a_sum_of_its_lines(tmp_path, mode):
    from leangrpo.planner.plan import render_plan

    cfg = config(pipeline={"mode": mode}, run={"device": "cpu"})
    plan_ = plan_memory(cfg, dims=LLAMA_8B)
    text = render_plan(plan_, cfg)
    explained = [line for line in text.splitlines() if "total =" in line or line.startswith("          + the ")]
    assert len(explained) == 2, text
    figures = plan_lines(text)
    persistent = ["weights", "reference_copy", "generation_copy", "adamw_state"]
    named = [k for k in persistent if figures[k] > 0]
    assert explained[0].startswith(f"  total = {' + '.join(named)} (")
    train = plan_[TRAINING_PASS] + plan_["offloaded_to_host"]
    both = mode == "async"
    assert ("at the same time" in explained[1]) == both
    phase = train + plan_["kv_cache"] if both else max(train, plan_["kv_cache"])
    numbers = [float(x) for x in re.findall(r"(\d+\.\d{3})", " ".join(explained))]
    assert numbers[0] == pytest.approx(sum(plan_[k] for k in persistent) / 2**30, abs=1e-3)
    assert sum(plan_[k] for k in persistent) + phase == plan_["total"]


def test_plan_into_a_reader_that_stops_early_ends_quietly(tmp_path):
    """`leangrpo plan ... | head -1`: no BrokenPipeError traceback."""
    model = small_context_model(tmp_path, positions=4096)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(minimal_run(model={"name_or_path": str(model)})))
    import subprocess
    import sys

    out = subprocess.run(
        f"{sys.executable} -m leangrpo plan {path} | head -1",
        shell=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.stdout.startswith("memory plan")
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr


def test_context_parallelism_splits_the_activations_and_adds_the_exchange():
    """C ranks of a share hold 1/C of a row's tokens: the activation and head terms fall
    about C-fold, the exchange buffers appear, weights and optimizer state shard over W."""
    from leangrpo.planner.plan import all_to_all_bytes

    cp = {"distributed": {"context_parallel_size": 2}}
    dp, split = plan(world_size=2), plan(world_size=2, **cp)
    assert split["activations"] < 0.55 * dp["activations"]
    # the head's rows halve (its tiles and a trained head's weight gradient do not)
    assert split["lm_head"] < dp["lm_head"]
    assert split["gradients"] == dp["gradients"] and split["weights"] == dp["weights"]
    # q (32 heads) + k and v (8 heads each) of 10240 local tokens, sent and received, bf16
    assert split["all_to_all"] == 2 * 10240 * (32 + 2 * 8) * 128 * 2
    assert dp["all_to_all"] == 0 and all_to_all_bytes(LLAMA_8B, 1, 10240, 2) == 0
    assert plan(**cp) == split  # without a world size: one context group of C processes
    grid = plan(world_size=4, **cp)  # dp 2 x cp 2
    assert grid["activations"] < 0.55 * plan(world_size=4)["activations"]
    with pytest.raises(PlanError, match=r"\(2\) does not divide the 3 processes"):
        plan(world_size=3, **cp)
    # fewer key/value heads than C: attention holds lcm(K, C) of them per local token
    few = plan(world_size=16, distributed={"context_parallel_size": 16})
    assert few["all_to_all"] == 2 * 1280 * (32 + 2 * 16) * 128 * 2


def test_the_longest_micro_batch_that_fits_a_memory():
    from leangrpo.planner.plan import longest_micro_batch

    cfg = config(model={"gradient_checkpointing": True})
    memory = 80 * 2**30
    one = longest_micro_batch(cfg, memory, LLAMA_8B, world_size=8)
    assert plan_memory(cfg, one, LLAMA_8B, world_size=8)["total"] <= memory
    assert plan_memory(cfg, one + 1, LLAMA_8B, world_size=8)["total"] > memory
    cfg.distributed.context_parallel_size = 4
    split = longest_micro_batch(cfg, memory, LLAMA_8B, world_size=8)
    assert split > 2.5 * one  # the activations are split, the weights' shards are not
    assert longest_micro_batch(cfg, 2**20, LLAMA_8B, world_size=8) == 0  # weights alone


def test_cli_plans_context_parallelism_and_the_longest_sequence(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN25_15B))
    cfg = minimal_run(model={"name_or_path": str(model)}, run={"device": "cuda"},
                      distributed={"context_parallel_size": 2})  # fmt: skip
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = run_cli("plan", str(path), "--world-size", "4", "--memory", "40")
    assert out.returncode == 0, out.stderr
    assert "4 ranks, each row split over 2 context-parallel ranks" in out.stdout
    assert "  all_to_all " in out.stdout
    assert (
        "longest micro-batch (one sequence, or several packed) that fits 40 GiB per device:"
        in out.stdout
    )
    # a C that does not divide the heads: refused as train refuses it (one sentence, exit 2)
    out = run_cli("plan", str(path), "--world-size", "8", "--set",
                  "distributed.context_parallel_size=8", timeout=60)  # fmt: skip
    assert out.returncode == 2 and "total" not in out.stdout, out.stdout
    assert "context_parallel_size (8) must divide the model's 12 attention heads" in out.stderr


def test_a_context_size_that_does_not_divide_the_heads_is_refused_as_train_refuses_it():
    from leangrpo.config import ConfigError

    with pytest.raises(ConfigError, match=r"\(3\) must divide the model's 32 attention heads"):
        plan(world_size=3, distributed={"context_parallel_size": 3})
    assert plan(world_size=4, distributed={"context_parallel_size": 4})["total"] > 0


def test_context_parallel_head_is_planned_for_the_rank_holding_the_completions():
    """A row's completion tokens follow its prompt, so its shards do not share them
    evenly: a 10240-token prompt and a 10240-token completion over C = 2 leave shard 0
    one completion row and shard 1 all of its 10240 tokens (the predicting positions
    10239..20478). The per-device figure is shard 1's, not rows / C: with the full (T, V)
    logits (logprobs.chunked: false) it holds as many as one process does."""
    from leangrpo.planner.plan import completion_rows

    sections = {"logprobs": {"chunked": False}, "packing": {"shared_prefix": "off"},
                "data": {"max_prompt_tokens": 10240},
                "rollout": {"max_new_tokens": 10240, "num_generations": 2}}  # fmt: skip
    assert completion_rows(config(**sections), 20480, 10240) == 10240
    split = plan(world_size=2, distributed={"context_parallel_size": 2}, **sections)
    assert split["lm_head"] == plan(world_size=2, **sections)["lm_head"]
