"""Config: clear one-sentence errors, --set overrides, YAML round trip, generated docs."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from leangrpo.config import Config, ConfigError, config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[1]
MINIMAL = {
    "model": {"name_or_path": "tiny"},
    "data": {"path": "prompts.jsonl"},
    "rewards": {"functions": ["math"]},
}


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(MINIMAL))
    return path


def error_for(overrides: list[str], base: Path | None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(base, overrides)
    message = str(info.value)
    assert "\n" not in message and message.endswith((".", "?")), message
    return message


def test_minimal_config_fills_defaults(config_file: Path) -> None:
    cfg = load_config(config_file, [])
    assert cfg.model.name_or_path == "tiny"
    assert cfg.rewards.functions[0].name == "math" and cfg.rewards.functions[0].weight == 1.0
    assert cfg.rollout.num_generations == 8 and cfg.rollout.top_p == 1.0
    assert cfg.train.learning_rate == 1e-5 and cfg.logging.backends == ["jsonl"]
    assert cfg.rollout.sampling_params(seed=3).seed == 3


def test_unknown_key_suggests_closest(config_file: Path) -> None:
    msg = error_for(["rollout.num_generation=4"], config_file)
    assert "'rollout.num_generation'" in msg and "did you mean 'rollout.num_generations'" in msg


def test_unknown_key_in_list_item_and_section(config_file: Path) -> None:
    msg = error_for(["rewards.functions[0].wieght=2"], config_file)
    assert "did you mean 'rewards.functions[0].weight'" in msg
    assert "did you mean 'rollout'" in error_for(["rolout.top_k=2"], config_file)


def test_unknown_key_found_in_another_section(config_file: Path) -> None:
    msg = error_for(["train.temperature=0.7"], config_file)
    assert "'rollout.temperature'" in msg and "'eval.temperature'" in msg


def test_unknown_key_without_match_lists_valid_keys(config_file: Path) -> None:
    msg = error_for(["train.lr=1e-4"], config_file)
    assert "'train.lr'" in msg and "learning_rate" in msg


def test_unknown_key_in_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**MINIMAL, "lora": {"enabled": True, "rank": 8}}))
    assert "'lora.rank'" in error_for([], path)


def test_wrong_type_names_key(config_file: Path) -> None:
    msg = error_for(["rollout.max_new_tokens=lots"], config_file)
    assert "'rollout.max_new_tokens'" in msg and "valid integer" in msg
    msg = error_for(["lora.target_modules=7"], config_file)
    assert "'lora.target_modules'" in msg and "all-linear" in msg


def test_negative_learning_rate(config_file: Path) -> None:
    msg = error_for(["train.learning_rate=-1e-5"], config_file)
    assert "'train.learning_rate'" in msg and "greater than 0" in msg


def test_num_generations_below_two(config_file: Path) -> None:
    msg = error_for(["rollout.num_generations=1"], config_file)
    assert "'rollout.num_generations'" in msg and "at least 2" in msg


def test_top_p_refused_with_reason(config_file: Path) -> None:
    msg = error_for(["rollout.top_p=0.95"], config_file)
    assert msg.startswith("rollout.top_p = 0.95 < 1 is not supported for training")
    assert "chunked lm_head" in msg and "rollout.top_k or rollout.min_p" in msg


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["data.dataset=gsm8k"], "both are set"),
        (["data.path=null"], "neither is set"),
        (["data.path=prompts.txt"], "unsupported extension"),
        (["data.eval_split=test"], "data.eval_split"),
        (["data.eval_size=10", "data.eval_path=eval.jsonl"], "data.eval_size"),
        (["data.system_prompt=Be brief."], "data.chat_template"),
        (["loss.is_min=3", "loss.is_cap=2"], "loss.is_min"),
        (["train.steps_per_generation=16"], "rollout.prompts_per_batch"),
        (["pipeline.min_groups_per_step=9"], "pipeline.min_groups_per_step"),
        (["distributed.param_dtype=bfloat16", "model.dtype=bfloat16"], "model.dtype: float32"),
        (["distributed.timeout_s=0"], "distributed.timeout_s"),
    ],
)
def test_cross_field_rules(config_file: Path, overrides: list[str], expected: str) -> None:
    assert expected in error_for(overrides, config_file)


def test_distributed_section_defaults_and_mixed_precision(config_file: Path) -> None:
    cfg = load_config(config_file, [])
    assert cfg.distributed.sharding == "full_shard" and cfg.distributed.backend == "auto"
    assert cfg.distributed.param_dtype == "off" and cfg.distributed.timeout_s == 600.0
    mixed = load_config(config_file, ["distributed.param_dtype=bfloat16", "model.dtype=float32"])
    assert mixed.distributed.reduce_dtype == "float32"


def test_missing_required_keys() -> None:
    assert "'model.name_or_path' is required" in error_for([], None)
    msg = error_for(["model.name_or_path=tiny", "data.path=a.jsonl"], None)
    assert "'rewards.functions' is required" in msg


def test_empty_reward_list(config_file: Path) -> None:
    msg = error_for(["rewards.functions=[]"], config_file)
    assert "'rewards.functions'" in msg and "at least 1 item" in msg


def test_overrides_nested_lists_and_types(config_file: Path) -> None:
    cfg = load_config(
        config_file,
        [
            "train.learning_rate=3e-6",
            "rollout.vllm.mode=server",
            "rollout.vllm.urls=[http://a:8000, http://b:8000]",
            "rollout.stop=['</answer>']",
            "lora.target_modules=[q_proj, v_proj]",
            "rewards.functions=[math, {name: format, weight: 0.5}]",
            "rewards.functions[1].kwargs={pattern: '<answer>'}",
            "train.max_grad_norm=null",
            "model.gradient_checkpointing=true",
            "run.output_dir=runs/x=y",
        ],
    )
    assert cfg.train.learning_rate == 3e-6
    assert cfg.rollout.vllm.mode == "server" and cfg.rollout.vllm.urls == [
        "http://a:8000",
        "http://b:8000",
    ]
    assert cfg.rollout.stop == ["</answer>"] and cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert [f.name for f in cfg.rewards.functions] == ["math", "format"]
    assert cfg.rewards.functions[1].weight == 0.5
    assert cfg.rewards.functions[1].kwargs == {"pattern": "<answer>"}
    assert cfg.train.max_grad_norm is None and cfg.model.gradient_checkpointing is True
    assert cfg.run.output_dir == "runs/x=y"


def test_override_into_shorthand_reward(config_file: Path) -> None:
    cfg = load_config(config_file, ["rewards.functions[0].weight=2"])
    assert cfg.rewards.functions[0].name == "math" and cfg.rewards.functions[0].weight == 2.0


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("noequals", "key.path=value"),
        ("rewards.functions[3].weight=1", "not an index"),
        ("model.name_or_path.x=1", "not a section"),
    ],
)
def test_malformed_overrides(config_file: Path, override: str, expected: str) -> None:
    assert expected in error_for([override], config_file)


def test_yaml_float_without_dot_is_a_float(tmp_path: Path) -> None:
    path = tmp_path / "lr.yaml"
    path.write_text(yaml.safe_dump(MINIMAL) + "train:\n  learning_rate: 1e-6\n")
    assert load_config(path, []).train.learning_rate == 1e-6


def test_bad_files(tmp_path: Path) -> None:
    assert "does not exist" in error_for([], tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    assert "not valid YAML at line" in error_for([], broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just text\n")
    assert "mapping of sections" in error_for([], scalar)


def test_yaml_round_trip(config_file: Path, tmp_path: Path) -> None:
    cfg = load_config(
        config_file,
        ["rollout.stop=[x, y]", "loss.type=dapo", "loss.delta=1.5", "lora.enabled=true"],
    )
    saved = cfg.save(tmp_path / "out" / "config.yaml")
    again = load_config(saved, [])
    assert again == cfg
    assert config_from_dict(yaml.safe_load(cfg.to_yaml())) == cfg


def test_assignment_is_validated(config_file: Path) -> None:
    cfg = load_config(config_file, [])
    cfg.run.max_steps = 5
    with pytest.raises(ValueError):
        cfg.run.max_steps = 0
    assert isinstance(cfg, Config)


def test_import_does_not_load_torch() -> None:
    code = "import leangrpo.config, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_docs_are_up_to_date() -> None:
    spec = importlib.util.spec_from_file_location(
        "gen_config_docs", ROOT / "scripts" / "gen_config_docs.py"
    )
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = (ROOT / "docs" / "config.md").read_text()
    assert text == gen.render(), "docs/config.md is stale: run python scripts/gen_config_docs.py"
    assert "`rollout.num_generations` | int | `8` | >= 2 |" in text
    assert "## `rollout.vllm`" in text and "## `rewards.functions[]`" in text


def test_bundled_example_configs_load():
    from pathlib import Path

    from leangrpo.config import load_config

    root = Path(__file__).resolve().parents[1]
    for path in sorted((root / "examples").glob("*.yaml")):
        load_config(path, [])
