"""model_files.py: a model directory's problems found without loading it (and without torch)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from support.files import copy_demo_model

from leangrpo.config.run import ModelConfig
from leangrpo.model.files import ModelFilesError, check_model_files, context_length


def model_cfg(path) -> ModelConfig:
    return ModelConfig(name_or_path=str(path))


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return copy_demo_model(tmp_path)


def error_for(path) -> str:
    with pytest.raises(ModelFilesError) as info:
        check_model_files(model_cfg(path))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_demo_model_passes_and_reports_its_context(model_dir: Path) -> None:
    files = check_model_files(model_cfg(model_dir))
    assert files.directory == model_dir
    assert files.context == 64 and "max_position_embeddings" in files.context_source


def test_missing_directory_is_one_sentence(tmp_path: Path) -> None:
    assert "no such directory" in error_for(tmp_path / "nope" / "model")
    assert "no such directory" in error_for("./examples/nowhere")
    (tmp_path / "file").write_text("x")
    assert "is a file" in error_for(tmp_path / "file")


def test_the_smollm2_examples_missing_link_names_the_command_that_makes_it(tmp_path) -> None:
    """A fresh clone has no examples/smollm2/model (made by --link): the message gives the
    one command, for `leangrpo plan` (read_model_config) as for `train`."""
    from leangrpo.model.files import read_model_config

    command = "python -m leangrpo.model.smollm2 --link examples/smollm2/model"
    assert command in error_for("examples/smollm2/model")
    with pytest.raises(ModelFilesError, match=command.replace(".", r"\.")):
        read_model_config(model_cfg("examples/smollm2/model"))
    assert "--link" not in error_for(tmp_path / "elsewhere" / "model")


def test_config_json_missing_or_invalid(model_dir: Path) -> None:
    (model_dir / "config.json").write_text('{"model_type": "qwen2",\n  "vocab_size": }')
    assert "config.json is not valid JSON (line 2" in error_for(model_dir)
    (model_dir / "config.json").write_text("[1, 2]")
    assert "must hold a JSON object" in error_for(model_dir)
    (model_dir / "config.json").unlink()
    assert "has no config.json" in error_for(model_dir)


def test_no_weights_or_missing_shard(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    shard = weights.rename(model_dir / "model-00001-of-00002.safetensors")
    assert "holds no weights" in error_for(model_dir)
    index = {"weight_map": {"a": shard.name, "b": "model-00002-of-00002.safetensors"}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "model-00002-of-00002.safetensors is missing" in error_for(model_dir)
    (model_dir / "model.safetensors.index.json").write_text("{}")
    assert "not a valid weight index" in error_for(model_dir)


def test_truncated_corrupt_and_header_broken_safetensors(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    assert "is truncated" in error_for(model_dir)
    weights.write_bytes(good + b"junk")
    assert "longer than its header describes" in error_for(model_dir)
    weights.write_bytes(b"\x01\x02")
    assert "shorter than its header" in error_for(model_dir)
    weights.write_bytes(struct.pack("<Q", 10**12) + good[8:])
    assert "its header claims 1000000000000 bytes, more than" in error_for(model_dir)
    (header_len,) = struct.unpack("<Q", good[:8])
    weights.write_bytes(good[:8] + b"{" * header_len + good[8 + header_len :])
    assert "header is not valid JSON tensor metadata" in error_for(model_dir)
    weights.write_bytes(b"")
    assert "shorter than its header" in error_for(model_dir)


def test_tokenizer_files_are_required(model_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).unlink()
    assert "holds no tokenizer files" in error_for(model_dir)


def test_hub_id_not_cached_is_left_for_the_download(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    files = check_model_files(model_cfg("some-org/some-model"))
    assert files.directory is None and files.context is None


def test_context_length_reads_text_config_and_rope_scaling() -> None:
    assert context_length({"max_position_embeddings": 2048})[0] == 2048
    assert context_length({"n_positions": 1024})[0] == 1024
    assert context_length({"text_config": {"max_position_embeddings": 8192}})[0] == 8192
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert context_length({"max_position_embeddings": 32768, "rope_scaling": yarn})[0] == 131072
    llama3 = {"rope_type": "llama3", "factor": 8.0}
    assert context_length({"max_position_embeddings": 131072, "rope_parameters": llama3})[0] == (
        131072
    )
    assert context_length({"hidden_size": 8}) == (None, "")


# -- what the weights and the tokenizer must agree on (issue 38) ----------------------------


def run_cfg(model_dir: Path, *overrides: str):
    from support.configs import DEMO_YAML

    from leangrpo.config import load_config

    return load_config(DEMO_YAML, [f"model.name_or_path={model_dir}", *overrides])


def test_a_tokenizer_larger_than_the_embedding_is_refused_from_its_file(
    model_dir: Path, tmp_path: Path
) -> None:
    from support.configs import ROOT

    from leangrpo.model.files import check_model_fits

    cfg = run_cfg(model_dir)
    check_model_fits(cfg, check_model_files(cfg.model))  # the demo's own tokenizer fits
    shutil.copy(ROOT / "examples" / "tools_demo" / "model" / "tokenizer.json", model_dir)
    with pytest.raises(ModelFilesError) as err:
        check_model_fits(cfg, check_model_files(cfg.model))
    assert "has 105 tokens (ids up to 104) but the model has only 32 embedding rows" in str(
        err.value
    )


def test_lora_targets_the_weights_lack_are_refused_naming_the_modules(model_dir: Path) -> None:
    from leangrpo.model.files import check_model_fits

    cfg = run_cfg(model_dir, "lora.enabled=true", "lora.target_modules=[foo_proj, self_attn]")
    with pytest.raises(ModelFilesError) as err:
        check_model_fits(cfg, check_model_files(cfg.model))
    message = str(err.value)
    assert "names no module of the model" in message and "\n" not in message
    assert "q_proj" in message and "down_proj" in message
    for fine in (
        "[q_proj, foo_proj]",
        "[self_attn.v_proj]",
        "[layers.0.mlp.up_proj]",
        "all-linear",
    ):
        cfg = run_cfg(model_dir, "lora.enabled=true", f"lora.target_modules={fine}")
        check_model_fits(cfg, check_model_files(cfg.model))
