"""What one training pass keeps alive, in bytes per token: the inventory behind `leangrpo plan`.

Read off the code paths the trainer runs (transformers' Llama / Qwen2 / Qwen3 decoder
layers, peft's LoRA Linear, leangrpo's attention kernels, chunked log-probs and loss) and
checked on CPU against the tensors autograd really saves (tests/planner/test_plan_measured.py).
Notation per token: H hidden, A = heads x head_dim (queries), K = kv_heads x head_dim,
I intermediate, r LoRA rank, b bytes of the model dtype, a bytes of the adapters.

Saved for backward by one decoder layer (exact, given the flags of `Setup`):
- RMSNorm: its input in fp32 (a copy when b < 4) and the (N, 1) rsqrt, when its input needs
  a gradient (not layer 0's first norm under LoRA: the frozen embeddings need none); plus
  the normalised input in b when its weight trains (full fine-tuning).
- The input X of a linear: once, in b, when the base weight trains, or when LoRA adapts it
  and uses X as is (adapters in the model dtype, no dropout), or when the base is int8
  (bitsandbytes' int8 matmul holds its input itself; a 4-bit base layer saves nothing). peft keeps adapters in fp32
  when the base is bf16/fp16 (`autocast_adapter_dtype=True`) and casts X to fp32 for each
  adapted linear: one fp32 copy per adapter (q, k and v each copy the same input). With
  lora.dropout > 0 each adapter saves its dropped-out input (a) and the mask (a bool mask
  on CUDA's fused dropout, a mask in a on CPU, where dropout is a multiply).
  Each adapter also saves its (N, r) down-projection, in a.
- Attention: q and k after rotary, v, the kernel's output (A) and its log-sum-exp (fp32,
  one per head); the per-segment SDPA and flex kernels return a transposed output that is
  copied once more before o_proj, the varlen kernels (flash, torch) do not.
- MLP: gate output, its SiLU and the up output (3 I in b), and the product, down's input.
Outside the layers: rotary cos and sin (2 x head_dim in b, shared by every layer) and the
per-segment kernel's two int64 token indices, the
final norm, the (T, H) hidden rows gathered for the lm_head, and the loss's per-token
vectors (estimated, LOSS_BYTES_PER_TOKEN). Tensors the batch already holds (ids,
positions, indices) are not counted.

Backward working set of one layer (`backward_extra`): what a layer's backward allocates
beyond its saved tensors at its worst moment, measured on CPU (the same autograd graph
runs on CUDA): the gradient flowing in, the MLP's (N, I) gradients, and under LoRA with
fp32 adapters their fp32 gradients. An estimate, within a few % of the measured peaks.
"""

from __future__ import annotations

from dataclasses import dataclass

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTN_IN, MLP_IN = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
LOSS_BYTES_PER_TOKEN = 32  # the loss's (T,) vectors saved for backward: a bound from above


@dataclass(frozen=True)
class Setup:
    """The switches the inventory depends on."""

    b: int  # bytes per element of the model dtype
    lora: bool
    adapted: frozenset[str]  # the LoRA-adapted linears of each layer (empty: full FT)
    r: int
    a: int  # bytes per adapter element
    dropout_mask: int  # bytes per element of a LoRA dropout mask (0: no dropout)
    kernel: str  # "varlen" | "varlen_repeat_kv" | "segments" (see attention_kernel)
    # bitsandbytes' int8 matmul keeps each linear's input itself (a ctx attribute, beside
    # autograd's saved tensors): counted once per input as when the base weight trains
    keeps_inputs: bool = False
    # mixtures of experts: LoRA on the experts and router (peft's 'all-linear': a
    # ParamWrapper per weight), routing replay, the router's aux loss
    adapts_experts: bool = False
    replay: bool = False
    aux: bool = False

    @property
    def cast(self) -> bool:
        """peft casts each adapter's input to the adapter dtype (a copy)."""
        return self.lora and self.a != self.b


def adapted_linears(target_modules) -> frozenset[str]:
    """peft's 'all-linear' is every linear but the head; a list names modules by suffix."""
    if target_modules == "all-linear":
        return frozenset(LINEARS)
    return frozenset(n for n in LINEARS if any(n == t or n.endswith(t) for t in target_modules))


def attention_kernel(backend: str, device: str, b: int) -> str:
    """The attention path's memory class: varlen kernels need bf16/fp16 on CUDA (fp32 falls
    back to per-segment SDPA); 'auto' on CPU is per-segment SDPA. torch_varlen without
    enable_gqa (older torch) would repeat K and V: pass "varlen_repeat_kv" explicitly."""
    if device == "cpu" or b == 4:
        return "segments"
    return "segments" if backend in ("sdpa_segments", "flex") else "varlen"


def _norm(s: Setup, width: int, input_grad: bool) -> int:
    saved = 4 * width + 4 if input_grad else 0  # fp32 input, (N, 1) rsqrt
    return saved + (0 if s.lora else s.b * width)  # normalised input, for the weight's grad


def _inputs(s: Setup, width: int, consumers: tuple[str, ...], input_grad: bool = True) -> int:
    """Bytes per token saved for the linears reading one input of `width` features (a
    dropout mask only matters, and is only saved, when the input needs a gradient)."""
    if not s.lora:
        return s.b * width
    adapted = [c for c in consumers if c in s.adapted]
    shared = (bool(adapted) and not s.cast and not s.dropout_mask) or s.keeps_inputs
    out = s.b * width if shared else 0
    for _ in adapted:
        if s.dropout_mask:
            out += (s.a + (s.dropout_mask if input_grad else 0)) * width  # dropped input, mask
        elif s.cast:
            out += s.a * width
        out += s.a * s.r  # lora_A's output, read by lora_B
    return out


def layer_saved(d, s: Setup, first: bool = False) -> int:
    """Bytes per token one decoder layer saves for backward (`first`: layer 0)."""
    H, A, K, b = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim, s.b
    grad_in = not (s.lora and first)  # under LoRA layer 0's input needs no gradient
    attn = _norm(s, H, grad_in) + _inputs(s, H, ATTN_IN, grad_in)
    if d.qk_norm:  # RMSNorm on q and k before rotary: per head, or (OLMoE) over each whole
        rsqrt = 2 if d.qk_norm_full else d.heads + d.kv_heads
        attn += 4 * (A + K) + 4 * rsqrt + (0 if s.lora else b * (A + K))
    kv = 2 * b * A if s.kernel == "varlen_repeat_kv" else 2 * b * K  # k after rotary, v
    attn += b * A + kv + b * A + 4 * d.heads  # q after rotary, k, v, output, log-sum-exp
    o_in = _inputs(s, A, ("o_proj",))
    plain = not s.lora or s.keeps_inputs or not (s.cast or s.dropout_mask)
    if s.kernel != "segments" and o_in >= b * A and plain:
        o_in -= b * A  # o_proj reads the kernel's own output: already counted
    if d.experts:
        return attn + o_in + _norm(s, H, input_grad=True) + moe_saved(d, s)
    mlp = _norm(s, H, input_grad=True) + _inputs(s, H, MLP_IN) + 3 * b * d.intermediate
    return attn + o_in + mlp + _inputs(s, d.intermediate, ("down_proj",))


def moe_saved(d, s: Setup) -> int:
    """Bytes per token a mixture-of-experts block saves (transformers' grouped_mm experts):
    its input when router or experts train; the router's fp32 probabilities (E), the k
    chosen indices (int64), with renormalised weights their sum and the k weights (fp32);
    the sort of the N k (token, expert) pairs (the permutation, sorted ids, the inverse:
    int64); per pair, in b, the gate/up output (2 I), the activation's inputs (I each, of
    which the product feeding down_proj only when experts train), the gate weight and the
    down output (H); with training experts, also each pair's gathered input (H). Replay
    recomputes the weights over the recorded experts from the same logits (the router's
    own weights are dropped with what they saved, but for its fp32 probabilities: E more,
    measured). The aux loss keeps the fp32 probabilities once more. Active experts only: k, never E, per token. `MOE_LAYER_BYTES`
    per layer beside it (the int32 group offsets)."""
    E, k, I, H, b = d.experts, d.top_k, d.expert_intermediate, d.hidden, s.b  # noqa: E741
    trains = not s.lora or s.adapts_experts
    weights = 4 * E + 8 * k + (4 + 4 * k if d.norm_topk else 0)
    out = weights + 24 * k + b * k * (3 * I + 1 + H)
    if trains:
        out += b * H + b * k * (H + I)
    if s.replay:
        out += 4 * E
    if s.aux:
        out += 4 * E
    return out


def moe_layer_bytes(d, s: Setup) -> int:
    """Per MoE layer, beside the per-token terms: the experts' int32 group offsets, and
    with LoRA on the experts the merged weights each ParamWrapper keeps for backward
    (router E x H, gate/up and down E x 3 H I; estimated in the adapters' dtype)."""
    if not d.experts:
        return 0
    merged = d.moe_params * s.a if s.lora and s.adapts_experts else 0
    return 4 * d.experts + merged


def rotary_bytes(d, s: Setup, row_per_token: int = 1) -> int:
    """Per token, what one forward builds once for every layer: rotary cos and sin, (N,
    head_dim) each in the model dtype, and with the per-segment kernel the batched SDPA's two
    int64 token indices (into the buckets and back). Under checkpointing the layers' frames
    hold them rather than autograd's saved tensors: alive all the same. `row_per_token`:
    the kernel's row per local token (context parallelism: C, its kernel runs on the
    whole row of C shards)."""
    return 2 * d.head_dim * s.b + (16 * row_per_token if s.kernel == "segments" else 0)


def final_norm_bytes(d, s: Setup) -> int:
    return _norm(s, d.hidden, input_grad=True)


def backward_extra(d, s: Setup) -> int:
    """Bytes per token one layer's backward holds beyond its saved tensors (estimate; a
    mixture of experts: the k active experts' width)."""
    H, I, b = d.hidden, d.active_intermediate, s.b  # noqa: E741
    g = 4 if s.cast else b  # gradients through fp32 adapters are fp32
    extra = b * H + g * I + b * I + 4 * H
    if d.experts:  # the (token, expert) pairs' gradients: gathered input, down output, gate/up
        extra += b * d.top_k * (2 * H + 2 * d.expert_intermediate) + 4 * d.experts
    return extra


def head_bytes(
    rows: int,
    hidden: int,
    vocab: int,
    b: int,
    tiles: tuple[int, int] | None,
    weight_grad: bool,
    filtered: bool = False,
) -> int:
    """Peak extra bytes of the log-prob head (forward, then backward, with entropy) over
    `rows` completion rows of hidden (its input: counted with the activations).

    Chunked (`tiles` = (row_tile, vocab_tile)): at worst three fp32 tiles are alive (forward:
    a tile's logits and exponentials while the next tile's logits or the entropy product
    are made; backward: the previous tile's gradient, this tile's logits and
    probabilities), plus in backward the previous gradient's copy in b for the matmuls
    when b < 4, and two bool tiles when a top-k / min-p filter is on. Then the gradients:
      rows outer:  hidden's gradient (N, H) in b, one row tile's fp32 accumulator and its
                   matmul's output in b (when b < 4); a trained weight's fp32 (V, H)
                   gradient (converted to b at the end when b < 4);
      vocab outer (a trained bf16/fp16 weight and N < V): an fp32 (N, H) hidden gradient,
                   an fp32 (vocab_tile, H) weight tile, the (V, H) gradient in b;
    and the (N,) fp32 vectors: log-probs, entropy, log-normaliser (+ the filter threshold)
    and, in backward, their two incoming gradients. Full logits (`tiles` None): measured
    FULL_LOGITS_BYTES per (row, vocab) element (the (N, V) logits in fp32, scaled,
    log-softmaxed, their exponentials and gradients), plus the vectors.
    """
    vectors = rows * 4 * (5 + filtered)
    if tiles is None:
        return rows * vocab * FULL_LOGITS_BYTES + vectors + rows * hidden * b
    row_tile, vocab_tile = min(tiles[0], rows), min(tiles[1], vocab)
    tile = row_tile * vocab_tile
    lower = b if b < 4 else 0  # a copy in the model dtype exists only when it differs
    tiles_bytes = (3 * 4 + 2 * filtered) * tile
    matmul_out = row_tile * hidden * lower
    if weight_grad and lower and rows < vocab:  # vocabulary outer
        grads = rows * hidden * 4 + vocab_tile * hidden * 4 + vocab * hidden * b
        end = rows * hidden * (4 + b) + vocab * hidden * b
    else:
        weight = vocab * hidden * 4 if weight_grad else 0
        grads = rows * hidden * b + row_tile * hidden * 4 + weight
        end = rows * hidden * b + weight + (vocab * hidden * b if weight_grad and lower else 0)
    backward = tiles_bytes + lower * tile + matmul_out + grads
    return vectors + max(backward, end)


# bytes per (row, vocab) element at the full-logits path's peak (measured on CPU, fp32 and
# bf16 alike: the logits are upcast to fp32 at once)
FULL_LOGITS_BYTES = 20


def divergence_head_bytes(
    rows: int,
    hidden: int,
    vocab: int,
    b: int,
    tiles: tuple[int, int] | None,
    weight_grad: bool,
    beta: float,
) -> int:
    """Peak extra bytes of distill.objective: jsd's head (ops/logprobs/divergence.py, the
    student's log-probs, entropy and the divergence in one sweep, forward then backward)
    over `rows` rows of the student's hidden (width `hidden`) against the teacher's
    hidden rows (their own term), `vocab` the student's rows of the head.

    Chunked (`tiles`): each tile pair is consumed where it is made, so at most three fp32
    tiles are alive (beta 0 or 1: forward, both models' logits and one exponential;
    backward, the two tiles and the entropy term) or four (0 < beta < 1: the mixture's
    log m and one difference beside them), plus the gradient tile's copy in b when b < 4.
    Rows outer always: hidden's gradient (N, H) in b, a row tile's accumulator (and its
    matmul's output in b when b < 4), a trained weight's (V, H) gradient in fp32 (its
    (vocab_tile, H) matmul output in b when b < 4, and at the end its copy in b); and
    DIVERGENCE_VECTORS (N,) fp32 vectors (outputs, the four saved, incoming gradients).
    Full logits (`tiles` None): DIVERGENCE_FULL_LOGITS_BYTES per (row, vocab) element.
    Checked against the allocations of the real kernel: tests/planner/test_plan_divergence.py.
    """
    acc = 8 if b == 8 else 4  # float64 students accumulate in float64
    vectors = rows * acc * DIVERGENCE_VECTORS
    if tiles is None:
        return rows * vocab * DIVERGENCE_FULL_LOGITS_BYTES + vectors + rows * hidden * b
    row_tile, vocab_tile = min(tiles[0], rows), min(tiles[1], vocab)
    tile = row_tile * vocab_tile
    lower = b if b < 4 else 0  # copies in the model dtype exist only when it differs
    alive = (4 if 0.0 < beta < 1.0 else 3) * acc * tile + lower * tile
    grads = rows * hidden * b + row_tile * hidden * (acc + lower)
    if weight_grad:
        grads += vocab * hidden * acc + vocab_tile * hidden * lower
    end = rows * hidden * b + (vocab * hidden * (acc + lower) if weight_grad else 0)
    return vectors + max(alive + grads, end)


# the jsd head's (N,) vectors alive at once (about 10 measured, 12 counted), and its
# full-logits path's bytes per (row, vocab) element (both models' logits, log-softmaxes,
# exponentials and the mixture's: measured on CPU 32 for beta 0 / 1 and 36 between in
# fp32, about half in bf16)
DIVERGENCE_VECTORS = 12
DIVERGENCE_FULL_LOGITS_BYTES = 36


def kv_cache_bytes(d, rows: int, length: int, b: int) -> int:
    """transformers' DynamicCache after `length` positions: K and V per layer, (rows,
    kv_heads, length, head_dim) in the model dtype, plus one layer's K while
    `torch.cat` grows it (the old and the new tensor coexist)."""
    per_layer = rows * length * d.kv_heads * d.head_dim * b
    return 2 * d.layers * per_layer + per_layer
