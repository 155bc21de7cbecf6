"""Config: clear one-sentence errors, --set overrides, YAML round trip, generated docs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from support.configs import ROOT
from support.processes import run_python
from support.scripts import load_script

from leangrpo.config import Config, ConfigError, config_from_dict, load_config

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


def test_min_p_of_one_refused_in_one_sentence(config_file: Path) -> None:
    """rollout.min_p: 1.0 passed the config, then the trainer's log-probs raised a raw
    ValueError after the model had loaded."""
    msg = error_for(["rollout.min_p=1.0"], config_file)
    assert msg.startswith("rollout.min_p = 1.0 keeps only the most likely token")
    assert "set rollout.min_p below 1" in msg
    assert load_config(config_file, ["rollout.min_p=0.99"]).rollout.min_p == 0.99


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
        (["environment={tools: ['t.py:add']}", "data.chat_template=true", "data.overlong_prompts=truncate_left"],
         "data.overlong_prompts: truncate_left cannot shorten a multi-turn prompt"),
    ],
)
def test_cross_field_rules(config_file: Path, overrides: list[str], expected: str) -> None:
    assert expected in error_for(overrides, config_file)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_staleness_bound_must_fit_the_sync_interval_in_both_modes(config_file, mode) -> None:
    """cfg_sync.py: sync mode with vLLM used to train on samples up to 3 versions old."""
    overrides = [
        "rollout.engine=vllm",
        f"pipeline.mode={mode}",
        "pipeline.sync_interval=4",
        "pipeline.max_staleness=0",
    ]
    assert "pipeline.sync_interval - 1 (3)" in error_for(overrides, config_file)
    load_config(config_file, [*overrides[:-1], "pipeline.max_staleness=3"])


def test_live_hf_engine_in_sync_mode_ignores_the_sync_interval(config_file) -> None:
    """It generates with the trainer's own model, so its samples are never stale."""
    cfg = load_config(config_file, ["pipeline.sync_interval=4", "pipeline.max_staleness=0"])
    assert cfg.generates_with_live_weights()
    assert "(3)" in error_for(
        ["pipeline.mode=async", "pipeline.sync_interval=4", "pipeline.max_staleness=0"],
        config_file,
    )


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
    out = run_python(code)
    assert out.returncode == 0, out.stderr


def test_docs_are_up_to_date() -> None:
    gen = load_script("gen_config_docs")
    text = (ROOT / "docs" / "config.md").read_text()
    assert text == gen.render(), "docs/config.md is stale: run python scripts/gen_config_docs.py"
    assert "`rollout.num_generations` | int | `8` | >= 1 |" in text
    assert "## `rollout.vllm`" in text and "## `rewards.functions[]`" in text


def test_bundled_example_configs_load():
    from leangrpo.config import load_config

    for path in sorted((ROOT / "examples").glob("*.yaml")):
        load_config(path, [])


# -- values that would make a run crash, hang or learn nothing --------------------------------


def float_keys() -> list[str]:
    """Every float field of the schema, as an override key (list items at index 0)."""
    import typing

    from leangrpo.config.io import section_type

    def walk(model, prefix):
        for name, field in model.model_fields.items():
            sub = section_type(field.annotation)
            if sub is not None:
                is_list = typing.get_origin(field.annotation) is list
                yield from walk(sub, f"{prefix}{name}[0]." if is_list else f"{prefix}{name}.")
            elif float in (field.annotation, *typing.get_args(field.annotation)):
                yield f"{prefix}{name}"

    return list(walk(Config, ""))


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "1e400", "inf"])
def test_every_float_refuses_non_finite_values(config_file: Path, value: str) -> None:
    keys = float_keys()
    assert {"train.learning_rate", "loss.beta", "rewards.functions[0].weight"} <= set(keys)
    for key in keys:
        required = ["distill.teacher=t"] if key.startswith("distill.") else []
        msg = error_for([*required, f"{key}={value}"], config_file)
        assert f"'{key}'" in msg and "finite number" in msg, (key, msg)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("run.seed=-1", "'run.seed' = -1 is invalid: input should be greater than or equal to 0"),
        ("run.seed=4294967296", "less than or equal to 4294967295"),
        ("run.output_dir=''", "'run.output_dir' = '' is invalid: it would write the run into"),
        ("run.output_dir=./", "the current directory"),
        ("rollout.temperature=1e6", "'rollout.temperature'"),
        ("eval.temperature=11", "'eval.temperature'"),
        ("rewards.timeout_s=1e9", "'rewards.timeout_s'"),
        ("rollout.vllm.request_timeout_s=1e9", "'rollout.vllm.request_timeout_s'"),
        ("rollout.stop=['</a>', '']", "an empty stop string matches at once"),
        ("rewards.functions[0].weight=0", "Every rewards.functions[*].weight is 0"),
        ("train.micro_batch_tokens=256", "train.micro_batch_tokens (256) must exceed"),
    ],
)
def test_useless_or_absurd_values_are_refused(
    config_file: Path, override: str, expected: str
) -> None:
    assert expected in error_for([override], config_file)


def test_limits_accept_sane_values(config_file: Path) -> None:
    cfg = load_config(
        config_file,
        ["run.seed=4294967295", "rollout.temperature=10", "rewards.timeout_s=3600"],
    )
    assert cfg.run.seed == 2**32 - 1
    cfg = load_config(
        config_file,
        ["rewards.functions=[math, {name: format, weight: 0}]", "rollout.stop=['</a>']"],
    )
    assert [f.weight for f in cfg.rewards.functions] == [1.0, 0.0]


# -- the config file itself -------------------------------------------------------------------


def test_duplicate_keys_are_refused_naming_lines(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text(
        "run:\n  seed: 1\nmodel:\n  name_or_path: tiny\ndata:\n  path: p.jsonl\n"
        "rewards:\n  functions: [math]\nrun:\n  max_steps: 3\n"
    )
    assert "sets 'run' twice (lines 1 and 9)" in error_for([], path)
    path.write_text(
        yaml.safe_dump(MINIMAL) + "train:\n  learning_rate: 1.0e-5\n  learning_rate: 2.0e-5\n"
    )
    assert "sets 'train.learning_rate' twice" in error_for([], path)
    path.write_text(
        yaml.safe_dump({k: v for k, v in MINIMAL.items() if k != "rewards"})
        + "rewards:\n  functions:\n    - {name: math, weight: 1, weight: 2}\n"
    )
    assert "sets 'rewards.functions[0].weight' twice" in error_for([], path)


def test_anchors_and_merge_keys_are_not_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "anchors.yaml"
    path.write_text(
        yaml.safe_dump(MINIMAL)
        + "eval: &ev\n  num_generations: 2\n"
        + "train:\n  <<: {warmup_steps: 3}\n  warmup_steps: 4\n"
    )
    cfg = load_config(path, [])
    assert cfg.eval.num_generations == 2 and cfg.train.warmup_steps == 4


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("run:\n  seed: 1\n".encode("utf-16"), "UTF-16 or UTF-32 encoded"),
        ("run:\n  seed: 1\n".encode("utf-16-le"), "UTF-16 or UTF-32 encoded"),
        (bytes(range(256)) * 4, "is a binary file"),
        (b"run:\n  output_dir: caf\xe9\n", "not UTF-8 text (byte 0xe9 at line 2)"),
    ],
)
def test_unreadable_config_files(tmp_path: Path, content: bytes, expected: str) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_bytes(content)
    assert expected in error_for([], path)


def test_the_hf_kv_budget_must_hold_one_trajectory() -> None:
    """rollout.kv_cache_tokens below environment.max_total_tokens could never admit a long
    trajectory's turn (the engine would stop mid-batch): refused in one sentence."""
    tools = ROOT / "examples" / "tools_demo.yaml"
    assert load_config(tools, ["rollout.kv_cache_tokens=192"]).rollout.kv_cache_tokens == 192
    expected = r"kv_cache_tokens \(191\) must be at least environment.max_total_tokens \(192\)"
    with pytest.raises(ConfigError, match=expected):
        load_config(tools, ["rollout.kv_cache_tokens=191"])
    assert load_config(tools, ["rollout.kv_cache_tokens=8", "rollout.engine=vllm"])  # not read


def test_float16_full_finetuning_is_refused_with_advice(config_file: Path) -> None:
    message = error_for(["model.dtype=float16"], config_file)
    assert "model.dtype: float16 with full fine-tuning" in message
    assert "float32" in message and "lora.enabled: true" in message
    cfg = load_config(config_file, ["model.dtype=float16", "lora.enabled=true"])
    assert cfg.model.dtype == "float16"


def test_a_directory_as_data_path_points_to_data_dataset(config_file: Path, tmp_path: Path) -> None:
    message = error_for([f"data.path={tmp_path}"], config_file)
    assert f"data.path = '{tmp_path}' is a directory" in message
    assert f"data.dataset: '{tmp_path}'" in message
