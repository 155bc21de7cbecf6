"""Config sections for the run and what it reads and writes: run, model, lora, data, rewards,
eval, checkpoint, logging.

`Config` (root.py) gathers these with the sections of training.py; the choices that hold
for every section (unknown keys refused, floats finite, documented bounds, no torch
import) are described there. A rule that spans fields of one section is a validator
on that section and raises through `rule_error`, so its sentence reaches the user verbatim.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from leangrpo.config.base import BY_VALUE, MAX_SEED, MAX_TEMPERATURE, Section
from leangrpo.config.io import rule_error
from leangrpo.config.sandbox import SandboxConfig


class RunConfig(Section):
    """Where the run writes, how long it lasts, where it resumes from."""

    output_dir: str = Field(
        "runs/leangrpo",
        description="Directory for config.yaml, metrics.jsonl, checkpoints/ and final/; one run at a time (it is locked while a run uses it).",
    )
    seed: int = Field(
        0,
        ge=0,
        le=MAX_SEED,
        description="Seed for python, numpy and torch RNGs and the data order (0 to 2**32 - 1).",
    )
    max_steps: int = Field(
        100,
        ge=1,
        description="Optimizer steps to train for; changing it on resume moves only the stop, not the LR schedule's horizon.",
    )
    resume: str = Field(
        "auto",
        min_length=1,
        description="'auto': resume from the latest complete checkpoint in output_dir if any; 'never': start fresh; otherwise the path of a checkpoint directory.",
    )
    overwrite: bool = Field(
        False,
        description="Delete an earlier run's files in output_dir (checkpoints/, final/, metrics.jsonl, samples.jsonl, ...) and start from scratch. Without it, a directory holding a run that is not resumed is refused.",
    )
    allow_config_changes: bool = Field(
        False,
        description="Resume even when settings that change training (learning rate, batch sizes, seed, data, ...) differ from the checkpoint's config.yaml; the run then continues but is no longer exact. run.max_steps, logging.*, eval.*, checkpoint.* and run.num_threads may always change.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="'auto' = cuda if available, else cpu."
    )
    num_threads: int | None = Field(
        None,
        ge=1,
        description="torch CPU threads (torch.set_num_threads); null keeps torch's default.",
    )

    @field_validator("output_dir")
    @classmethod
    def _own_directory(cls, value: str) -> str:
        if not value.strip() or os.path.normpath(value) == ".":
            raise ValueError(
                "it would write the run into the current directory; give the run a directory of its own, e.g. runs/my-run"
            )
        return value


class ModelConfig(Section):
    """The policy model."""

    name_or_path: str = Field(
        ..., min_length=1, description="Hugging Face model id or local directory."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Weight dtype; 'auto' = float32 on CPU, bfloat16 on GPUs that have it, else float16. float16 needs lora.enabled (adapters stay float32): full fine-tuning updates the weights in place in this dtype, with no float32 master copy, and float16 weights turn non-finite within steps, so it is refused.",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward instead of storing them."
    )
    disable_dropout: bool = Field(
        True,
        description="Set every dropout of the model (and of the LoRA adapters) to 0, as TRL does for RL: the old/reference passes run without dropout, so with dropout kept the importance ratio is not 1 even on the first iteration and the clip acts on dropout noise. false keeps the model's dropout in the training pass (see docs/training.md, 'Dropout is off for RL by default').",
    )
    trust_remote_code: bool = Field(
        False, description="Allow model code from the hub (transformers trust_remote_code)."
    )
    revision: str | None = Field(
        None, description="Hub revision (branch, tag or commit); null = default branch."
    )
    quantization: Literal["none", "nf4", "fp4", "int8"] = Field(
        "none",
        description="Load the frozen base quantized with bitsandbytes (QLoRA; needs lora.enabled and `pip install 'leangrpo[qlora]'`): 'nf4' or 'fp4' (4-bit, blocks of 64 weights) or 'int8' (LLM.int8). The decoder layers' linears are quantized; the embeddings, the lm_head and the norms stay in model.dtype. Checkpoints hold the adapters, and a resume re-quantizes the base (deterministic).",
    )
    quantization_compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Dtype the 4-bit layers dequantize to and compute in; 'auto' = the model's dtype (model.dtype as resolved: float32 on CPU, bfloat16 on most GPUs). bfloat16 under a float32 model is faster on CPU but adds bf16 noise to the log-probs.",
    )
    quantization_double_quant: bool = Field(
        True,
        description="4-bit only: quantize the per-block scales too (QLoRA's double quantization), about 0.37 bit less per weight.",
    )


class LoRAConfig(Section):
    """Low-rank adapters (peft); when disabled the whole model is trained."""

    enabled: bool = Field(False, description="Train LoRA adapters instead of all weights.")
    r: int = Field(16, ge=1, description="Adapter rank.")
    alpha: int = Field(32, ge=1, description="Adapter scale numerator (scale = alpha / r).")
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on the adapter input; > 0 needs model.disable_dropout: false.",
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="Module names to adapt, or 'all-linear' for every linear layer except the output head; modules outside the decoder (the output head, lm_head) are refused: scoring bypasses them.",
    )

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, list) and not value:
            raise ValueError("list is empty; name at least one module or use 'all-linear'")
        if isinstance(value, list) and "lm_head" in value:
            raise ValueError(OUTPUT_HEAD_TARGET.format(modules="lm_head"))
        return value


# The same sentence at load time (model/policy.py), where the head may have another name.
OUTPUT_HEAD_TARGET = (
    "adapts {modules}, which leangrpo's scoring bypasses (the chunked log-probs read the output "
    "head's weight as a plain matrix, so its adapter would never train, while generation would "
    "use it); drop it from lora.target_modules (full fine-tuning trains the head)"
)


DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


class DataConfig(Section):
    """Training prompts: one local file or one `datasets` dataset."""

    path: str | None = Field(
        None,
        description="Local prompt file (.jsonl, .json, .parquet or .csv). Exactly one of path / dataset.",
    )
    dataset: str | None = Field(
        None,
        description="A `datasets` hub name or local dataset directory. Exactly one of path / dataset.",
    )
    dataset_config: str | None = Field(
        None, description="The dataset's configuration (subset) name."
    )
    split: str = Field("train", description="Split of `dataset` to train on.")
    prompt_column: str = Field(
        "prompt", description="Column holding the prompt text (after column_map)."
    )
    column_map: dict[str, str] = Field(
        default_factory=dict,
        description="Renames source columns to target names, e.g. {question: prompt}.",
    )
    columns: list[str] | None = Field(
        None,
        description="Extra columns passed to reward functions; null = every non-prompt column.",
    )
    chat_template: bool | str = Field(
        False,
        description="Render each prompt as the user message with a chat template: true = the tokenizer's; a bundled name ('chatml-hermes': ChatML, with Hermes tool calls when tools are offered) or the path of a .jinja file = that template (a base model without one can then train on chat data); false = the raw prompt text. It is also environment.chat_template's default.",
    )
    system_prompt: str | None = Field(
        None, description="System message added by the chat template (needs data.chat_template)."
    )
    eval_path: str | None = Field(None, description="Local file of evaluation prompts.")
    eval_split: str | None = Field(None, description="Split of `dataset` used for evaluation.")
    eval_size: int = Field(
        0,
        ge=0,
        description="Rows held out of the training data for evaluation when neither eval_path nor eval_split is set.",
    )
    shuffle: bool = Field(
        True, description="Shuffle prompts each epoch (deterministically from run.seed)."
    )
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="Longest prompt in tokens. Whatever this says, a prompt plus rollout.max_new_tokens must fit the model's context (config.json max_position_embeddings); longer prompts are handled by data.overlong_prompts. null = only the context limit.",
    )
    overlong_prompts: Literal["error", "drop", "truncate_left", "truncate_right"] = Field(
        "error",
        description="A prompt over the limit: 'error' stops before the model loads, naming the row; 'drop' leaves it out; 'truncate_left' keeps its last tokens, 'truncate_right' its first (not with an environment: a multi-turn prompt is measured as its first turn renders, tools listed, and cannot be cut). Dropped and truncated prompts are counted (data/dropped_prompts, data/truncated_prompts).",
    )
    empty_prompts: Literal["error", "drop"] = Field(
        "error",
        description="A prompt that is empty or only whitespace: 'error' stops naming the row; 'drop' leaves it out (counted in data/dropped_prompts).",
    )

    @field_validator("chat_template")
    @classmethod
    def _template_named(cls, value: bool | str) -> bool | str:
        if isinstance(value, str) and not value.strip():
            raise ValueError("name a template (e.g. chatml-hermes), a .jinja file, true or false")
        return value

    @model_validator(mode="after")
    def _check_sources(self) -> DataConfig:
        if (self.path is None) == (self.dataset is None):
            which = "both are set" if self.path else "neither is set"
            raise rule_error(
                f"Set exactly one of data.path (a local file) and data.dataset (a `datasets` name), but {which}."
            )
        for key in ("path", "eval_path"):
            value = getattr(self, key)
            if value is not None and Path(value).expanduser().is_dir():
                raise rule_error(
                    f"data.{key} = {value!r} is a directory, but data.{key} takes one file ({', '.join(DATA_SUFFIXES)}); name a file in it, or load the directory's data files with data.dataset: {value!r} (and data.eval_split for its eval split)."
                )
            if value is not None and not value.lower().endswith(DATA_SUFFIXES):
                raise rule_error(
                    f"data.{key} = {value!r} has an unsupported extension; use one of {', '.join(DATA_SUFFIXES)}."
                )
        if self.eval_split is not None and self.dataset is None:
            raise rule_error(
                "data.eval_split selects a split of data.dataset, which is not set; with data.path use data.eval_path or data.eval_size instead."
            )
        if self.eval_size > 0 and (self.eval_path or self.eval_split):
            raise rule_error(
                "data.eval_size holds rows out of the training data only when neither data.eval_path nor data.eval_split is set; keep just one of them."
            )
        if self.system_prompt is not None and not self.chat_template:
            raise rule_error(
                "data.system_prompt is a chat-template message, so it needs data.chat_template: true."
            )
        return self


class RewardSpec(Section):
    """One reward function and its weight in the total reward."""

    name: str = Field(
        ...,
        min_length=1,
        description="Built-in ('math', 'format', 'length'), 'pkg.module:function' or 'path/to/file.py:function'; with `value`, the function's own name.",
    )
    weight: float = Field(1.0, description="Weight of this function in the summed reward.")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the function."
    )
    value: str | None = Field(None, description=BY_VALUE)


class RewardsConfig(Section):
    """Reward functions, run in worker processes (each in its own session) with limits."""

    functions: list[RewardSpec] = Field(
        ...,
        description="Reward functions; a plain string is shorthand for {name: ...}. At least one, unless an environment gives reward terms (they are added to the total).",
    )
    timeout_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="Seconds one function may take on one chunk of completions; a chunk that times out is retried one completion per call, so a completion is unscored only when it alone takes longer. Processes the call started are killed with it.",
    )
    num_workers: int = Field(2, ge=1, le=256, description="Worker processes scoring completions.")
    calls_per_worker: int | None = Field(
        None,
        ge=1,
        le=256,
        description="Reward calls one worker runs side by side, each in a box of its own (a scoring's calls reach a worker in one message). null = the CPUs the trainer may use divided by num_workers, at least 1. Set 1 for a reward that holds a GPU, or much memory, per call.",
    )
    fail_fast: bool = Field(
        False,
        description="Stop training, with one sentence naming the function, the sample and the error, on the first reward failure instead of leaving the sample unscored.",
    )
    systematic_failures: Literal["stop", "warn"] = Field(
        "stop",
        description="A function that fails on every sample of a scoring batch the same way, on 2 or more prompts (one prompt's failures may be its data row's, not the function's): returns a list of the wrong length, a string, NaN or a scalar, or raises the same exception type (timeouts and dead workers do not count). 'stop' ends the run after that batch with one sentence naming the function and what it returned; 'warn' logs it once and leaves those samples unscored. A reward that calls a remote judge, which may be down for a whole batch, raises the same exception on every sample then: give it `warn`.",
    )
    startup_timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="Seconds a reward worker may take to be ready: user functions are imported within it at the start-up check, before the model loads (built-ins have nothing to import there); during the run, a worker that scoring waits for (built-ins included, with their warm-up) and that is still not ready this long after it started stops the run. A worker ready by the time scoring needs it (started beside torch's import) is never timed.",
    )
    memory_limit_mb: int | None = Field(
        8192,
        ge=256,
        description="Memory of each reward call or trajectory (its box), processes, memfd and tmpfs together: a memory cgroup per box where the trainer (root) has one, else only per process; and the address-space limit (RLIMIT_AS, MiB) of each worker and every process it starts; a call that exceeds it fails (counted in reward/memory_failures). Counts virtual memory, not resident, which for a worker running the math reward is already far above what it holds. null = no limit (needed by a reward that uses CUDA, which reserves far more address space).",
    )
    cpu_time_limit_s: float | None = Field(
        None,
        gt=0,
        le=86400,
        description="CPU seconds one call may use (RLIMIT_CPU, whole seconds; processes the call starts inherit at least this much). null = only timeout_s.",
    )
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig,
        description="How the reward workers are confined.",
    )

    @field_validator("functions", mode="before")
    @classmethod
    def _expand_shorthand(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"name": item} if isinstance(item, str) else item for item in value]
        return value


class EvalConfig(Section):
    """Evaluation on the held-out prompts."""

    every_steps: int = Field(
        0, ge=0, description="Evaluate every N optimizer steps; 0 = only at the start and the end."
    )
    num_prompts: int | None = Field(None, ge=1, description="Evaluation prompts used; null = all.")
    num_generations: int = Field(1, ge=1, description="Completions per evaluation prompt.")
    temperature: float = Field(
        0.0, ge=0, le=MAX_TEMPERATURE, description="Evaluation temperature; 0 = greedy; at most 10."
    )


class CheckpointConfig(Section):
    """Checkpoints for exact resume and the final model."""

    every_steps: int = Field(
        0, ge=0, description="Save every N optimizer steps; 0 = only at the end."
    )
    keep_last: int = Field(
        2, ge=1, description="Complete checkpoints kept; older ones are deleted."
    )
    save_final_model: bool = Field(
        True, description="Write output_dir/final/ (model or adapter + tokenizer)."
    )


class LoggingConfig(Section):
    """Metrics backends and console output."""

    backends: list[Literal["jsonl", "tensorboard", "wandb", "trackio"]] = Field(
        default_factory=lambda: ["jsonl"],
        description="Metrics backends; jsonl (metrics.jsonl) is always written.",
    )
    progress_bar: bool = Field(
        True,
        description="Show a progress bar (a compact line every few steps when not a terminal).",
    )
    samples_every: int = Field(
        10, ge=0, description="Print a table of sample completions every N steps; 0 = never."
    )
    wandb_project: str | None = Field(None, description="W&B / trackio project; null = 'leangrpo'.")
    run_name: str | None = Field(None, description="Run name shown by the tracking backends.")
    routing_diagnostics: bool = Field(
        False,
        description="With rollout.routing_replay: score each generation batch once more with and once without replay (two no-grad forwards per micro-batch) and log the importance-sampling ratio's statistics against the engine's log-probs for both (moe/replayed/*, moe/unreplayed/*) and the tokens whose routing flipped without replay.",
    )
