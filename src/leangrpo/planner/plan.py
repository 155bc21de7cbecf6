"""`leangrpo plan`: the device memory of a training run, term by term, from config.json alone.

Reads the model's config.json (no torch, no weights: the command answers in a fraction of a
second) and counts, per device, for one micro-batch of `train.micro_batch_tokens` tokens:

    weights          base weights + buffers, in model.dtype, plus the LoRA adapters (fp32
                     when the base is bf16/fp16: peft's autocast_adapter_dtype); with
                     model.quantization the decoder layers' linears as bitsandbytes stores
                     them (quantized_linear_bytes: 4-bit about 0.52 byte a weight with
                     double quantization, 0.56 without; int8 1 byte + a scale per row) [exact]
    reference_copy   a frozen copy for full fine-tuning with beta > 0 (LoRA's reference is
                     the same weights with the adapters off: no copy) [exact]
    teacher_weights  a distillation teacher (distill.teacher, its own config.json): its
                     weights in model.dtype, or with distill.teacher_quantization its
                     decoder linears as bitsandbytes stores them (as for the base, double
                     quantization on); sharded over W under torchrun like the policy; a
                     full-precision teacher is read from host memory and sharded onto
                     the device unit by unit, never whole there (a quantized one is
                     quantized on the device as it loads, whole until it is sharded:
                     a set-up transient not in the total); a served teacher
                     (distill.teacher_urls) counts 0 here and in teacher_scoring: its
                     weights and pass are its servers' (the plan says so) [exact]
    generation_copy  the hf engine's own copy of the policy (async mode, torchrun), or
                     colocated vLLM's own copy of the base weights; none when vLLM and
                     the policy share one (rollout.vllm.share_weights), as far as the
                     checks before vLLM starts tell (rollout/vllm/precheck.py: the
                     config, the dtypes, a safetensors checkpoint); the rest is checked
                     once vLLM runs, so the plan says "if sharing holds at start-up" [exact]
    gradients        one per trainable parameter, in its dtype [exact]
    adamw_state      exp_avg + exp_avg_sq per trainable parameter (+ the 4-byte step
                     counters, which only count on CPU: on CUDA they live on the host) [exact]
    activations      the most the training pass holds at any moment besides the gradients
                     made by then and the lm_head's own working set: when the head runs,
                     the tensors autograd saves (inventory.py: an exact inventory of the
                     decoder layers, rotary tables, final norm and gathered hidden rows;
                     the loss's per-token vectors estimated), or under checkpointing one
                     hidden-sized input per layer (only the last offload.keep_last_layers
                     on the device with hidden-state offload); in a layer's backward, what
                     is still saved (or kept), that layer's saved tensors (recomputed
                     under checkpointing) and its backward working set [estimated,
                     measured on CPU]
    lm_head          the log-prob head's peak: chunked tiles, or the full (T, V) logits [exact
                     tiles; full logits measured on CPU]
    all_to_all       context parallelism (distributed.context_parallel_size C > 1): one
                     layer's Ulysses exchange buffers, the send and the receive buffer of
                     this rank's q, k and v (key/value heads replicated to lcm(K, C))
                     [exact for the exchange; other transients of the layer not counted]
    teacher_scoring  the teacher's no-grad scoring pass over one micro-batch, a phase of
                     its own (before the batch's first update): one layer's transient
                     activations (nothing is saved), the gathered completion hidden rows,
                     the chunked head's forward tiles (or the full logits), a quantized
                     layer's dequantized weight, and under FSDP what is gathered at once
                     (`teacher_gathered`: its root, with tied embeddings, and two layers,
                     or an untied head and a layer; the teacher reshards each unit after
                     its forward under either sharding) [estimated]; with
                     distill.objective: jsd the same forward runs in the training step
                     before each micro-batch's student pass, so it holds the gradients
                     made by then too (and, under FSDP, the copy of the teacher's
                     lm_head it takes)
    teacher_in_step  distill.objective: jsd only: what the student's training pass holds
                     of the teacher: its final hidden rows of the micro-batch (rows x
                     its hidden size), under FSDP its lm_head's copy, and what the
                     divergence's head (both models' logit tiles, one sweep) holds beyond
                     the plain head the lm_head term counts (inventory.py
                     `divergence_head_bytes`) [exact for the rows and the copy; the head
                     checked against the kernel's allocations on CPU]
    kv_cache         the hf engine's DynamicCache at its longest, for the larger of a training
                     generation call and an evaluation call (vLLM sizes its own) [exact]
    offloaded_to_host  layer inputs moved to host memory (not device memory; on CPU it is
                     the same memory, and counts in the total)

With colocated vLLM sharing the weights, the plan also holds `saved_by_sharing`: the copy
vLLM does not hold (not a term, not in the total).

Context parallelism: each of the C ranks of a share holds ceil(N / C) of a row's tokens,
and the completion rows of its shard: not rows / C, since a row's completion tokens follow
its prompt (one long sequence puts them all on the later shards), so the per-device figure
is that of a rank whose tokens are all completion rows, min(ceil(N / C), rows). The
activation and lm_head terms are counted for those; attention's saved tensors cover the whole row for H / C query heads and lcm(K, C) / C
key/value heads, which per local token is the layer's own inventory with lcm(K, C) key/value
heads (`context_dims`). Weights, gradients and optimizer state are sharded over all W
processes. `longest_micro_batch` inverts the plan: the most tokens a micro-batch (one long
sequence) may hold within a given memory per device.

`total` is the peak: weights + reference_copy + teacher_weights + generation_copy +
adamw_state + the largest of the training pass, the teacher's scoring pass and generation
(kv_cache); generation at the same time as the larger of the other two when an async hf
producer generates while the trainer trains. The training pass (`training_pass`, a key beside the
terms) peaks when the head runs (what is saved + lm_head), in a layer's backward (what it
holds + the gradients made by then) or at its end (gradients), plus all_to_all: the
gradients, activations and lm_head lines are each that term's own figure, not all held at
once, so the pass's peak is at most their sum (under checkpointing, where the peak is a
layer's backward before most gradients exist, it is less). The activation term is what
benchmarks/context_parallel.py measures op by op, and without checkpointing (the peak
when the head runs, everything saved) what benchmarks/grpo_step.py derives (train-pass
peak - weights - gradients - the head's own peak), so the GPU suite compares like with
like.

Estimated, and why: the backward working set and the loss vectors (small, measured
coefficients); a quantized linear's dequantized weight (the largest one, alive during its
forward and again in its backward); the shared-prefix layout's extra K and V
(prefix_kv_bytes); the full-logits path (kernel temporaries); FSDP sharding (weights / W
plus two gathered layers; a quantized base's constants are replicated, not sharded);
torch_varlen on a torch without enable_gqa repeats K and V (pass kernel="varlen_repeat_kv").
Not counted: the CUDA context and allocator fragmentation on GPU; on CPU the Python process
itself (PROCESS_BASELINE_CPU, printed apart, never in the total) and the memory glibc keeps
after frees (RSS above the live bytes); the decode loop's per-step logits and the
prefill's transient activations.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

from leangrpo.errors import UserError
from leangrpo.model.files import check_context_heads, context_length, read_model_config
from leangrpo.planner.inventory import (
    LINEARS,
    LOSS_BYTES_PER_TOKEN,
    Setup,
    adapted_linears,
    attention_kernel,
    backward_extra,
    divergence_head_bytes,
    final_norm_bytes,
    head_bytes,
    kv_cache_bytes,
    layer_saved,
    moe_layer_bytes,
    rotary_bytes,
)
from leangrpo.rollout.vllm.precheck import share_blocker, trainer_dtype_name

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# a copy of logprobs.DEFAULT_TILES (that module imports torch); tests keep them equal
DEFAULT_TILES = {"cpu": (4096, 2048), "cuda": (1024, 8192)}
DEFAULT_PROMPT_TOKENS = 512  # when data.max_prompt_tokens is unset and none is given
AUTO_MIN_PROMPT_FRACTION = (
    0.1  # a copy of attention.AUTO_MIN_PROMPT_FRACTION (tests keep them equal)
)
PROCESS_BASELINE_CPU = int(0.34 * 2**30)  # RSS of python + torch + transformers + peft
SAVED_BY_SHARING = "saved_by_sharing"  # a plan key beside the terms (rollout.vllm.share_weights)
TRAINING_PASS = "training_pass"  # a plan key beside the terms: the training pass's peak
TERMS = (
    "weights",
    "reference_copy",
    "teacher_weights",
    "generation_copy",
    "gradients",
    "adamw_state",
    "activations",
    "lm_head",
    "all_to_all",
    "teacher_scoring",
    "teacher_in_step",
    "kv_cache",
    "offloaded_to_host",
)
PERSISTENT = ("weights", "reference_copy", "teacher_weights", "generation_copy", "adamw_state")


@dataclass(frozen=True)
class Dims:
    """A decoder's shape, as config.json gives it."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool = False  # Qwen2: q, k, v have biases
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k
    qk_norm_full: bool = False  # OLMoE: RMSNorm over the whole q and k projections
    # mixture of experts (every layer): routed experts, experts per token (k), an expert's
    # intermediate size, and whether the chosen weights are renormalised (Qwen3-MoE)
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    norm_topk: bool = False

    def linears(self) -> dict[str, tuple[int, int, bool]]:
        """(in, out, bias) of each nn.Linear of a layer (a mixture of experts': attention
        only; its router and experts are `moe_params`)."""
        H, A, K, I = (  # noqa: E741
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate,
        )  # noqa: E501, E741
        attention = {
            "q_proj": (H, A, self.qkv_bias),
            "k_proj": (H, K, self.qkv_bias),
            "v_proj": (H, K, self.qkv_bias),
            "o_proj": (A, H, self.o_bias),
        }
        if self.experts:
            return attention
        mlp = {
            "gate_proj": (H, I, self.mlp_bias),
            "up_proj": (H, I, self.mlp_bias),
            "down_proj": (I, H, self.mlp_bias),
        }
        return attention | mlp

    @property
    def moe_params(self) -> int:
        """A layer's router (E x H) and experts (gate/up E x 2I x H, down E x H x I): all
        experts' weights, whichever few a token uses."""
        return self.experts * self.hidden * (1 + 3 * self.expert_intermediate)

    @property
    def active_intermediate(self) -> int:
        """The MLP width one token's activations span: I, or k x I of its experts."""
        return self.top_k * self.expert_intermediate if self.experts else self.intermediate

    @property
    def layer_params(self) -> int:
        linear = sum(i * o + (o if bias else 0) for i, o, bias in self.linears().values())
        if self.qk_norm_full:
            norms = (self.heads + self.kv_heads) * self.head_dim
        else:
            norms = 2 * self.head_dim if self.qk_norm else 0
        return linear + 2 * self.hidden + norms + self.moe_params

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return embed + self.layers * self.layer_params + self.hidden

    @property
    def param_tensors(self) -> int:
        linears = self.linears().values()
        per_layer = len(linears) + sum(b for _, _, b in linears) + 2 + 2 * self.qk_norm
        per_layer += 3 if self.experts else 0  # router, gate/up, down
        return self.layers * per_layer + (1 if self.tied else 2) + 1

    @property
    def buffer_bytes(self) -> int:
        """Rotary inv_freq and original_inv_freq: head_dim / 2 fp32 values each."""
        return 2 * (self.head_dim // 2) * 4


# bitsandbytes' 4-bit layout: one absmax per QUANT_BLOCK weights (transformers' default block
# size); double quantization stores those absmax in 8 bits, one fp32 absmax per NESTED_BLOCK
QUANT_BLOCK, NESTED_BLOCK = 64, 256


def quantized_linear_bytes(inputs: int, outputs: int, quant: str, double_quant: bool) -> tuple[int, int]:
    """(weight storage, quantization constants) of one linear as bitsandbytes keeps it (its
    bias: see base_bytes). 4-bit: two weights a byte; per block an fp32 absmax, or
    with double quantization a uint8 one plus per 256 blocks an fp32 absmax, the 256-value
    fp32 code and an fp32 offset; the 16-value fp32 code. int8: a byte a weight and an
    fp32 scale per output row. The constants live on the module, not in a parameter."""
    n = inputs * outputs
    if quant == "int8":
        return n, 4 * outputs
    blocks = -(-n // QUANT_BLOCK)
    code = 4 * 16
    if double_quant:
        return -(-n // 2), blocks + 4 * -(-blocks // NESTED_BLOCK) + 4 * 256 + 4 + code
    return -(-n // 2), 4 * blocks + code


def base_bytes(cfg, d: Dims, b: int) -> tuple[int, int]:
    """(base parameters + buffers, of which quantization constants): with
    model.quantization every linear of the decoder layers is stored quantized; the
    embeddings, lm_head and norms stay in the model dtype, and so do the quantized linears'
    biases, except under 4 bits: bitsandbytes' 4-bit forward casts its bias to the compute
    dtype for good (`Linear4bit.forward`), at the first forward (the packed-attention probe
    at load), so from then on it is held in that dtype."""
    quant = cfg.model.quantization
    if quant == "none":
        return d.params * b + d.buffer_bytes, 0
    stored = constants = quantized = biases = 0
    for inputs, outputs, bias in d.linears().values():
        weight, consts = quantized_linear_bytes(
            inputs, outputs, quant, cfg.model.quantization_double_quant
        )
        stored, constants = stored + weight, constants + consts
        quantized += inputs * outputs
        biases += outputs if bias else 0
    L = d.layers
    bias_b = b if quant == "int8" else compute_bytes(cfg, b)
    rest = (d.params - L * (quantized + biases)) * b + L * biases * bias_b + d.buffer_bytes
    return rest + L * (stored + constants), L * constants


def compute_bytes(cfg, b: int) -> int:
    setting = cfg.model.quantization_compute_dtype
    if cfg.model.quantization == "int8" or setting == "auto":
        return b
    return DTYPE_BYTES[setting]


def dequantized_bytes(cfg, d: Dims, b: int) -> int:
    """A quantized linear dequantizes its whole weight for each forward and backward: the
    largest one, in the weights' dtype and (if it differs) the compute dtype."""
    if cfg.model.quantization == "none":
        return 0
    largest = max(i * o for i, o, _ in d.linears().values())
    c = compute_bytes(cfg, b)
    return largest * (b + (c if c != b else 0))


# decoders whose layers inventory.py reads off (mistral's layer is llama's)
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "olmoe")


class PlanError(UserError):
    """The planner cannot count this model; the message names the field and the way out."""


def dims_from_json(config: dict, source: str = "config.json") -> Dims:
    """Dims from a config.json dict (a multimodal config's text_config when present)."""
    c = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    kind = c.get("model_type", "")
    if kind not in MODEL_TYPES:
        raise PlanError(
            f"{source}: model_type {kind!r} is not one leangrpo plan can count (it knows {', '.join(MODEL_TYPES)}); the trainer may still run it, but measure its memory instead."
        )
    missing = [
        k
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        if k not in c
    ]
    if missing:
        raise PlanError(
            f"{source}: {', '.join(missing)} missing; the file is not a complete decoder config."
        )
    heads = c["num_attention_heads"]
    bias = bool(c.get("attention_bias", False))
    return Dims(
        **_moe_dims(c, kind, source),
        vocab=c["vocab_size"],
        hidden=c["hidden_size"],
        intermediate=c["intermediate_size"],
        layers=c["num_hidden_layers"],
        heads=heads,
        kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        tied=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=True if kind == "qwen2" else bias,
        o_bias=False if kind == "qwen2" else bias,
        mlp_bias=bool(c.get("mlp_bias", False)),
        qk_norm=kind.startswith("qwen3") or kind == "olmoe",
        qk_norm_full=kind == "olmoe",
    )


def _moe_dims(c: dict, kind: str, source: str) -> dict:
    """The experts of a Qwen3-MoE or OLMoE config (every layer a mixture of experts)."""
    if kind not in ("qwen3_moe", "olmoe"):
        return {}
    sparse = c.get("decoder_sparse_step", 1)
    if c.get("mlp_only_layers") or sparse not in (None, 1):
        raise PlanError(
            f"{source}: some layers have a dense MLP (mlp_only_layers, decoder_sparse_step), which leangrpo plan does not count beside expert layers; measure its memory instead."
        )
    return {
        "experts": c.get("num_experts") or c["num_local_experts"],
        "top_k": c["num_experts_per_tok"],
        "expert_intermediate": c["moe_intermediate_size"] if kind == "qwen3_moe" else c["intermediate_size"],
        "norm_topk": bool(c.get("norm_topk_prob", False)),
    }


def model_dims(model_cfg) -> Dims:
    source = f"config.json of model.name_or_path = {model_cfg.name_or_path!r}"
    return dims_from_json(read_model_config(model_cfg), source)


def make_setup(cfg, device: str, kernel: str | None = None) -> Setup:
    b = model_bytes(cfg, device)
    lora = cfg.lora.enabled
    a = 4 if lora and b < 4 else b
    return Setup(
        b=b,
        lora=lora,
        adapted=adapted_linears(cfg.lora.target_modules) if lora else frozenset(),
        r=cfg.lora.r,
        a=a,
        dropout_mask=(0 if not (lora and cfg.lora.dropout > 0) else (1 if device == "cuda" else a)),
        kernel=kernel or attention_kernel(cfg.packing.attention_backend, device, b),
        keeps_inputs=cfg.model.quantization == "int8",
        adapts_experts=lora and cfg.lora.target_modules == "all-linear",
        replay=cfg.rollout.routing_replay,
        aux=cfg.train.router_aux_loss_coef > 0,
    )


def model_bytes(cfg, device: str) -> int:
    """model.dtype 'auto' is fp32 on CPU and bf16 (or fp16) on CUDA, as model.resolve_dtype."""
    if cfg.model.dtype == "auto":
        return 4 if device == "cpu" else 2
    return DTYPE_BYTES[cfg.model.dtype]


def plan_memory(
    cfg,
    tokens: int | None = None,
    dims: Dims | None = None,
    *,
    prompt_tokens: int | None = None,
    world_size: int = 1,
    kernel: str | None = None,
) -> dict[str, int]:
    """Bytes per device of each term in TERMS, and `total` (the peak); see the docstring.

    tokens: packed tokens per micro-batch (default train.micro_batch_tokens); prompt_tokens:
    the longest prompt (default data.max_prompt_tokens, else DEFAULT_PROMPT_TOKENS);
    world_size: torchrun ranks (FSDP shards by it); kernel: the attention path's memory class
    when known better than from the config (inventory.attention_kernel).
    """
    d = dims or model_dims(cfg.model)
    device = "cpu" if cfg.run.device == "cpu" else "cuda"
    s = make_setup(cfg, device, kernel)
    c = cfg.distributed.context_parallel_size
    world_size = planned_world(c, world_size)
    check_context_heads(c, d.heads, cfg.model.name_or_path)  # as train's preflight does
    row = tokens or cfg.train.micro_batch_tokens
    prompt = prompt_tokens or cfg.data.max_prompt_tokens or DEFAULT_PROMPT_TOKENS
    n = math.ceil(row / c)  # this rank's tokens of the row
    # the rank holding the completions: a row's completion tokens follow its prompt, so
    # one shard may hold completion tokens only (one long sequence: every later shard)
    rows = min(n, completion_rows(cfg, row, prompt, s.kernel))
    base, replicated = base_bytes(cfg, d, s.b)
    adapters = lora_params(d, s) * s.a
    trainable = adapters if s.lora else d.params * s.b
    tensors = lora_tensors(d, s) if s.lora else d.param_tensors
    shard = _sharding(cfg, d, s, world_size)
    weights = shard.weights(base - replicated) + replicated + adapters // shard.divisor
    hf = cfg.rollout.engine == "hf"
    head = _lm_head(cfg, d, s, rows, device)
    layer_grad = (
        lora_params(d, s) // d.layers * s.a if s.lora else d.layer_params * s.b
    ) // shard.divisor
    head_grad = 0 if s.lora else d.vocab * d.hidden * s.b // shard.divisor
    grads = (layer_grad, head_grad, trainable // shard.divisor)
    moments, host = _moments(cfg, context_dims(d, c), s, n, rows, head, grads, prompt, c)
    plan = {
        "weights": weights,
        "reference_copy": base if (cfg.loss.beta > 0 and not s.lora) else 0,
        "generation_copy": base + adapters
        if hf and (cfg.pipeline.mode == "async" or world_size > 1)
        else vllm_copy(cfg, base),
        "gradients": trainable // shard.divisor,
        "adamw_state": 2 * trainable // shard.divisor + (4 * tensors if device == "cpu" else 0),
        "activations": max(m.activations for m in moments),
        "lm_head": head,
        "all_to_all": all_to_all_bytes(d, c, n, s.b),
        "kv_cache": _kv_cache(cfg, d, s, prompt, world_size) if hf else 0,
        "offloaded_to_host": host,
        **_teacher(cfg, device, s.b, n, rows, world_size),
    }
    plan["teacher_in_step"] += _divergence_extra(cfg, d, s, rows, device, head)
    plan[TRAINING_PASS] = (
        max(m.total for m in moments) + plan["all_to_all"] + plan["teacher_in_step"]
    )
    if cfg.distill is not None and cfg.distill.objective == "jsd":  # in the step: gradients
        plan["teacher_scoring"] += plan["gradients"]
    plan["total"] = peak(plan, concurrent=hf and cfg.pipeline.mode == "async", cpu=device == "cpu")
    if sharing_blocker(cfg) is None:
        plan[SAVED_BY_SHARING] = base  # not a term: the copy colocated vLLM does not hold
    return plan


def planned_world(context_size: int, world_size: int) -> int:
    """The processes to plan for: at least one context group (C) when none was given."""
    if context_size == 1:
        return world_size
    if world_size == 1:
        return context_size
    if world_size % context_size:
        raise PlanError(
            f"distributed.context_parallel_size ({context_size}) does not divide the {world_size} processes planned for; pass --world-size as a multiple of {context_size}."
        )
    return world_size


def context_dims(d: Dims, context_size: int) -> Dims:
    """The decoder as one rank of a Ulysses group sees it per local token: attention holds
    the whole row for H / C query heads and lcm(K, C) / C key/value heads, i.e. per token
    the full query heads and lcm(K, C) key/value heads (replicated when K < C)."""
    if context_size == 1:
        return d
    return dataclasses.replace(d, kv_heads=math.lcm(d.kv_heads, context_size))


def all_to_all_bytes(d: Dims, context_size: int, tokens: int, b: int) -> int:
    """One layer's q/k/v exchange: the send and the receive buffer of this rank's `tokens`
    (key/value heads replicated to lcm(K, C)); 0 without context parallelism."""
    if context_size == 1:
        return 0
    kv = math.lcm(d.kv_heads, context_size) * d.head_dim
    return 2 * tokens * (d.heads * d.head_dim + 2 * kv) * b


def longest_micro_batch(
    cfg, memory_bytes: int, dims: Dims | None = None, *, prompt_tokens=None, world_size: int = 1
) -> int:
    """The most tokens one micro-batch (e.g. a single long sequence) may hold with the
    plan's total within `memory_bytes` per device (0: not even one token fits; capped at
    MAX_PLANNED_TOKENS)."""
    d = dims or model_dims(cfg.model)

    def fits(tokens: int) -> bool:
        plan = plan_memory(cfg, tokens, d, prompt_tokens=prompt_tokens, world_size=world_size)
        return plan["total"] <= memory_bytes

    low, high = 0, MAX_PLANNED_TOKENS
    if fits(high):
        return high
    while high - low > 1:  # fits(low) (or low = 0), not fits(high)
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


MAX_PLANNED_TOKENS = 1 << 24


def vllm_copy(cfg, base: int) -> int:
    """Colocated vLLM's own weights (in the trainer's dtype, as the engine is given it), or
    0: no colocated vLLM, or one that serves from the policy's tensors."""
    colocated = cfg.rollout.engine == "vllm" and cfg.rollout.vllm.mode == "colocate"
    return base if colocated and sharing_blocker(cfg) is not None else 0


def sharing_blocker(cfg) -> tuple[str, str] | None:
    """Why colocated vLLM keeps its own copy, as the start-up's checks before vLLM starts
    would say (rollout/vllm/precheck.py); ("", "") when sharing is off or does not apply
    (no colocated vLLM, share_weights false); None when they let it share."""
    v = cfg.rollout.vllm
    if cfg.rollout.engine != "vllm" or v.mode != "colocate" or v.share_weights is False:
        return ("", "")
    device = "cpu" if cfg.run.device == "cpu" else "cuda"
    return share_blocker(cfg, trainer_dtype_name(cfg.model.dtype, device))


def peak(plan: dict[str, int], concurrent: bool, cpu: bool) -> int:
    """Persistent terms + the largest phase (training pass, teacher scoring or generation),
    or generation at the same time as the larger of the other two."""
    persistent = sum(plan[k] for k in PERSISTENT)
    train = plan[TRAINING_PASS]
    train += plan["offloaded_to_host"] if cpu else 0  # host memory is the device's on CPU
    trainer = max(train, plan["teacher_scoring"])
    generation = plan["kv_cache"]
    return persistent + (trainer + generation if concurrent else max(trainer, generation))


def _teacher(cfg, device: str, b: int, tokens: int, rows: int, world_size: int) -> dict[str, int]:
    """teacher_weights and teacher_scoring (see the module docstring); 0 without one, and
    0 for a served teacher (distill.teacher_urls: its weights and pass are its servers')."""
    if cfg.distill is None or cfg.distill.served:
        return {"teacher_weights": 0, "teacher_scoring": 0, "teacher_in_step": 0}
    from types import SimpleNamespace

    distill = cfg.distill
    settings = SimpleNamespace(name_or_path=distill.teacher, revision=distill.teacher_revision)
    source = f"config.json of distill.teacher = {distill.teacher!r}"
    t = dims_from_json(read_model_config(settings), source)
    c = cfg.distributed.context_parallel_size  # its rows are split like the policy's
    check_context_heads(c, t.heads, distill.teacher, "distill.teacher")
    quantized = SimpleNamespace(
        model=SimpleNamespace(
            quantization=distill.teacher_quantization,
            quantization_double_quant=True,
            quantization_compute_dtype="auto",
        )
    )
    base, replicated = base_bytes(quantized, t, b)
    weights, gathered = base, 0
    sharded = world_size > 1 and cfg.distributed.sharding != "no_shard"
    if sharded:
        weights = (base - replicated) // world_size + replicated
        gathered = teacher_gathered(cfg, t, b)
    in_step = 0
    if distill.objective == "jsd":
        head_copy = t.vocab * t.hidden * b if sharded else 0
        gathered += head_copy
        in_step = rows * t.hidden * b + head_copy
    return {
        "teacher_weights": weights,
        "teacher_scoring": gathered + _teacher_pass(cfg, t, b, tokens, rows, device, quantized),
        "teacher_in_step": in_step,
    }


def teacher_gathered(cfg, t: Dims, b: int) -> int:
    """What the sharded teacher holds gathered at most during its pass, whatever
    distributed.sharding says (distributed/fsdp.py reshards its units after their forward
    always: a frozen teacher keeps nothing for a backward): its FSDP root (the final norm,
    and the embeddings when tied) for the whole pass, plus a decoder layer and the next
    one gathered ahead, or an untied embedding or head unit and a layer beside it."""
    quant = cfg.distill.teacher_quantization
    gathered_b = DTYPE_BYTES.get(cfg.distributed.param_dtype, b)
    layer = t.layer_params * gathered_b
    if quant != "none":  # the quantized storage is gathered as stored
        for i, o, _ in t.linears().values():
            stored, _ = quantized_linear_bytes(i, o, quant, True)
            layer += stored - i * o * gathered_b
    matrix = t.vocab * t.hidden * gathered_b
    root = t.hidden * gathered_b + (matrix if t.tied else 0)
    return root + (2 * layer if t.tied else max(2 * layer, matrix + layer))


def _divergence_extra(cfg, d: Dims, s: Setup, rows: int, device: str, head: int) -> int:
    """distill.objective: jsd: what its head (the student's log-probs, entropy and the
    divergence from both models' tiles) holds beyond `head`, the plain head's count in
    the lm_head term; 0 for any other objective."""
    if cfg.distill is None or cfg.distill.objective != "jsd":
        return 0
    tiles = None
    if cfg.logprobs.chunked:
        default_rows, default_vocab = DEFAULT_TILES[device]
        tiles = (cfg.logprobs.row_tile or default_rows, cfg.logprobs.vocab_tile or default_vocab)
    jsd = divergence_head_bytes(rows, d.hidden, d.vocab, s.b, tiles, not s.lora,
                                cfg.distill.jsd_beta)  # fmt: skip
    return max(0, jsd - head)


def _teacher_pass(cfg, t: Dims, b: int, tokens: int, rows: int, device: str, quantized) -> int:
    """A no-grad forward of `tokens` tokens through the teacher and its head on `rows`."""
    attention = (t.heads + 2 * t.kv_heads) * t.head_dim
    layer = tokens * b * (3 * t.hidden + attention + 3 * t.active_intermediate)
    gathered_rows = rows * t.hidden * b
    if cfg.logprobs.chunked:
        default_rows, default_vocab = DEFAULT_TILES[device]
        row_tile = min(cfg.logprobs.row_tile or default_rows, rows)
        vocab_tile = min(cfg.logprobs.vocab_tile or default_vocab, t.vocab)
        head = 3 * row_tile * vocab_tile * 4 + 3 * rows * 4
    else:
        head = 2 * rows * t.vocab * 4
    return layer + gathered_rows + head + dequantized_bytes(quantized, t, b)


def completion_rows(cfg, tokens: int, prompt: int, kernel: str = "segments") -> int:
    """Completion tokens (lm_head rows) among `tokens` packed tokens of whole sequences of a
    `prompt`-token prompt and max_new_tokens completion (the group's prompt laid once when
    the shared-prefix layout is chosen)."""
    new, group = cfg.rollout.max_new_tokens, cfg.rollout.num_generations
    if shared_prefix(cfg, prompt, kernel):
        return min(tokens, math.ceil(tokens * group * new / (prompt + group * new)))
    return min(tokens, math.ceil(tokens * new / (prompt + new)))


def shared_prefix(cfg, prompt: int, kernel: str) -> bool:
    """attention.choose_shared_prefix without torch: "on" where the kernel takes the layout
    (per-segment SDPA or flex), "auto" on per-segment SDPA only, for groups of >= 2 whose
    prompts are >= AUTO_MIN_PROMPT_FRACTION of the plainly packed tokens."""
    setting, group = cfg.packing.shared_prefix, cfg.rollout.num_generations
    if setting == "off" or kernel != "segments":
        return False
    if setting == "on":
        return True
    fraction = prompt / (prompt + cfg.rollout.max_new_tokens)
    return (
        cfg.packing.attention_backend in ("auto", "sdpa_segments")
        and fraction >= AUTO_MIN_PROMPT_FRACTION
        and group >= 2
    )


def lora_params(d: Dims, s: Setup) -> int:
    """Adapter parameters: r x (in + out) per adapted linear per layer; on a mixture of
    experts with 'all-linear', peft's per-weight adapters too: gate/up (rank 2r per expert:
    A (2r E, H), B (2 I, 2r E)), down (A (r E, I), B (H, r E)) and the router (A (r, H),
    B (E, r))."""
    shapes = d.linears()
    per_layer = sum(s.r * sum(shapes[n][:2]) for n in LINEARS if n in s.adapted and n in shapes)
    if d.experts and s.adapts_experts:
        E, H, I, r = d.experts, d.hidden, d.expert_intermediate, s.r  # noqa: E741
        per_layer += 2 * r * E * (H + 2 * I) + r * E * (I + H) + r * (H + E)
    return d.layers * per_layer


def lora_tensors(d: Dims, s: Setup) -> int:
    """Adapter tensors (A and B of each adapted weight)."""
    per_layer = 2 * len(s.adapted & set(d.linears()))
    return d.layers * (per_layer + (6 if d.experts and s.adapts_experts else 0))


@dataclass(frozen=True)
class _Shard:
    divisor: int  # of gradients, optimizer state (and parameters under full_shard)
    gathered: int  # bytes of unsharded parameters held at once besides the shards
    sharded_weights: bool

    def weights(self, base: int) -> int:
        return (base // self.divisor if self.sharded_weights else base) + self.gathered


def _sharding(cfg, d: Dims, s: Setup, world_size: int) -> _Shard:
    """FSDP2 (estimated): full_shard keeps 1/W of everything plus the layer being used and
    the next one gathered; shard_grad_op also keeps gathered layers from forward to
    backward (all of them); no_shard replicates parameters and shards nothing."""
    if world_size <= 1:
        return _Shard(1, 0, False)
    mode = cfg.distributed.sharding
    gathered_b = DTYPE_BYTES.get(cfg.distributed.param_dtype, s.b)
    layer = d.layer_params * gathered_b
    if cfg.model.quantization != "none":  # the quantized storage is gathered as stored
        for i, o, _ in d.linears().values():
            stored, _ = quantized_linear_bytes(i, o, cfg.model.quantization, True)
            layer += stored - i * o * gathered_b
    if mode == "full_shard":
        return _Shard(world_size, 2 * layer, True)
    if mode == "shard_grad_op":
        return _Shard(world_size, d.layers * layer, True)
    return _Shard(1, 0, False)


def _lm_head(cfg, d: Dims, s: Setup, rows: int, device: str) -> int:
    default_rows, default_vocab = DEFAULT_TILES[device]
    tiles = None
    if cfg.logprobs.chunked:
        tiles = (cfg.logprobs.row_tile or default_rows, cfg.logprobs.vocab_tile or default_vocab)
    filtered = cfg.rollout.top_k > 0 or cfg.rollout.min_p > 0
    return head_bytes(rows, d.hidden, d.vocab, s.b, tiles, not s.lora, filtered)


@dataclass(frozen=True)
class _Moment:
    """What the training pass holds at one moment, by kind."""

    activations: int
    gradients: int = 0
    head: int = 0

    @property
    def total(self) -> int:
        return self.activations + self.gradients + self.head


def _moments(
    cfg,
    d: Dims,
    s: Setup,
    n: int,
    rows: int,
    head: int,
    grads: tuple[int, int, int],
    prompt: int,
    context_size: int = 1,
) -> tuple[list[_Moment], int]:
    """(the training pass's candidate peaks, bytes offloaded to the host).

    The training pass peaks at one of: the head (every saved activation + the head's working
    set), a layer's backward (from the top: what is still saved, that layer's working set,
    and the gradients made so far), or the end (every gradient). `grads` = (per layer, the
    head weight's (made by the head's backward), all) in bytes per device. The activation
    term is the most any of them holds besides the gradients made by then and the head's
    working set, as benchmarks/context_parallel.py measures it; the pass's peak is the
    largest total. Context parallelism: `n` and `rows` are this rank's, `d` the
    `context_dims` (attention over the whole row for 1/C of the heads), the kernel's
    indices span the C shards' row."""
    L, mode = d.layers, cfg.offload.activations
    layer_grad, head_grad, all_grads = grads
    layer_input = n * s.b * d.hidden  # what checkpointing keeps of each layer
    rope = n * rotary_bytes(d, s, row_per_token=context_size)
    head_rest = n * final_norm_bytes(d, s) + rows * (s.b * d.hidden + LOSS_BYTES_PER_TOKEN)
    extra = n * backward_extra(d, s) + dequantized_bytes(cfg, d, s.b)  # + one weight
    # per layer beside its per-token terms: the shared-prefix layout's K and V, an MoE's
    per_layer = prefix_kv_bytes(cfg, d, s, n, prompt) + moe_layer_bytes(d, s)
    working = n * layer_saved(d, s) + per_layer + extra  # a recomputed layer's backward
    kept = L
    if mode == "hidden_states" and layer_input >= cfg.offload.min_tensor_bytes:
        kept = min(L, cfg.offload.keep_last_layers)
    host = (L - kept) * layer_input if mode == "hidden_states" else 0

    def saved_up_to(i: int) -> int:  # without checkpointing: layers 0..i keep everything
        return n * (layer_saved(d, s, first=True) + i * layer_saved(d, s)) + (i + 1) * per_layer

    def at_layer(i: int) -> int:
        if mode == "none" and not cfg.model.gradient_checkpointing:
            return saved_up_to(i) + rope + extra
        if mode == "all":
            return 2 * layer_input + rope + working
        on_device = max(0, i + 1 - (L - kept))  # kept inputs (the top layers) not yet used
        on_device += (
            min(2, i + 1) if i < L - kept else int(i == L - kept and i > 0)
        )  # restored, prefetched
        return on_device * layer_input + rope + working

    if mode == "none" and not cfg.model.gradient_checkpointing:
        before_head = saved_up_to(L - 1) + rope + head_rest
    elif mode == "all":
        host, before_head = L * layer_input + head_rest, rope
    else:
        before_head = kept * layer_input + rope + head_rest
    moments = [_Moment(before_head, head=head), _Moment(0, all_grads)]
    moments += [_Moment(at_layer(i), head_grad + (L - i) * layer_grad) for i in range(L)]
    return moments, host


def prefix_kv_bytes(cfg, d: Dims, s: Setup, tokens: int, prompt: int) -> int:
    """Per layer, what the shared-prefix layout saves beyond plain packing (estimated): the
    per-segment kernel gathers each completion's keys and values as [its group's prompt;
    its own tokens], so a prompt laid once is saved G times in K and V. The buckets' masks,
    indices and padding (a few % more, measured on CPU) are left out."""
    if not shared_prefix(cfg, prompt, s.kernel):
        return 0
    new, group = cfg.rollout.max_new_tokens, cfg.rollout.num_generations
    groups = tokens / (prompt + group * new)
    return math.ceil(groups * group * prompt * 2 * d.kv_heads * d.head_dim * s.b)


def _kv_cache(cfg, d: Dims, s: Setup, prompt: int, world_size: int) -> int:
    """The longest cache of one decode call: training generation or evaluation."""
    if cfg.environment is not None:
        return _turns_kv_cache(cfg, d, s, world_size)
    length = prompt + cfg.rollout.max_new_tokens - 1  # the last sampled token is never fed
    per_forward = cfg.rollout.hf_prompts_per_forward

    def rows(prompts: int, n: int, temperature: float) -> int:
        prompts = math.ceil(prompts / world_size)
        if per_forward is not None:
            prompts = min(prompts, per_forward)
        return prompts * (1 if temperature == 0 else n)  # greedy: one row, n copies

    train = rows(
        cfg.rollout.prompts_per_batch, cfg.rollout.num_generations, cfg.rollout.temperature
    )
    evaluation = 0
    if cfg.eval.every_steps > 0:
        evaluation = rows(eval_prompts(cfg), cfg.eval.num_generations, cfg.eval.temperature)
    return kv_cache_bytes(d, max(train, evaluation), length, s.b)


def _turns_kv_cache(cfg, d: Dims, s: Setup, world_size: int) -> int:
    """Multi-turn (rollout/hf/turns.py): rollout.kv_cache_tokens positions, or with no bound
    every trajectory of a call keeping its cache, each at most environment.max_total_tokens
    (rounded up to the slot cache's width step); K and V per layer in the model dtype."""
    positions = cfg.rollout.kv_cache_tokens
    if positions is None:
        width = -(-cfg.environment.max_total_tokens // SLOT_WIDTH_STEP) * SLOT_WIDTH_STEP
        train = cfg.rollout.prompts_per_batch * cfg.rollout.num_generations
        evaluation = 0
        if cfg.eval.every_steps > 0:
            evaluation = eval_prompts(cfg) * cfg.eval.num_generations
        positions = math.ceil(max(train, evaluation) / world_size) * width
    return 2 * d.layers * positions * d.kv_heads * d.head_dim * s.b


SLOT_WIDTH_STEP = 64  # rollout/hf/turns.py grows its rows' width in steps of this many


def eval_prompts(cfg) -> int:
    """eval.num_prompts, else data.eval_size, else the lines of a local eval .jsonl (0 when
    unknown: a hub split is not read here)."""
    if cfg.eval.num_prompts:
        return cfg.eval.num_prompts
    if cfg.data.eval_size:
        return cfg.data.eval_size
    path = Path(cfg.data.eval_path or "")
    if path.suffix == ".jsonl" and path.is_file():
        return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    return 0


def planned_prompt_tokens(cfg, prompt_tokens: int | None = None) -> tuple[int, str]:
    """The longest prompt to plan for, and where that figure comes from: `prompt_tokens`
    (--prompt-tokens), else data.max_prompt_tokens, else DEFAULT_PROMPT_TOKENS cut to the
    room the model's context (and a multi-turn trajectory's budget) leaves a prompt. A
    given length that cannot fit is refused: a plan for sequences the model cannot hold
    would be a figure for a run that never starts."""
    context, source = context_length(read_model_config(cfg.model))
    new = cfg.rollout.max_new_tokens
    rooms = []
    if context is not None:
        rooms.append((context - new, f"the model's {context} positions ({source}) less rollout.max_new_tokens = {new}"))
    if cfg.environment is not None:
        total = cfg.environment.max_total_tokens
        rooms.append((total - new, f"environment.max_total_tokens = {total} less rollout.max_new_tokens = {new}"))
    room, why = min(rooms, default=(None, ""))
    given = prompt_tokens or cfg.data.max_prompt_tokens
    if given is not None:
        where = "--prompt-tokens" if prompt_tokens else "data.max_prompt_tokens"
        if room is not None and given > room:
            raise PlanError(
                f"{where} = {given} does not fit: prompts can have at most {max(room, 0)} tokens ({why}); plan with --prompt-tokens {max(room, 1)} or less, or a model with a longer context."
            )
        return given, where
    if room is not None and room < DEFAULT_PROMPT_TOKENS:
        if room < 1:
            raise PlanError(f"no prompt fits: {why} leaves {room} tokens; lower rollout.max_new_tokens.")
        return room, f"the longest that fits: {why}"
    return DEFAULT_PROMPT_TOKENS, "the default (neither --prompt-tokens nor data.max_prompt_tokens given)"


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _sharing_note(plan: dict[str, int], cfg) -> list[str]:
    """What the generation copy assumes about colocated vLLM sharing the weights."""
    saved = plan.get(SAVED_BY_SHARING)
    if saved:
        gib = saved / 2**30
        return [
            f"  generation_copy is 0 if sharing holds at start-up: colocated vLLM then serves from the policy's weights (rollout.vllm.share_weights), which saves {gib:.3f} GiB",
            f"    (checked once vLLM runs: its engine core and worker in this process, a vLLM version sharing is tested with, a layout the policy can view; where one fails, share_weights auto keeps two copies, {gib:.3f} GiB more, and true stops)",
        ]
    why = sharing_blocker(cfg)[0] if cfg is not None else ""
    return [f"  generation_copy: colocated vLLM keeps its own copy, because {why}"] if why else []


def render_plan(
    plan: dict[str, int],
    cfg=None,
    tokens: int | None = None,
    prompt_tokens: int | None = None,
    world_size: int = 1,
    prompt_source: str = "",
    memory_gib: float | None = None,
) -> str:
    """The terms in GiB, the total and how it is made of them, and (given the config) what
    the figure assumes. `prompt_source`: where the prompt length came from
    (planned_prompt_tokens); with `memory_gib`, the longest micro-batch that fits that much
    per device."""
    lines = ["memory plan (per device, one micro-batch):"]
    cpu = cfg is None or cfg.run.device == "cpu"
    if cfg is not None:
        n = tokens or cfg.train.micro_batch_tokens
        prompt = prompt_tokens or cfg.data.max_prompt_tokens or DEFAULT_PROMPT_TOKENS
        device = "cpu" if cfg.run.device == "cpu" else "cuda"
        rows = completion_rows(cfg, n, prompt, make_setup(cfg, device).kernel)
        c = cfg.distributed.context_parallel_size
        world_size = planned_world(c, world_size)
        lines[0] = (
            f"memory plan (per device, {device}, one micro-batch of {n} tokens, {rows} completion rows, prompts of {prompt} tokens"
            + (f", {world_size} ranks" if world_size > 1 else "")
            + (f", each row split over {c} context-parallel ranks" if c > 1 else "")
            + (f", {cfg.model.quantization} base" if cfg.model.quantization != "none" else "")
            + "):"
        )
        if prompt_source:
            lines.append(f"  prompts of {prompt} tokens: {prompt_source}")
    width = max(len(k) for k in plan)
    for key, value in plan.items():
        if key in (SAVED_BY_SHARING, TRAINING_PASS):
            continue
        note = "  (host memory)" if key == "offloaded_to_host" and value else ""
        lines.append(f"  {key:<{width}}  {value / 2**30:8.3f} GiB{note}")
    concurrent = cfg is not None and cfg.rollout.engine == "hf" and cfg.pipeline.mode == "async"
    lines += explain_total(plan, concurrent, cpu)
    lines.extend(_sharing_note(plan, cfg))
    if cfg is not None and cfg.served_teacher():
        lines.append(
            f"  teacher_weights and teacher_scoring are 0: the teacher is served (distill.teacher_urls, {len(cfg.distill.teacher_urls)} server(s)); its weights and scoring pass are in the servers' memory, not this device's"
        )
    if cfg is not None and cfg.run.device == "cpu":
        lines.append(
            f"  + the process itself (python, torch, transformers, peft imported): about {PROCESS_BASELINE_CPU / 2**30:.2f} GiB of RSS, not in the total"
        )
    if cfg is not None and memory_gib is not None:
        longest = longest_micro_batch(
            cfg, int(memory_gib * 2**30), prompt_tokens=prompt_tokens, world_size=world_size
        )
        at_least = "at least " if longest == MAX_PLANNED_TOKENS else ""
        lines.append(
            f"longest micro-batch (one sequence, or several packed) that fits {memory_gib:g} GiB per device: {at_least}{longest} tokens"
            + (" (none fits: the weights alone exceed it)" if longest == 0 else "")
        )
    return "\n".join(lines)


def explain_total(plan: dict[str, int], concurrent: bool, cpu: bool) -> list[str]:
    """How `total` is made of the lines above it (peak()): the persistent terms plus the
    larger of the two phases, which never hold their memory at the same time (or both,
    when an async hf producer generates while the trainer trains)."""
    gib = lambda value: f"{value / 2**30:.3f}"  # noqa: E731
    persistent = [k for k in PERSISTENT if plan[k]]
    parts = [k for k in ("gradients", "activations", "lm_head", "all_to_all") if plan[k]]
    train = [f"at its peak, at most {' + '.join(parts) or '0'}"]
    if cpu and plan["offloaded_to_host"]:
        train.append("offloaded_to_host")
    fixed = sum(plan[k] for k in persistent)
    training = plan[TRAINING_PASS] + (plan["offloaded_to_host"] if cpu else 0)
    if plan["teacher_scoring"] > training:  # the teacher's pass is the trainer's larger phase
        train, training = (
            ["teacher_scoring (the teacher's pass, larger than the training pass)"],
            plan["teacher_scoring"],
        )
    generation = plan["kv_cache"]
    first = f"  total = {' + '.join(persistent) or '0'} ({gib(fixed)}, held all run)"
    if concurrent:
        return [
            first,
            f"          + the training pass ({' + '.join(train)}: {gib(training)}) + generation (kv_cache: {gib(generation)}), at the same time: the async hf producer generates while the trainer trains",
        ]
    larger = "the training pass" if training >= generation else "generation"
    host = [] if cpu or not plan["offloaded_to_host"] else [
        "  offloaded_to_host is host memory, not the device's: not in the total"
    ]  # fmt: skip
    return host + [
        first,
        f"          + the larger of the training pass ({' + '.join(train) or '0'}: {gib(training)}) and generation (kv_cache: {gib(generation)}), which never overlap: {larger}",
    ]
