"""The trainer on a mixture of experts (a tiny Qwen3-MoE / OLMoE saved to disk, the demo's
tokenizer and prompts): routing replay and the router's aux loss through whole runs (sync
and async, full fine-tuning and LoRA on attention and experts, hidden-state offload),
their figures, the final model; exact resume inside a batch with the route records in
the checkpoints, the replay buffer and re-rolls; refusals before the model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.configs import tiny_run
from support.moe import save_moe_model

from leangrpo.config import ConfigError, config_from_dict
from leangrpo.model.final import load_final
from leangrpo.preflight import preflight
from leangrpo.train import Trainer

MOE_RUN = {"rollout": {"routing_replay": True}, "train": {"router_aux_loss_coef": 0.01}}


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {arch: save_moe_model(root / arch, arch) for arch in ("qwen3_moe", "olmoe")}


def moe_run(tmp_path: Path, model_dir: Path, **sections) -> dict:
    merged = {name: dict(values) for name, values in MOE_RUN.items()}
    merged["model"] = {"name_or_path": str(model_dir)}
    for name, values in sections.items():
        merged.setdefault(name, {}).update(values)
    return tiny_run(tmp_path, **merged)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.policy.model.named_parameters()}


@pytest.mark.parametrize(
    ("arch", "sections"),
    [
        ("qwen3_moe", {"logging": {"routing_diagnostics": True}}),
        ("olmoe", {"pipeline": {"mode": "async", "max_staleness": 1}}),
        (
            "qwen3_moe",
            {"pipeline": {"mode": "async", "max_staleness": 1, "min_groups_per_step": 2}},
        ),
        (
            "qwen3_moe",
            {
                "lora": {"enabled": True, "r": 4, "alpha": 8, "target_modules": "all-linear"},
                "offload": {"activations": "hidden_states", "keep_last_layers": 0},
            },
        ),
        (
            "olmoe",
            {
                "model": {"quantization": "nf4", "gradient_checkpointing": True},
                "lora": {"enabled": True, "r": 4, "alpha": 8},
            },
        ),
    ],
    ids=["sync-diagnostics", "olmoe-async", "streaming", "lora-experts-offload", "qlora"],
)
def test_moe_runs_replay_routes_and_log_their_figures(tmp_path, moe_dirs, arch, sections):
    """QLoRA: bitsandbytes quantizes the attention's nn.Linear layers; the experts (3-D
    parameters) and the router stay in the model's dtype, with LoRA on them."""
    if "quantization" in sections.get("model", {}):
        pytest.importorskip("bitsandbytes", reason="QLoRA needs pip install 'leangrpo[qlora]'")
    cfg = config_from_dict(moe_run(tmp_path, moe_dirs[arch], **sections))
    trainer = Trainer(cfg)
    before = params(trainer)
    trainer.train()
    moved = max(float((p - before[n]).abs().max()) for n, p in params(trainer).items())
    assert moved > 0
    trained = [r for r in rows(tmp_path / "run") if "loss" in r]
    assert len(trained) == 4
    for r in trained:
        assert r["moe/route_tokens"] > 0 and r["moe/aux_loss"] > 0
        assert 0 <= r["moe/routing_flips"] <= 1 and r["moe/replay_conflicts"] == 0
    if "pipeline" not in sections:  # a batch's first step trains the weights that sampled it:
        assert trained[0]["moe/routing_flips"] == trained[2]["moe/routing_flips"] == 0  # (mu 2)
    if "logging" in sections:
        firsts = [r for r in trained if "moe/replayed/log_ratio_std" in r]
        assert len(firsts) == 2  # logged with each batch's first step (mu 2)
        for r in firsts:
            assert r["moe/unreplayed/routing_flips"] == 0
            assert r["moe/replayed/mismatch_kl"] < 1e-6 and r["moe/unreplayed/mismatch_kl"] < 1e-6
    final = load_final(tmp_path / "run" / "final")
    out = final(input_ids=torch.tensor([[3, 4, 5]]))
    assert torch.isfinite(out.logits).all()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_moe_resume_is_exact_inside_a_batch(tmp_path, moe_dirs, mode):
    """A run killed inside a generation batch resumes from the checkpoint's samples, their
    route records included (a lost record is refused, not replaced by free routing), and
    ends with the uninterrupted run's weights, bit for bit; the replay buffer and re-rolls
    carry records too."""
    from integration.test_trainer import PICKY_REWARD, StopAfter, _Interrupt, exact_resume_config

    reward_file = tmp_path / "picky.py"
    reward_file.write_text(PICKY_REWARD)

    def config(out: Path) -> dict:
        cfg = exact_resume_config(out, mode, reward_file)
        cfg["model"]["name_or_path"] = str(moe_dirs["qwen3_moe"])
        cfg["rollout"].update(MOE_RUN["rollout"])
        cfg["train"].update(MOE_RUN["train"])
        return cfg

    straight = Trainer(config_from_dict(config(tmp_path / "a")))
    straight.train()
    crashing = type("Stop", (StopAfter,), {"stop_at": 5})(config_from_dict(config(tmp_path / "b")))
    with pytest.raises(_Interrupt):
        crashing.train()
    resumed = Trainer(config_from_dict(config(tmp_path / "b")))
    assert resumed.step == 5 and resumed.inflight is not None
    assert all(s.completion.routes is not None for s in resumed.inflight.batch.samples)
    resumed.train()
    assert resumed.version == straight.version
    a, b = params(straight), params(resumed)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0
    used = sum(r.get("replay/groups_used", 0) for r in rows(tmp_path / "a" / "run"))
    assert mode == "async" or used > 0  # sync: replayed groups (with their records) trained on


def test_replay_on_a_dense_model_is_refused_before_it_loads(tmp_path):
    cfg = config_from_dict(tiny_run(tmp_path, rollout={"routing_replay": True}))
    with pytest.raises(ConfigError, match="rollout.routing_replay needs a mixture-of-experts"):
        preflight(cfg)
    cfg = config_from_dict(tiny_run(tmp_path, train={"router_aux_loss_coef": 0.1}))
    with pytest.raises(ConfigError, match="train.router_aux_loss_coef needs"):
        preflight(cfg)


def test_diagnostics_without_replay_are_refused():
    with pytest.raises(ConfigError, match="logging.routing_diagnostics compares"):
        config_from_dict(tiny_run(Path("unused"), logging={"routing_diagnostics": True}))
