"""The config section of on-policy distillation: `distill` (absent: no teacher).

A frozen teacher (same tokenizer as the policy) scores every sampled token in the packed
scoring pass that computes reference log-probs (`teacher`: loaded in the trainer), or on
`leangrpo serve` processes that loaded it (`teacher_urls`: prompt log-probs of the sampled
ids, distill/served.py), and its log-probs become a dense, per-token signal (distill/). The section's first docstring line is what docs/config.md shows: the
objective written out. Its rules across sections (sampling filters, pure distillation
without reward functions, re-rolls and replay that need reward variance) live on
`Config` in root.py.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from leangrpo.config.base import ONE_DAY_S, Section
from leangrpo.config.io import rule_error

TEACHER_QUANTIZATIONS = ("none", "nf4", "int8")
URL = re.compile(r"https?://[^\s/?#]+/?")  # scheme, host (and port); nothing after


class DistillConfig(Section):
    """On-policy distillation: the policy samples, a frozen teacher scores every sampled model token y_t (one more no-grad pass in the packed scoring machinery, like the reference's), and the policy-gradient loss (loss.type, its clipping and IS correction) takes a per-token advantage A_t = A_reward(sequence) + distill.weight * D_t, with r_t = -(log p_student(y_t) - log p_teacher(y_t)) the sampled reverse-KL reward (log p_student: the old log-probs, i.e. the policy that sampled, as the ratio's denominator; both log-probs of the temperature-scaled distributions, unfiltered) and D_t = sum over the later model tokens k >= t of the same sequence of distill.discount^(k - t) * r_k (discount 0: D_t = r_t). A_reward is the usual group-normalised reward advantage; with no reward functions (rewards.functions: []) it is 0 and the run is pure distillation, which needs no reward function at all, nor groups: rollout.num_generations may be 1 (one completion per prompt, more distinct prompts for the same tokens). Multi-turn trajectories: the model's tokens only (environment tokens are context). With distill.objective: jsd the teacher's signal is a loss term instead of an advantage: loss = the policy-gradient loss (reward advantage only) + distill.weight * mean over the step's model tokens of D_t, with D_t TRL's generalised Jensen-Shannon divergence between the student's and the teacher's full next-token distributions at t (both temperature-scaled, unfiltered): D = beta * KL(p_t || m) + (1 - beta) * KL(p_s || m), m = (1 - beta) * p_s + beta * p_t, beta = distill.jsd_beta (0: forward KL(p_t || p_s), 1: reverse KL(p_s || p_t)); it is computed in vocabulary tiles from both models' final hidden states and lm_heads (neither model's logits exist), the teacher's forward running in the training step under no_grad, one micro-batch at a time."""

    teacher: str | None = Field(
        None,
        min_length=1,
        description="The teacher model: a local directory or a hub id, loaded frozen (eval mode, no gradient) in model.dtype. Its tokenizer must map every id to the same token as the policy's (checked before anything loads; the first differing token is named), and its vocabulary (lm_head rows) must cover the policy's. Give this or distill.teacher_urls, not both.",
    )
    teacher_urls: list[str] = Field(
        default_factory=list,
        description="A served teacher instead of distill.teacher: the URLs (http://host:port) of `leangrpo serve TEACHER` processes, which return the log-prob of every sampled model token as vLLM's prompt log-probs of the sequence's ids (the trainer holds none of the teacher's weights; `leangrpo plan` counts 0 for it). Requests are spread over the servers; a server that fails a request (no answer, a refusal, or a reply that is not finite log-probs <= 0 of exactly the tokens asked) is marked down and its share goes to another; before each batch a server marked down is probed (GET /health) and takes requests again when it answers; with none answering, a batch waits up to distill.teacher_timeout_s for one to come back (probing in back-off steps), then the run stops with one error naming every server's. Each server is asked, before anything loads, for its model's vocabulary, special tokens, chat template and max_model_len, checked as a local teacher's are; its vocabulary rows must equal the policy's (vLLM normalises over all of them). vLLM's prompt log-probs are of the unscaled distribution, so rollout.temperature must be 1, and distill.objective must be sampled (jsd needs the teacher's hidden states). A server must serve the teacher only: never list it in rollout.vllm.urls, whose weight sync would replace the teacher's weights (it then refuses to score).",
    )
    teacher_token_file: str | None = Field(
        None,
        description="File holding the shared-secret token of the `leangrpo serve` processes in distill.teacher_urls; null = the LEANGRPO_SERVE_TOKEN environment variable (never put the token itself in a config).",
    )
    teacher_timeout_s: float = Field(
        600.0,
        gt=0,
        le=ONE_DAY_S,
        description="Seconds to wait for one teacher server's answer (one share of a batch's sequences), and, when no server is left, for one to answer again before the run stops; at most 86400.",
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
    def _check_teacher_source(self) -> DistillConfig:
        """One teacher: loaded here (distill.teacher) or served (distill.teacher_urls); a
        served one is loaded, quantized and versioned by its server, and gives log-probs
        of sampled ids only."""
        if (self.teacher is None) == (not self.teacher_urls):
            both = "both are set" if self.teacher is not None else "neither is set"
            raise rule_error(
                f"distill needs one teacher: distill.teacher (a model directory or hub id, loaded in the trainer) or distill.teacher_urls (`leangrpo serve` processes of the teacher), and {both}; keep one."
            )
        if not self.teacher_urls:
            for key in ("teacher_token_file", "teacher_timeout_s"):
                if key in self.model_fields_set:
                    raise rule_error(
                        f"distill.{key} applies to the servers in distill.teacher_urls, which is empty (the teacher is loaded in the trainer); drop distill.{key}."
                    )
            return self
        for url in self.teacher_urls:
            if not URL.fullmatch(url):
                raise rule_error(
                    f"distill.teacher_urls: {url!r} is not a server URL; write http://host:port (or https://), as `leangrpo serve` prints it when it is ready."
                )
        plain = [u.rstrip("/") for u in self.teacher_urls]
        repeated = next((u for u in plain if plain.count(u) > 1), None)
        if repeated is not None:
            raise rule_error(
                f"distill.teacher_urls names {repeated} twice; list each teacher server once."
            )
        for key in ("teacher_revision", "teacher_quantization"):
            if key in self.model_fields_set:
                raise rule_error(
                    f"distill.{key} applies to a teacher loaded in the trainer (distill.teacher), and this one is served (distill.teacher_urls): its server loads it as `leangrpo serve` was told; drop distill.{key}."
                )
        if self.objective == "jsd":
            raise rule_error(
                "distill.objective: jsd needs the teacher's full next-token distributions (its hidden states and lm_head in every training step), which a server returning the log-probs of the sampled tokens (distill.teacher_urls) cannot give; use distill.objective: sampled with a served teacher, or a local distill.teacher for jsd."
            )
        return self

    @property
    def served(self) -> bool:
        """The teacher is on `leangrpo serve` processes (distill.teacher_urls)."""
        return bool(self.teacher_urls)

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
