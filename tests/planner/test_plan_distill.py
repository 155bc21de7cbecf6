"""`leangrpo plan` counts a distillation teacher: its weights (quantized or not, sharded
under torchrun) and its no-grad scoring pass, a phase of its own."""

from __future__ import annotations

import json

from support.configs import minimal_run, updated

from leangrpo.config import config_from_dict
from leangrpo.planner.inventory import divergence_head_bytes
from leangrpo.planner.plan import TRAINING_PASS, dims_from_json, plan_memory, render_plan

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
QWEN3_06B = {
    **QWEN3_8B,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "tie_word_embeddings": True,
}


def write(tmp_path, name, config):
    directory = tmp_path / name
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def config(tmp_path, **distill):
    student = write(tmp_path, "student", QWEN3_06B)
    sections = {
        "model": {"name_or_path": str(student), "dtype": "bfloat16"},
        "rollout": {"max_new_tokens": 2048, "num_generations": 8},
        "train": {"micro_batch_tokens": 20480},
        "run": {"device": "cuda"},
    }
    if distill:
        sections["distill"] = distill
    return config_from_dict(updated(minimal_run(), sections))


def test_the_teacher_is_counted_quantized_or_not_and_sharded(tmp_path):
    teacher = write(tmp_path, "teacher", QWEN3_8B)
    plain = plan_memory(config(tmp_path / "a"))
    assert plain["teacher_weights"] == plain["teacher_scoring"] == 0
    full = plan_memory(config(tmp_path / "b", teacher=str(teacher)))
    params = dims_from_json(QWEN3_8B).params
    assert full["teacher_weights"] >= 2 * params  # bfloat16
    assert full["total"] >= plain["total"] + full["teacher_weights"]
    assert full["teacher_scoring"] > 0
    nf4 = plan_memory(config(tmp_path / "c", teacher=str(teacher), teacher_quantization="nf4"))
    assert nf4["teacher_weights"] < 0.4 * full["teacher_weights"]
    sharded = plan_memory(config(tmp_path / "d", teacher=str(teacher)), world_size=4)
    assert sharded["teacher_weights"] < 0.3 * full["teacher_weights"]


def test_a_teacher_pass_larger_than_the_training_pass_sets_the_total(tmp_path):
    """A teacher with a huge MLP: its one layer of transient activations exceeds what the
    small student's training pass holds, and the total follows the larger phase."""
    teacher = write(
        tmp_path, "teacher", {**QWEN3_8B, "intermediate_size": 400_000, "num_hidden_layers": 1}
    )
    cfg = config(tmp_path / "a", teacher=str(teacher))
    plan = plan_memory(cfg)
    assert plan["teacher_scoring"] > plan[TRAINING_PASS]
    persistent = sum(plan[k] for k in ("weights", "teacher_weights", "adamw_state"))
    assert plan["total"] == persistent + max(plan["teacher_scoring"], plan["kv_cache"])
    assert "teacher_scoring (the teacher's pass" in render_plan(plan, cfg)


def test_the_jsd_objective_counts_the_teacher_in_the_training_step(tmp_path):
    """jsd: the teacher's hidden rows (and under FSDP its head's copy) are held through
    the student's pass, and its forward runs beside the gradients made by then."""
    teacher = write(tmp_path, "teacher", QWEN3_8B)
    sampled = plan_memory(config(tmp_path / "a", teacher=str(teacher)))
    assert sampled["teacher_in_step"] == 0
    jsd = plan_memory(config(tmp_path / "b", teacher=str(teacher), objective="jsd"))
    rows = 20480 * 2048 // (2048 + 512)  # completion rows of a micro-batch (512-token prompts)
    student = dims_from_json(QWEN3_06B)  # fully fine-tuned in bfloat16, CUDA's tiles
    head = divergence_head_bytes(rows, student.hidden, student.vocab, 2, (1024, 8192), True, 1.0)
    beyond = head - sampled["lm_head"]  # the divergence's head beyond the plain head's count
    assert beyond >= student.vocab * student.hidden * 2  # its head's gradient is fp32, not bf16
    assert jsd["teacher_in_step"] == rows * 4096 * 2 + beyond  # + the teacher's bf16 rows
    assert jsd[TRAINING_PASS] == sampled[TRAINING_PASS] + jsd["teacher_in_step"]
    assert jsd["teacher_scoring"] == sampled["teacher_scoring"] + jsd["gradients"]
    sharded = plan_memory(config(tmp_path / "c", teacher=str(teacher), objective="jsd"),
                          world_size=4)  # fmt: skip
    head = 151936 * 4096 * 2
    assert sharded["teacher_in_step"] >= head + rows * 4096 * 2


def test_a_served_teacher_counts_no_local_memory_and_the_plan_says_so(tmp_path):
    """distill.teacher_urls: no teacher weights or pass on this device (they are the
    servers'), the plan equal to the run's without a teacher, and a line saying why."""
    plain = plan_memory(config(tmp_path / "a"))
    cfg = config(tmp_path / "b", teacher_urls=["http://10.0.0.2:8000", "http://10.0.0.3:8000"])
    served = plan_memory(cfg)
    assert served["teacher_weights"] == served["teacher_scoring"] == served["teacher_in_step"] == 0
    assert served == plain
    text = render_plan(served, cfg)
    assert "teacher_weights and teacher_scoring are 0: the teacher is served" in text
    assert "2 server(s)" in text
