"""`leangrpo plan`: a memory estimate from the model's config.json alone.

Counts what lives on the accelerator during a training micro-batch: weights (plus a frozen
reference copy when training all weights with beta > 0), trainable gradients and AdamW
state, activations (with and without checkpointing and offload), the lm_head working set
(chunked tiles vs full (T, V) logits), and the generation KV cache of the hf engine. The
activation coefficients are the usual per-layer counts for a pre-norm decoder (about
8 hidden-sized and 3 intermediate-sized tensors saved per token per layer); treat the
result as a planning figure, not a promise.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}


@dataclass
class Dims:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool

    @property
    def layer_params(self) -> int:
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        return q_o + k_v + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return embed + self.layers * self.layer_params + self.hidden


def model_dims(model_cfg) -> Dims:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(
        model_cfg.name_or_path,
        revision=model_cfg.revision,
        trust_remote_code=model_cfg.trust_remote_code,
    )
    c = getattr(c, "text_config", None) or c
    heads = c.num_attention_heads
    return Dims(
        vocab=c.vocab_size,
        hidden=c.hidden_size,
        intermediate=c.intermediate_size,
        layers=c.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        tied=bool(getattr(c, "tie_word_embeddings", False)),
    )


def lora_params(d: Dims, r: int) -> int:
    """LoRA on every linear of every layer (the 'all-linear' default)."""
    q_o = 2 * r * (d.hidden + d.heads * d.head_dim)
    k_v = 2 * r * (d.hidden + d.kv_heads * d.head_dim)
    mlp = 3 * r * (d.hidden + d.intermediate)
    return d.layers * (q_o + k_v + mlp)


def plan_memory(cfg, tokens: int | None = None, dims: Dims | None = None) -> dict[str, int]:
    d = dims or model_dims(cfg.model)
    b = DTYPE_BYTES[cfg.model.dtype]
    n = tokens or cfg.train.micro_batch_tokens
    completion = min(n, cfg.rollout.max_new_tokens * cfg.rollout.num_generations)
    trainable = lora_params(d, cfg.lora.r) if cfg.lora.enabled else d.params
    per_layer_full = n * (8 * d.hidden + 3 * d.intermediate) * b
    layer_input = n * d.hidden * b
    plan = {
        "weights": d.params * b,
        "reference_copy": d.params * b if (cfg.loss.beta > 0 and not cfg.lora.enabled) else 0,
        "gradients": trainable * b,
        "adamw_state": 2 * trainable * b,
        "activations": _activations(cfg, d, per_layer_full, layer_input),
        "lm_head": _lm_head(cfg, d, completion),
        "kv_cache_generation": _kv_cache(cfg, d, b),
    }
    plan["total"] = sum(plan.values())
    return plan


def _activations(cfg, d: Dims, per_layer_full: int, layer_input: int) -> int:
    if cfg.offload.activations == "all":
        return per_layer_full  # one layer's working set; the rest lives in host memory
    if not cfg.model.gradient_checkpointing and cfg.offload.activations == "none":
        return d.layers * per_layer_full
    on_device = d.layers
    if cfg.offload.activations == "hidden_states":
        on_device = min(d.layers, cfg.offload.keep_last_layers)
    return on_device * layer_input + per_layer_full


def _lm_head(cfg, d: Dims, completion_tokens: int) -> int:
    if cfg.logprobs.chunked:
        from leangrpo.logprobs import DEFAULT_TILES

        default_rows, default_vocab = DEFAULT_TILES["cpu" if cfg.run.device == "cpu" else "cuda"]
        rows = min(cfg.logprobs.row_tile or default_rows, completion_tokens)
        cols = min(cfg.logprobs.vocab_tile or default_vocab, d.vocab)
        return 3 * rows * cols * 4 + 2 * completion_tokens * 4
    return 3 * completion_tokens * d.vocab * 4  # logits, log-softmax, their gradient (fp32)


def _kv_cache(cfg, d: Dims, b: int) -> int:
    if cfg.rollout.engine != "hf":
        return 0  # vLLM sizes its own cache with gpu_memory_utilization
    seqs = cfg.rollout.prompts_per_batch * cfg.rollout.num_generations
    length = (cfg.data.max_prompt_tokens or 512) + cfg.rollout.max_new_tokens
    return 2 * d.layers * seqs * length * d.kv_heads * d.head_dim * b


def render_plan(plan: dict[str, int]) -> str:
    width = max(len(k) for k in plan)
    lines = [f"{k:<{width}}  {v / 2**30:10.3f} GiB" for k, v in plan.items()]
    return "\n".join(["memory plan (per device, one micro-batch):", *lines])
