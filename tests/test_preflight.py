"""preflight.py: the cheap checks run before any model loads, and without torch."""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from support.configs import DEMO_YAML, ROOT
from support.files import write_jsonl
from support.processes import run_python

from leangrpo.config import ConfigError, load_config
from leangrpo.contracts import Prompt
from leangrpo.data.prompts import PromptSet
from leangrpo.model.files import ModelFiles, ModelFilesError
from leangrpo.preflight import (
    check_attention_backend,
    check_inputs,
    check_micro_batch,
    check_reward_cells,
    check_trajectory_fits_micro_batch,
    ignored_options,
    preflight,
    prompt_limit,
)


def demo(tmp_path: Path, *overrides: str):
    return load_config(DEMO_YAML, [f"run.output_dir={tmp_path / 'run'}", *overrides])


def test_cheap_checks_pass_without_importing_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from leangrpo.config import load_config\n"
        "from leangrpo.preflight import preflight\n"
        f"checked = preflight(load_config({str(DEMO_YAML)!r}, ['run.output_dir={tmp_path / 'run'}']))\n"
        "assert checked.model.context == 64 and checked.prompt_limit.tokens == 58\n"
        "assert 'torch' not in sys.modules, 'torch was imported by the cheap checks'\n"
        "assert 'transformers' not in sys.modules\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr


def test_prompt_limit_is_the_tightest_of_context_vllm_and_max_prompt_tokens(
    tmp_path: Path,
) -> None:
    files = ModelFiles(Path("m"), 64, "config.json max_position_embeddings")
    limit = prompt_limit(demo(tmp_path), files)
    assert limit.tokens == 58
    assert "the model's context of 64 positions" in limit.reason
    assert "minus rollout.max_new_tokens = 6" in limit.reason
    limit = prompt_limit(demo(tmp_path, "data.max_prompt_tokens=20"), files)
    assert (limit.tokens, limit.reason) == (20, "data.max_prompt_tokens = 20")
    cfg = demo(tmp_path, "rollout.engine=vllm", "rollout.vllm.max_model_len=32")
    assert prompt_limit(cfg, files).tokens == 26
    assert prompt_limit(demo(tmp_path), ModelFiles(None, None)) is None
    with pytest.raises(ConfigError, match=r"rollout.max_new_tokens \(64\) leaves no room"):
        prompt_limit(demo(tmp_path, "rollout.max_new_tokens=64"), files)


def test_micro_batch_must_hold_the_longest_sequence(tmp_path: Path) -> None:
    cfg = demo(tmp_path, "train.micro_batch_tokens=20")
    prompts = [Prompt(uid=3, text="", ids=[1] * 10), Prompt(uid=7, text="", ids=[1] * 15)]
    with pytest.raises(ConfigError) as err:
        check_micro_batch(prompts, cfg)
    assert "prompt row 7 has 15 tokens plus rollout.max_new_tokens = 6 makes 21" in str(err.value)
    assert "at least 21" in str(err.value)
    check_micro_batch(prompts, demo(tmp_path, "train.micro_batch_tokens=21"))


def test_options_that_do_nothing_are_listed(tmp_path: Path, caplog) -> None:
    assert ignored_options(demo(tmp_path)) == []
    cfg = demo(
        tmp_path,
        "pipeline.prefetch_depth=3",
        "pipeline.sync_interval=2",
        "rollout.vllm.gpu_memory_utilization=0.5",
        "offload.keep_last_layers=2",
        "lora.r=4",
        "data.eval_path=null",
        "eval.every_steps=5",
    )
    assert ignored_options(cfg) == [
        "pipeline.prefetch_depth (pipeline.mode is sync)",
        "pipeline.sync_interval (the hf engine in sync mode generates with the trainer's live weights)",
        "rollout.vllm.gpu_memory_utilization (rollout.engine is hf)",
        "offload.keep_last_layers (offload.activations is none)",
        "eval.every_steps, eval.num_prompts (there are no eval prompts: data.eval_path, "
        "data.eval_split and data.eval_size are unset)",
        "lora.r (lora.enabled is false)",
    ]
    with caplog.at_level(logging.WARNING, logger="leangrpo"):
        preflight(cfg).release()
    assert "options ignored in this configuration: pipeline.prefetch_depth" in caplog.text
    used = demo(
        tmp_path,
        "pipeline.mode=async",
        "pipeline.prefetch_depth=3",
        "pipeline.sync_interval=2",
        "lora.enabled=true",
    )
    assert ignored_options(used) == []


@pytest.mark.parametrize("correction", ["none", "bypass"])
def test_is_options_are_ignored_without_decoupled_weights(tmp_path: Path, correction) -> None:
    """bypass_ignores_is_mode.py: bypass applies no IS weight, so is_mode / is_cap / is_min
    are listed as ignored, as with none (test_step pins that they change nothing)."""
    keys = ["loss.is_mode=token_mask", "loss.is_cap=1.05", "loss.is_min=0.95"]
    ignored = ignored_options(demo(tmp_path, f"loss.is_correction={correction}", *keys))
    assert len(ignored) == 1
    assert ignored[0].startswith(
        f"loss.is_mode, loss.is_cap, loss.is_min (loss.is_correction is {correction}"
    )
    assert ignored_options(demo(tmp_path, "loss.is_correction=decoupled", *keys)) == []


def test_replay_that_the_staleness_bound_rules_out_is_listed(tmp_path: Path) -> None:
    """A stand-in comes from an earlier batch, U = mu x steps_per_generation versions old."""
    args = ("pipeline.replay.enabled=true", "loss.mu=2", "train.steps_per_generation=2")
    assert ignored_options(demo(tmp_path, *args, "pipeline.max_staleness=4")) == []
    assert ignored_options(demo(tmp_path, *args, "pipeline.max_staleness=3")) == [
        "pipeline.replay.enabled (a replayed group comes from an earlier batch, normally 4 "
        "versions old (loss.mu x train.steps_per_generation updates per batch), beyond "
        "pipeline.max_staleness = 3)"
    ]


def test_data_errors_come_before_the_run_directory_is_touched(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": ""}])
    cfg = demo(tmp_path, f"data.path={data}")
    with pytest.raises(Exception, match="empty prompt"):
        preflight(cfg)
    assert not (tmp_path / "run").exists()


def test_preflight_checks_the_model_files_and_the_metrics_backends(
    tmp_path: Path, monkeypatch
) -> None:
    cfg = demo(tmp_path, f"model.name_or_path={tmp_path / 'missing'}")
    with pytest.raises(Exception, match="no such directory"):
        preflight(cfg)
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(ConfigError, match="the wandb package is not installed"):
        preflight(demo(tmp_path, "logging.backends=[jsonl, wandb]"))
    assert not (tmp_path / "run").exists()  # refused before the run directory was touched


def test_context_parallel_needs_torchrun_a_divisor_of_the_processes_and_of_the_heads(
    tmp_path: Path,
) -> None:
    """distributed.context_parallel_size is refused in one sentence before the model loads:
    without torchrun, when it does not divide the processes, or the model's heads (the
    demo model has 2)."""
    from leangrpo.model.files import check_model_files
    from leangrpo.preflight import check_context_parallel

    def cfg(size: int):
        return demo(tmp_path, f"distributed.context_parallel_size={size}")

    files = check_model_files(cfg(2).model)
    check_context_parallel(cfg(1), 1, files)  # off: nothing to check
    check_context_parallel(cfg(2), 4, files)  # 2 shares of 2 ranks, 1 head each
    with pytest.raises(ConfigError, match="this run is a single process; start it with torchrun"):
        check_context_parallel(cfg(2), 1, files)
    with pytest.raises(ConfigError, match=r"\(3\) does not divide the 4 torchrun processes"):
        check_context_parallel(cfg(3), 4, files)
    with pytest.raises(ConfigError, match="must divide the model's 2 attention heads"):
        check_context_parallel(cfg(4), 4, files)


def test_context_parallel_without_torchrun_is_one_line_and_no_torch(tmp_path: Path) -> None:
    from support.processes import run_cli

    out = run_cli("train", str(DEMO_YAML), "--set", f"run.output_dir={tmp_path / 'run'}",
                  "--set", "distributed.context_parallel_size=2", probe=True)  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "leangrpo: error: distributed.context_parallel_size is 2"
    )
    assert out.stdout.strip().splitlines()[-1] == "torch imported: False"
    assert not (tmp_path / "run").exists()  # before the run directory is touched


def test_the_continuous_batch_knobs_are_listed_where_nothing_reads_them(tmp_path: Path) -> None:
    knobs = ("rollout.max_batch_size=4", "rollout.kv_cache_tokens=4096")
    assert ignored_options(demo(tmp_path, *knobs)) == [
        "rollout.max_batch_size, rollout.kv_cache_tokens (there is no environment or agent: single-turn "
        "generation batches by rollout.hf_prompts_per_forward)"
    ]
    tools = load_config(
        ROOT / "examples" / "tools_demo.yaml",
        [f"run.output_dir={tmp_path / 'tools'}", *knobs, "rollout.hf_prompts_per_forward=2"],
    )
    assert ignored_options(tools) == [
        "rollout.hf_prompts_per_forward (multi-turn turns decode in a continuous batch of "
        "rollout.max_batch_size rows)"
    ]


CHECK_PROBE = (
    "import atexit, sys\n"
    "atexit.register(lambda: print('heavy imported:', sorted({'torch', 'transformers'} & set(sys.modules))))\n"
    "from leangrpo.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


@pytest.mark.parametrize("config", ["examples/demo.yaml", "examples/tools_demo.yaml"])
def test_check_with_the_tokenizers_record_checks_the_same_without_transformers(
    tmp_path: Path, config: str
) -> None:
    """The first `leangrpo check` of a model loads its tokenizer with transformers and
    records it; the next reads the record and imports neither transformers nor torch, and
    checks the same: the same prompts counted and measured, the environment started and
    probed, and a micro-batch too small for the longest prompt (found by tokenising)
    refused with the same sentence."""
    env = {
        "LEANGRPO_CACHE": str(tmp_path / "cache"),
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(ROOT / "src"),
    }
    out = f"run.output_dir={tmp_path / 'run'}"
    first = run_python(CHECK_PROBE, "check", config, "--set", out, env=env)
    second = run_python(CHECK_PROBE, "check", config, "--set", out, env=env)
    assert first.returncode == second.returncode == 0, (first.stderr, second.stderr)
    assert "tokenizer: loaded with transformers; its record kept in" in first.stdout
    assert (
        "tokenizer: its record from an earlier run or check (transformers not loaded)"
        in second.stdout
    )
    assert first.stdout.strip().endswith("heavy imported: ['torch', 'transformers']")
    assert second.stdout.strip().endswith("heavy imported: []")

    def checked(text: str) -> list[str]:
        return [
            line
            for line in text.splitlines()
            if line.startswith(("  prompts:", "  environment:", "  run directory:"))
        ]

    assert checked(first.stdout) == checked(second.stdout) and len(checked(first.stdout)) >= 2
    if "tools" in config:  # a trajectory budget below the longest first turn + a turn
        small = ["--set", "environment.max_total_tokens=80", "--set", "train.micro_batch_tokens=80"]
    else:  # a micro-batch below the longest prompt + its completion
        small = ["--set", "train.micro_batch_tokens=70", "--set", "rollout.max_new_tokens=60"]
    caches = (env, {**env, "LEANGRPO_CACHE": str(tmp_path / "fresh")})
    late = [run_python(CHECK_PROBE, "check", config, "--set", out, *small, env=e) for e in caches]
    assert late[0].returncode == late[1].returncode == 2, (late[0].stdout, late[0].stderr)

    def errors(text: str) -> list[str]:  # the same sentence; how many prompts it counted over
        # the limit may differ (with the record the cheap checks measure the longest 64 first)
        lines = [line for line in text.splitlines() if line.startswith("leangrpo: error:")]
        return [re.sub(r" \(\d+ of the \d+ prompts checked are over it,", " (", x) for x in lines]

    assert errors(late[0].stderr) == errors(late[1].stderr) and len(errors(late[0].stderr)) == 1


# -- bad inputs that used to end late or badly (issue 38) -----------------------------------

TOOLS_YAML = ROOT / "examples" / "tools_demo.yaml"


@pytest.mark.parametrize("backend", ["flash_varlen", "torch_varlen"])
def test_a_cuda_attention_kernel_on_a_cpu_run_is_refused_before_the_model_loads(
    tmp_path: Path, backend: str
) -> None:
    cfg = demo(tmp_path, f"packing.attention_backend={backend}", "run.device=cpu")
    with pytest.raises(ConfigError, match=rf"attention_backend: {backend} needs a CUDA device"):
        preflight(cfg, dry=True)


def test_flex_attention_on_a_cpu_run_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    """flex_on_cpu.py: flex on CPU failed with a traceback at the first training step,
    after the model loaded (torch has no CPU flex backward). Refused in the cheap checks
    now, for training; scoring (`leangrpo eval`: forward only) may use it; and the trainer
    checks it again once run.device auto has resolved to the CPU."""
    cfg = demo(tmp_path, "packing.attention_backend=flex", "run.device=cpu")
    with pytest.raises(ConfigError) as err:
        preflight(cfg, dry=True)
    assert str(err.value) == (
        "packing.attention_backend: flex cannot train on the CPU (torch's flex attention has no backward there), but run.device is cpu; set packing.attention_backend: auto (or sdpa_segments), or run on a GPU."
    )
    check_inputs(cfg, training=False)  # scoring: forward only
    auto = demo(tmp_path, "packing.attention_backend=flex", "run.device=auto")
    with pytest.raises(ConfigError, match=r"but run.device is auto \(cpu here\); set"):
        check_attention_backend(auto, "cpu")
    check_attention_backend(auto, "cuda")


def test_flash_varlen_without_flash_attn_is_refused_before_the_model_loads(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # find_spec: not installed
    cfg = demo(tmp_path, "packing.attention_backend=flash_varlen", "run.device=auto")
    with pytest.raises(ConfigError, match="needs the flash-attn package"):
        preflight(cfg, dry=True)


def test_the_math_rewards_answer_column_is_checked_against_the_data(tmp_path: Path) -> None:
    math_on = "rewards.functions=[{name: math, kwargs: {answer_column: %s}}]"
    with pytest.raises(ConfigError) as err:
        preflight(demo(tmp_path, math_on % "solution"), dry=True)
    assert "rewards.functions[0] (math) reads column 'solution'" in str(err.value)
    assert "data.path has no such column (it has: prompt, answer)" in str(err.value)
    preflight(demo(tmp_path, math_on % "solution", "data.column_map={answer: solution}"), dry=True)
    unanswered = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "1+1="}])
    with pytest.raises(ConfigError, match="data.eval_path has no such column"):
        preflight(demo(tmp_path, f"data.eval_path={unanswered}"), dry=True)
    with pytest.raises(ConfigError, match="data.columns passes only prompt"):
        preflight(demo(tmp_path, "data.columns=[prompt]"), dry=True)
    preflight(demo(tmp_path, math_on % "answer"), dry=True)


def test_prompts_without_an_answer_are_counted_once_and_none_at_all_refused(
    tmp_path: Path, caplog
) -> None:
    cfg = demo(tmp_path)
    answered = [Prompt(uid=i, text="", ids=[1], columns={"answer": "1"}) for i in range(4)]
    blank = [Prompt(uid=i, text="", ids=[1], columns={"answer": None}) for i in range(4, 6)]
    with caplog.at_level(logging.WARNING, logger="leangrpo"):
        check_reward_cells(cfg, PromptSet(answered + blank, blank[:1]))
    assert len(caplog.records) == 1
    assert "2 of 6 train prompts (rows 4, 5) and 1 of 1 eval prompts (rows 4)" in caplog.text
    assert "column 'answer', which rewards.functions[0] (math) reads" in caplog.text
    with pytest.raises(ConfigError, match="no train prompt has a value in column 'answer'"):
        check_reward_cells(cfg, PromptSet(blank, []))


def test_max_total_tokens_over_the_context_is_said_before_the_micro_batch(
    tmp_path: Path,
) -> None:
    out = f"run.output_dir={tmp_path / 'run'}"
    cfg = load_config(TOOLS_YAML, [out, "environment.max_total_tokens=100000"])
    with pytest.raises(ConfigError, match="exceeds the model's context of 512 positions"):
        check_inputs(cfg)
    small = load_config(
        TOOLS_YAML, [out, "environment.max_total_tokens=500", "train.micro_batch_tokens=400"]
    )
    with pytest.raises(ConfigError, match=r"micro_batch_tokens \(400\) must be at least"):
        check_trajectory_fits_micro_batch(small)


def test_more_threads_than_cores_is_warned(tmp_path: Path, caplog, monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    with caplog.at_level(logging.WARNING, logger="leangrpo"):
        preflight(demo(tmp_path, "run.num_threads=2"), dry=True)
        assert "run.num_threads" not in caplog.text
        preflight(demo(tmp_path, "run.num_threads=1000"), dry=True)
    assert "run.num_threads is 1000 but this process may use 2 CPU cores" in caplog.text


def test_a_tokenizer_larger_than_the_embedding_is_refused_once_loaded(tmp_path: Path) -> None:
    """Where tokenizer.json cannot tell (another format, a hub model), the loaded
    tokenizer's length is held to config.json's vocab_size, before the model loads."""
    from support.files import copy_demo_model

    from leangrpo.preflight import Preflight, load_checked_tokenizer

    model = copy_demo_model(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "examples" / "tools_demo" / "model" / name, model)
    cfg = demo(tmp_path, f"model.name_or_path={model}")
    checked = Preflight(None, ModelFiles(model, 64, "config.json"), None)  # type: ignore[arg-type]
    with pytest.raises(ModelFilesError, match="has 105 tokens .* only 32 embedding rows"):
        load_checked_tokenizer(cfg, checked)


def test_a_chat_row_the_template_refuses_is_named_before_torch_with_the_record(
    tmp_path: Path, monkeypatch
) -> None:
    """With the tokenizer's record (left by an earlier run of this model), preflight renders
    a prompt of each kind of messages: a role the template refuses is one sentence now."""
    from leangrpo import preflight as module
    from leangrpo.data.files import DataError

    class Record:  # a TokenizerRecord's one call the check makes
        chat_template = "strict"

        def apply_chat_template(self, messages, **kwargs):
            if any(m["role"] not in ("system", "user", "assistant") for m in messages):
                raise ValueError(f"unknown role {messages[-1]['role']}")
            return "text"

    monkeypatch.setattr(module, "recall", lambda directory: Record())
    rows = [{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}] * 2
    data = write_jsonl(
        tmp_path / "chat.jsonl",
        [*rows, {"prompt": [{"role": "bot", "content": "x"}], "answer": "1"}],
    )
    cfg = demo(tmp_path, f"data.path={data}", "data.chat_template=true")
    with pytest.raises(
        DataError, match=r"row 2: the chat template cannot render .*unknown role bot"
    ):
        preflight(cfg, dry=True)


def test_a_function_sent_by_value_under_a_built_ins_name_reads_no_column(tmp_path: Path) -> None:
    """A notebook's own `math` (sent by value, its name its own) is not the built-in: no
    answer column is required of the data, nor counted in the prompts."""
    import textwrap

    from leangrpo.api.shipping import reference

    namespace = {"__name__": "__main__"}
    exec(textwrap.dedent("""
        def math(prompts, completions, **columns):
            return [float(len(c) < 5) for c in completions]
    """), namespace)  # fmt: skip
    ref = reference(namespace["math"], "reward_funcs[0]")
    data = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "1+1="}, {"prompt": "2+2="}])
    cfg = demo(tmp_path, f"data.path={data}")
    cfg.rewards.functions = [type(cfg.rewards.functions[0])(name=ref.name, value=ref.value)]
    preflight(cfg, dry=True)
    unanswered = [Prompt(uid=i, text="", ids=[1], columns={}) for i in range(2)]
    check_reward_cells(cfg, PromptSet(unanswered, []))
