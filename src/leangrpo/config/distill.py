"""The config section of on-policy distillation: `distill` (absent: no teacher).

A frozen teacher (same tokenizer as the policy) scores every sampled token in the packed
scoring pass that computes reference log-probs, and its log-probs become a dense, per-token
signal (distill/). The section's first docstring line is what docs/config.md shows: the
objective written out. Its rules across sections (sampling filters, pure distillation
without reward functions, re-rolls and replay that need reward variance) live on
`Config` in root.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from leangrpo.config.base import Section

TEACHER_QUANTIZATIONS = ("none", "nf4", "int8")


class DistillConfig(Section):
    """On-policy distillation: the policy samples, a frozen teacher scores every sampled model token y_t (one more no-grad pass in the packed scoring machinery, like the reference's), and the policy-gradient loss (loss.type, its clipping and IS correction) takes a per-token advantage A_t = A_reward(sequence) + distill.weight * D_t, with r_t = -(log p_student(y_t) - log p_teacher(y_t)) the sampled reverse-KL reward (log p_student: the old log-probs, i.e. the policy that sampled, as the ratio's denominator; both log-probs of the temperature-scaled distributions, unfiltered) and D_t = sum over the later model tokens k >= t of the same sequence of distill.discount^(k - t) * r_k (discount 0: D_t = r_t). A_reward is the usual group-normalised reward advantage; with no reward functions (rewards.functions: []) it is 0 and the run is pure distillation, which needs no reward function at all. Multi-turn trajectories: the model's tokens only (environment tokens are context)."""

    teacher: str = Field(
        ...,
        min_length=1,
        description="The teacher model: a local directory or a hub id, loaded frozen (eval mode, no gradient) in model.dtype. Its tokenizer must map every id to the same token as the policy's (checked before anything loads; the first differing token is named), and its vocabulary (lm_head rows) must cover the policy's.",
    )
    teacher_revision: str | None = Field(
        None,
        description="Hub revision (branch, tag or commit) of distill.teacher; null = the default branch.",
    )
    teacher_quantization: Literal["none", "nf4", "int8"] = Field(
        "none",
        description="Load the teacher quantized with bitsandbytes, through the QLoRA loading path (`pip install 'leangrpo[qlora]'`): 'nf4' (4-bit, blocks of 64 weights, double quantization) or 'int8' (LLM.int8). Its decoder's linears are quantized; the embeddings, the lm_head and the norms stay in model.dtype, so its log-probs go through the same chunked lm_head. 'none' = full precision.",
    )
    objective: Literal["sampled"] = Field(
        "sampled",
        description="'sampled': the reverse KL estimated on the sampled token, as a per-token advantage (the section's formula).",
    )
    weight: float = Field(
        1.0,
        gt=0,
        le=1000,
        description="Weight of the distillation advantage D_t against the reward advantage (whose own scale is the reward functions' weights).",
    )
    discount: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Discount of the later tokens' reverse-KL rewards in D_t along the sequence (model tokens only): 0 = each token's own log-ratio, 1 = the sum over the rest of the sequence.",
    )
