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

from pydantic import Field, model_validator

from leangrpo.config.base import Section
from leangrpo.config.io import rule_error

TEACHER_QUANTIZATIONS = ("none", "nf4", "int8")


class DistillConfig(Section):
    """On-policy distillation: the policy samples, a frozen teacher scores every sampled model token y_t (one more no-grad pass in the packed scoring machinery, like the reference's), and the policy-gradient loss (loss.type, its clipping and IS correction) takes a per-token advantage A_t = A_reward(sequence) + distill.weight * D_t, with r_t = -(log p_student(y_t) - log p_teacher(y_t)) the sampled reverse-KL reward (log p_student: the old log-probs, i.e. the policy that sampled, as the ratio's denominator; both log-probs of the temperature-scaled distributions, unfiltered) and D_t = sum over the later model tokens k >= t of the same sequence of distill.discount^(k - t) * r_k (discount 0: D_t = r_t). A_reward is the usual group-normalised reward advantage; with no reward functions (rewards.functions: []) it is 0 and the run is pure distillation, which needs no reward function at all, nor groups: rollout.num_generations may be 1 (one completion per prompt, more distinct prompts for the same tokens). Multi-turn trajectories: the model's tokens only (environment tokens are context). With distill.objective: jsd the teacher's signal is a loss term instead of an advantage: loss = the policy-gradient loss (reward advantage only) + distill.weight * mean over the step's model tokens of D_t, with D_t TRL's generalised Jensen-Shannon divergence between the student's and the teacher's full next-token distributions at t (both temperature-scaled, unfiltered): D = beta * KL(p_t || m) + (1 - beta) * KL(p_s || m), m = (1 - beta) * p_s + beta * p_t, beta = distill.jsd_beta (0: forward KL(p_t || p_s), 1: reverse KL(p_s || p_t)); it is computed in vocabulary tiles from both models' final hidden states and lm_heads (neither model's logits exist), the teacher's forward running in the training step under no_grad, one micro-batch at a time."""

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
    objective: Literal["sampled", "jsd"] = Field(
        "sampled",
        description="'sampled': the reverse KL estimated on the sampled token, as a per-token advantage (the section's first formula; the teacher scored once per batch in the no-grad passes). 'jsd': the generalised JSD over the full next-token distributions as a loss term (the section's last formula; the teacher's forward in every training micro-batch, its hidden states kept for that micro-batch's backward).",
    )
    jsd_beta: float = Field(
        1.0,
        ge=0,
        le=1,
        description="distill.objective: jsd only: the mixture weight of the generalised JSD (TRL's `beta`, same default): 0 = forward KL(teacher || student), 1 = reverse KL(student || teacher), between = the JSD with mixture (1 - beta) p_student + beta p_teacher.",
    )
    weight: float = Field(
        1.0,
        gt=0,
        le=1000,
        description="Weight of the distillation signal against the reward advantage (whose own scale is the reward functions' weights): of D_t in the advantage (sampled), or of the divergence's token mean in the loss (jsd).",
    )
    discount: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Discount of the later tokens' reverse-KL rewards in D_t along the sequence (model tokens only): 0 = each token's own log-ratio, 1 = the sum over the rest of the sequence.",
    )

    @model_validator(mode="after")
    def _check_objective(self) -> DistillConfig:
        if self.objective == "jsd" and self.discount > 0:
            raise rule_error(
                f"distill.discount ({self.discount}) sums the sampled reverse-KL rewards along the sequence, which distill.objective: jsd does not use (its divergence is per token, over the full distribution); set distill.discount: 0 or distill.objective: sampled."
            )
        if self.objective == "sampled" and "jsd_beta" in self.model_fields_set:
            raise rule_error(
                "distill.jsd_beta only applies to distill.objective: jsd; set distill.objective: jsd or drop distill.jsd_beta."
            )
        return self
