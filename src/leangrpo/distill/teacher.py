"""The frozen teacher: loaded like the policy, scored like the reference.

Loading (`load_teacher`) goes through the policy's path (`model.policy.load_causal_lm`):
model.dtype, in memory of its own, its weights checked; `distill.teacher_quantization`
nf4 / int8 quantizes its decoder's linears as it loads (bitsandbytes, the QLoRA path of
model/quantization.py, double quantization on; the lm_head stays a plain matrix). Then
its vocabulary narrowed to the policy's rows (`narrow_vocabulary`: the teacher's log-softmax
runs over the tokens the student normalises over; rows the student has not would take
mass from every token), packed attention (the policy's backend), dropout off, eval mode,
no gradient. Under
torchrun it is sharded like the reference (distributed/fsdp.py `shard_policy`), from host
memory (`staged`): no rank ever holds the whole teacher on the device.

Scoring (`teacher_logprobs`) is `model.scoring.score` on the teacher: one backbone forward
over the packed row, hidden states gathered at the completion-predicting positions, the
chunked lm_head under the reference's transformation (temperature only, unfiltered: a
filtered teacher would give -inf to a token outside its set); a context-parallel split is
the teacher root's (`PackedScorer.split`), as for the reference.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch
from torch import nn

from leangrpo.contracts import PackedBatch, SamplingParams
from leangrpo.model.files import embedding_rows, read_model_config
from leangrpo.model.policy import (
    disable_dropout,
    load_causal_lm,
    refuse_scaled_logits,
    resolve_dtype,
)
from leangrpo.model.scoring import reference_sampling, score
from leangrpo.ops.attention.adapter import enable_packed_attention

log = logging.getLogger("leangrpo")
KEY = "distill.teacher"


def load_teacher(cfg, device: torch.device, *, staged: bool = False) -> nn.Module:
    """The teacher of `cfg.distill` for `device`, frozen, with the packed attention backend
    the policy was given (packing.attention_backend).

    `staged` (torchrun, where it is sharded next): a full-precision teacher stays in host
    memory, as views into its memory-mapped weight files where the dtype is the files'
    (no copy of its own), and FSDP moves it to `device` one unit at a time as it shards
    it (`distributed.fsdp.shard_model`), keeping each rank's shards: no rank holds more
    than its shards and one unit on the device, and none a whole copy in memory of its
    own. A quantized teacher is quantized on `device` as it loads (bitsandbytes), whole."""
    distill = cfg.distill
    dtype = resolve_dtype(cfg.model.dtype, device)
    extra = {}
    quantized = distill.teacher_quantization != "none"
    host = staged and not quantized
    if quantized:
        from leangrpo.model.quantization import check_quantized_device, quantized_load_kwargs

        check_quantized_device(distill.teacher_quantization, device, "distill.teacher_quantization")
        settings = SimpleNamespace(
            quantization=distill.teacher_quantization, quantization_double_quant=True
        )
        extra = quantized_load_kwargs(settings, device, dtype)
    model = load_causal_lm(
        distill.teacher, KEY, torch.device("cpu") if host else device, dtype, own_memory=not host,
        revision=distill.teacher_revision, trust_remote_code=cfg.model.trust_remote_code, **extra,
    )  # fmt: skip
    refuse_scaled_logits(model.config)
    narrow_vocabulary(model, embedding_rows(read_model_config(cfg.model)))
    enable_packed_attention(model, cfg.packing.attention_backend, device.type)
    disable_dropout(model)
    model.eval().requires_grad_(False)
    log.info(
        "teacher %s: %.1f M parameters (%s)",
        distill.teacher,
        sum(p.numel() for p in model.parameters()) / 1e6,
        distill.teacher_quantization if distill.teacher_quantization != "none" else dtype,
    )
    return model


def narrow_vocabulary(model: nn.Module, rows: int | None) -> None:
    """Keep the teacher's first `rows` vocabulary rows (the policy's, config.json
    vocab_size): its log-softmax then runs over the tokens the student normalises over,
    which the student can sample, and no mass sits on rows the student has not
    (distill/check.py refuses a teacher with fewer). Embeddings and head alike, tied or
    not (transformers' resize_token_embeddings; the rows kept are unchanged)."""
    head = model.get_output_embeddings()
    if rows is None or head is None or head.weight.shape[0] <= rows:
        return
    log.info(
        "teacher: its %d vocabulary rows narrowed to the policy's %d (log-probs over the "
        "policy's vocabulary)",
        head.weight.shape[0],
        rows,
    )
    model.resize_token_embeddings(rows, mean_resizing=False)


@torch.no_grad()
def teacher_logprobs(
    teacher: nn.Module, batch: PackedBatch, sampling: SamplingParams, logprob_cfg
) -> torch.Tensor:
    """(T,) float32 log-probs of the batch's completion tokens under the teacher,
    temperature-scaled and unfiltered (the reference's transformation)."""
    return score(teacher, batch, reference_sampling(sampling), logprob_cfg)[0].float()
