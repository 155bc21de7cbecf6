"""Typed, validated settings: one `Config` of nested sections, each field documented.

Every field carries its default, allowed range and description (docs/config.md is generated
from them by scripts/gen_config_docs.py). Choices:

- Unknown keys are errors (`extra="forbid"`); io.py turns every pydantic error into
  one sentence naming the dotted key and, for a typo, the closest valid key.
- Values are parsed leniently (pydantic lax mode), so YAML's `1e-5` (a string to PyYAML)
  still reads as a float; `--set` values go through `yaml.safe_load`.
- Cross-field rules live on the section that owns them (on `Config` when they span
  sections) and raise `ConfigError` with one sentence naming every key involved.
- Every float must be finite (`allow_inf_nan=False`): `.inf` or `.nan` anywhere is refused
  naming the key. Values that are finite but absurd get documented upper bounds
  (temperatures <= 10, time limits <= one day, seeds within numpy's 0..2**32-1).
- This module must not import torch: the CLI validates a config before anything heavy loads.

Layout: the sections live in run.py (run, model, lora, data, rewards, eval, checkpoint,
logging), training.py (rollout, loss, train, packing, logprobs, offload, pipeline,
distributed), environment.py (environment) and agent.py (agent), their base `Section` in base.py; this module holds `Config` with the rules
that span sections, and loading (`load_config`, `config_from_dict`), which the package
facade (`leangrpo.config`) hands out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from leangrpo.config.agent import AgentConfig
from leangrpo.config.base import Section
from leangrpo.config.distill import DistillConfig
from leangrpo.config.environment import EnvironmentConfig
from leangrpo.config.io import (
    ConfigError,
    apply_override,
    describe_validation_error,
    read_yaml,
    rule_error,
)
from leangrpo.config.run import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    LoRAConfig,
    ModelConfig,
    RewardsConfig,
    RunConfig,
)
from leangrpo.config.training import (
    DistributedConfig,
    LogprobsConfig,
    LossConfig,
    OffloadConfig,
    PackingConfig,
    PipelineConfig,
    RolloutConfig,
    TrainConfig,
)

QUANT_BITS = {"nf4": 4, "fp4": 4, "int8": 8}

__all__ = ["Config", "load_config", "config_from_dict"]


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
    environment: EnvironmentConfig | None = Field(
        None, description="Multi-turn rollouts (environments and tools); null = single-turn."
    )
    agent: AgentConfig | None = Field(
        None,
        description="Agents written against the OpenAI client, trained through the OpenAI-compatible endpoint (docs/agents.md); null = none. Not with environment.",
    )
    distill: DistillConfig | None = Field(
        None, description="On-policy distillation from a frozen teacher; null = none."
    )

    @model_validator(mode="after")
    def _check_dropout(self) -> Config:
        if self.lora.enabled and self.lora.dropout > 0 and self.model.disable_dropout:
            raise rule_error(
                f"lora.dropout ({self.lora.dropout}) would be set to 0 by model.disable_dropout (true by default, since dropout makes the training pass disagree with the old-log-prob pass); set lora.dropout: 0, or model.disable_dropout: false to train with dropout."
            )
        return self

    @model_validator(mode="after")
    def _check_quantization(self) -> Config:
        quant = self.model.quantization
        if quant == "none":
            return self
        if not self.lora.enabled:
            raise rule_error(
                f"model.quantization ({quant}) freezes the base model in {QUANT_BITS[quant]} bits, which the optimizer cannot update; set lora.enabled: true (QLoRA trains LoRA adapters on the quantized base) or model.quantization: none."
            )
        if quant == "int8" and (
            self.model.gradient_checkpointing or self.offload.activations != "none"
        ):
            raise rule_error(
                "model.quantization: int8 keeps every linear layer's input alive outside autograd (bitsandbytes' int8 matmul holds it itself), so model.gradient_checkpointing and offload.activations would save no memory; use model.quantization: nf4, whose 4-bit layers keep nothing, or turn them off."
            )
        if self.rollout.engine == "vllm" and quant != "nf4":
            raise rule_error(
                f"rollout.engine vllm quantizes a bitsandbytes base in flight in nf4 only, not {quant}, so it would sample from other weights than the trainer's; use model.quantization: nf4 or rollout.engine: hf."
            )
        if self.rollout.engine == "vllm" and not self.model.quantization_double_quant:
            raise rule_error(
                "rollout.engine vllm quantizes nf4 with double quantization always, so without it the trainer's weights would differ from vLLM's; set model.quantization_double_quant: true or rollout.engine: hf."
            )
        return self

    @model_validator(mode="after")
    def _check_routing(self) -> Config:
        if self.logging.routing_diagnostics and not self.rollout.routing_replay:
            raise rule_error(
                "logging.routing_diagnostics compares scoring with and without routing replay, which needs the engine's route records; set rollout.routing_replay: true (a mixture-of-experts model) or logging.routing_diagnostics: false."
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

    @model_validator(mode="after")
    def _check_float16_full_finetuning(self) -> Config:
        """AdamW updates the trained weights in place in model.dtype (no float32 master
        copy): float16 loses the small updates and overflows within steps. Refused, not
        patched with master weights: bfloat16 or float32 do what float16 cannot, and
        LoRA keeps its adapters float32 on a float16 base."""
        if self.model.dtype == "float16" and not self.lora.enabled:
            raise rule_error(
                "model.dtype: float16 with full fine-tuning (lora.enabled: false) would update float16 weights in place with AdamW (leangrpo keeps no float32 master copy), which turns them non-finite within a few steps; use model.dtype: bfloat16 (GPUs that have it) or float32, or train LoRA adapters (lora.enabled: true), which stay float32 on a float16 base."
            )
        return self

    @model_validator(mode="after")
    def _check_rewards_and_environment(self) -> Config:
        env, agent, functions = self.environment, self.agent, self.rewards.functions
        if env is not None and agent is not None:
            raise rule_error(
                "environment and agent both say how a trajectory is made; keep one (environment: a leangrpo Environment; agent: a program written against the OpenAI client)."
            )
        multi = "environment" if env is not None else "agent" if agent is not None else None
        if not functions and multi is None and self.distill is None:
            raise rule_error(
                "'rewards.functions' should have at least 1 item: name a reward function, e.g. rewards.functions: [math] (only an environment's or an agent's own reward terms, or a distill teacher, can stand in for them)."
            )
        no_reward = all(spec.weight == 0 for spec in functions)
        if functions and no_reward and multi is None and self.distill is None:
            raise rule_error(
                "Every rewards.functions[*].weight is 0, so every reward and advantage is 0 and the run learns nothing; give at least one function a non-zero weight."
            )
        if agent is not None and agent.entry is None and agent.command is None:
            raise rule_error(
                "agent needs agent.entry (a Python function run(client, task), e.g. agent.entry: my_agent.py:run) or agent.command (any program, given OPENAI_BASE_URL and OPENAI_API_KEY)."
            )
        if multi is None:
            return self
        total = (env or agent).max_total_tokens
        if not self.data.chat_template:
            raise rule_error(
                f"{multi} needs data.chat_template (true, or a template's name or file), because a multi-turn conversation is rendered turn by turn with a chat template from the prompt's messages."
            )
        if self.data.overlong_prompts.startswith("truncate"):
            raise rule_error(
                f"data.overlong_prompts: {self.data.overlong_prompts} cannot shorten a multi-turn prompt, whose first turn is rendered from its messages (with the tools); use error or drop."
            )
        new = self.rollout.max_new_tokens
        if total <= new:
            raise rule_error(
                f"{multi}.max_total_tokens ({total}) must exceed rollout.max_new_tokens ({new}), the budget of one turn, or no prompt leaves room for a turn."
            )
        budget = self.rollout.kv_cache_tokens
        if self.rollout.engine == "hf" and budget is not None and budget < total:
            raise rule_error(
                f"rollout.kv_cache_tokens ({budget}) must be at least {multi}.max_total_tokens ({total}), because the hf engine must hold one whole trajectory's KV cache; raise it, or set it to null (no bound)."
            )
        vllm_len = self.rollout.vllm.max_model_len
        if self.rollout.engine == "vllm" and vllm_len is not None and vllm_len < total:
            raise rule_error(
                f"rollout.vllm.max_model_len ({vllm_len}) must be at least {multi}.max_total_tokens ({total}), the longest trajectory vLLM is asked to continue."
            )
        return self

    def multi_turn(self) -> tuple[str, int] | None:
        """The section that makes trajectories ('environment' or 'agent') and its
        max_total_tokens; None for a single-turn run."""
        if self.environment is not None:
            return "environment", self.environment.max_total_tokens
        if self.agent is not None:
            return "agent", self.agent.max_total_tokens
        return None

    @model_validator(mode="after")
    def _check_distill(self) -> Config:
        """The teacher's log-probs are of the temperature-scaled distribution, unfiltered
        (a teacher filtered by top-k / min-p gives -inf to tokens outside its set), so the
        student's must be too; groups without reward variance still carry the teacher's
        signal, so re-rolls and replay, which drop or swap them, would drop the teacher's
        signal with them (pure or mixed distillation alike)."""
        if self.distill is None:
            return self
        r = self.rollout
        if r.top_k or r.min_p:
            raise rule_error(
                f"distill compares the student's and the teacher's temperature-scaled distributions on each sampled token, and rollout.top_k ({r.top_k}) / rollout.min_p ({r.min_p}) would sample from a filtered one; set rollout.top_k: 0 and rollout.min_p: 0."
            )
        for key, section in (("replay", self.pipeline.replay), ("reroll", self.pipeline.reroll)):
            if section.enabled:
                raise rule_error(
                    f"pipeline.{key}.enabled drops or swaps the groups without reward variance, and with distill those groups still carry the teacher's per-token signal (every group does when no reward function is weighted); set pipeline.{key}.enabled: false."
                )
        if self.distill.served:
            self._check_served_teacher()
        return self

    def _check_served_teacher(self) -> None:
        """A served teacher's log-probs are vLLM's prompt log-probs: of the unscaled
        distribution (vLLM applies no temperature to them), so the student's must be too;
        and its servers are the teacher's alone (a rollout server gets the policy's
        weights pushed to it)."""
        temperature = self.rollout.temperature
        if temperature != 1.0:
            raise rule_error(
                f"distill.teacher_urls: vLLM's prompt log-probs, which a served teacher returns, are of the unscaled distribution (temperature 1), and rollout.temperature is {temperature:g}, so the teacher's and the student's log-probs would be of different distributions; set rollout.temperature: 1.0, or use a local distill.teacher (scored at any temperature)."
            )
        engine = self.rollout.vllm.urls if self.rollout.engine == "vllm" else []
        rollout = {u.rstrip("/") for u in engine}
        shared = [u for u in self.distill.teacher_urls if u.rstrip("/") in rollout]
        if shared:
            raise rule_error(
                f"{shared[0]} is in both distill.teacher_urls and rollout.vllm.urls, and the policy's weight sync would replace the teacher's weights on it; serve the teacher on a server of its own."
            )

    def served_teacher(self) -> bool:
        """Distillation from a teacher on `leangrpo serve` processes (distill.teacher_urls)."""
        return self.distill is not None and self.distill.served

    @model_validator(mode="after")
    def _check_group_size(self) -> Config:
        """A group of one completion has no GRPO baseline (its advantage is 0), so
        rollout.num_generations 1 is only for pure distillation: a distill teacher, a
        single-turn run (no environment's or agent's reward terms) and no reward function
        weighted, where every token's signal is the teacher's."""
        if self.rollout.num_generations >= 2:
            return self
        weighted = any(spec.weight != 0 for spec in self.rewards.functions)
        if self.distill is None or weighted or self.multi_turn() is not None:
            raise rule_error(
                "Config key 'rollout.num_generations' = 1 is invalid: GRPO compares completions within a group, so each prompt needs at least 2; only pure distillation (a distill teacher, no environment or agent, no reward function weighted) trains on groups of one."
            )
        return self

    def model_token_budget(self) -> int:
        """The most tokens one sample trains on: rollout.max_new_tokens, or for multi-turn
        min(max_turns x max_new_tokens, max_total_tokens) (dr_grpo's constant normaliser)."""
        new = self.rollout.max_new_tokens
        if self.agent is not None:  # one segment of an episode
            return min(self.agent.max_requests * new, self.agent.max_total_tokens)
        if self.environment is None:
            return new
        return min(self.environment.max_turns * new, self.environment.max_total_tokens)

    def generates_with_live_weights(self) -> bool:
        """The hf engine in sync mode samples from the trainer's own model: never stale."""
        return self.rollout.engine == "hf" and self.pipeline.mode == "sync"

    @model_validator(mode="after")
    def _check_vllm_sharing(self) -> Config:
        blocker = self.vllm_share_blocker()
        if self.rollout.vllm.share_weights is True and blocker is not None:
            why, fix = blocker
            raise rule_error(
                f"rollout.vllm.share_weights is true, but {why}; set {fix}, or rollout.vllm.share_weights: auto or false to keep two copies of the weights."
            )
        return self

    def shares_vllm_weights(self) -> bool:
        """Colocated vLLM serves from the policy's own tensors, as far as the config can
        tell (rollout/vllm/sharing.py checks the rest once vLLM runs)."""
        v = self.rollout.vllm
        applies = self.rollout.engine == "vllm" and v.mode == "colocate"
        return applies and v.share_weights is not False and self.vllm_share_blocker() is None

    def vllm_share_blocker(self) -> tuple[str, str] | None:
        """(why, the keys that would allow it) when this config rules out colocated vLLM
        sharing the policy's weights; None when nothing in it does (or nothing is shared:
        no colocated vLLM)."""
        v, kwargs = self.rollout.vllm, self.rollout.vllm.engine_kwargs
        if self.rollout.engine != "vllm" or v.mode != "colocate":
            return None
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            if int(kwargs.get(key) or 1) > 1:
                return (
                    f"rollout.vllm.engine_kwargs.{key} is {kwargs[key]}, so vLLM holds shards of each weight, not tensors the policy can view",
                    f"rollout.vllm.engine_kwargs.{key}: 1",
                )
        executor = kwargs.get("distributed_executor_backend")
        if executor not in (None, "uni"):
            return (
                f"rollout.vllm.engine_kwargs.distributed_executor_backend is {executor}, so vLLM's worker runs in another process with a copy of the weights the policy cannot view",
                "no rollout.vllm.engine_kwargs.distributed_executor_backend (or uni)",
            )
        if kwargs.get("quantization"):
            return (
                f"rollout.vllm.engine_kwargs.quantization is {kwargs['quantization']}, so vLLM serves other tensors than the trainer's",
                "no rollout.vllm.engine_kwargs.quantization",
            )
        if self.model.quantization != "none":
            return (
                f"model.quantization is {self.model.quantization}, and vLLM keeps a bitsandbytes base in its own packed layout, which the trainer's quantized layers cannot view",
                "model.quantization: none",
            )
        if self.model.trust_remote_code:
            return (
                "model.trust_remote_code is true, and a model class from the hub cannot be built on vLLM's tensors",
                "model.trust_remote_code: false",
            )
        if v.weight_dtype() not in (None, self.model.dtype) and self.model.dtype != "auto":
            return (
                f"rollout.vllm.dtype ({v.dtype}) differs from model.dtype ({self.model.dtype})",
                "rollout.vllm.dtype: auto",
            )
        if self.pipeline.mode == "async" and not self.lora.enabled:
            return (
                "pipeline.mode is async with full fine-tuning (lora.enabled false), so vLLM would generate from weights the optimizer is writing",
                "pipeline.mode: sync or lora.enabled: true",
            )
        return None

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
