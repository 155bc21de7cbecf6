"""The packed scoring forward: per-completion-token log-probs (and entropy) of a policy.

Scoring never builds logits for prompt tokens: the backbone runs once over the packed row
(real tokens only), the final hidden states are gathered at the T positions that predict
completion tokens, and the chunked lm_head turns those (T, H) rows into log-probs without
ever holding a (T, V) tensor. Reference log-probs come from the same forward with LoRA
adapters disabled, or from the frozen copy when training all weights with beta > 0; they
are unfiltered (temperature only): KL to a top-k / min-p filtered reference is +inf for
any token outside the reference's set, which becomes near-certain once the policy drifts.

For FSDP2 (distributed/fsdp.py) the chunked lm_head can be a module (`ChunkedLMHead`, the
same parameters under the same names) and the whole scoring pass a module
(`PackedScorer`), so that every weight is read inside a forward, where FSDP has gathered it.

A mixture-of-experts model with routing replay (or the router's auxiliary loss) has a
`model.moe.control.RoutingControl` on it: each scoring forward announces the row's route
records to it first and hands it the row's split afterwards (figures summed over a
context-parallel group); a dense model's is a no-op.

The forward runs on a row split (`contracts.RowSplit`): one process's is the whole row
(`ops.context_parallel.shards.WHOLE_ROW`); under context parallelism the `PackedScorer`
holds the group's split (ops/context_parallel/ulysses.py), and each rank runs the backbone
on its shard of the row and the head on the completion tokens its shard predicts, and gets
back the whole row's (T,) log-probs. Nothing after scoring sees the difference.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from leangrpo.contracts import LocalRow, PackedBatch, RowSplit, SamplingParams, TeacherRows
from leangrpo.model.moe.control import routing_of
from leangrpo.model.policy import Policy
from leangrpo.ops.context_parallel.shards import WHOLE_ROW, whole_row
from leangrpo.ops.logprobs.api import token_logprobs
from leangrpo.ops.logprobs.divergence import chunked_divergence, naive_divergence


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def backbone_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    lm = causal_lm(model)
    return lm.get_decoder(), lm.get_output_embeddings()


def completion_hidden(model: nn.Module, batch: PackedBatch) -> torch.Tensor:
    """Final hidden states (T, H) at the positions that predict completion tokens."""
    return row_hidden(model, whole_row(batch))


def row_hidden(model: nn.Module, row: LocalRow) -> torch.Tensor:
    """Final hidden states (T_c, H) of a (local) row at its predicting positions."""
    backbone, _ = backbone_and_head(model)
    out = backbone(
        input_ids=row.input_ids,
        position_ids=row.position_ids,
        use_cache=False,
        **row.model_kwargs,
    )
    return out.last_hidden_state[0].index_select(0, row.completion_index)


def score(
    model: nn.Module,
    batch: PackedBatch,
    sampling: SamplingParams,
    logprob_cfg,
    *,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-completion-token log-probs (T,) under the engine's sampling transformation."""
    if isinstance(model, PackedScorer):  # the FSDP root: its forward gathers the root unit
        return model(batch, sampling, logprob_cfg, with_entropy=with_entropy)
    if any(_is_dtensor(p) for p in causal_lm(model).parameters()):
        raise RuntimeError(
            "score(): the model is FSDP-sharded; score through the PackedScorer that "
            "leangrpo.distributed.fsdp.shard_model returned, so that the sharded weights are gathered"
        )
    return _score(model, batch, sampling, logprob_cfg, with_entropy, WHOLE_ROW)[:2]


def score_distill(
    model: nn.Module,
    batch: PackedBatch,
    sampling: SamplingParams,
    logprob_cfg,
    teacher: TeacherRows,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probs, entropy, divergence to the teacher), each (T,): `score` with the tiled
    generalised JSD (ops/logprobs/divergence.py) in the same sweep of the student's head;
    `teacher`: the teacher's rows for the same local row (`distill.teacher.teacher_rows`).
    The sampling transformation is the temperature only (config refuses filters with a
    teacher)."""
    if isinstance(model, PackedScorer):
        return model(batch, sampling, logprob_cfg, with_entropy=True, teacher=teacher)
    if any(_is_dtensor(p) for p in causal_lm(model).parameters()):
        raise RuntimeError("score_distill(): the model is FSDP-sharded; pass its PackedScorer")
    return _score(model, batch, sampling, logprob_cfg, True, WHOLE_ROW, teacher)


def _score(model, batch, sampling, logprob_cfg, with_entropy: bool, split: RowSplit,
           teacher: TeacherRows | None = None):  # fmt: skip
    """score() without the check (inside the FSDP root's forward, units not yet reached
    still hold sharded weights; each unit's forward gathers its own), on `split`'s part of
    the row; the (T,) log-probs, entropies (or None) and divergences to `teacher` (or None)
    of the whole row. A mixture of experts replays the batch's routes, or compares them
    (model/moe/control.py)."""
    row = split.local_row(batch)
    routing = routing_of(model)
    routing.prepare(row, batch.padding)
    hidden = row_hidden(model, row)
    divergence = None
    if teacher is None:
        logprobs, entropy = _head_logprobs(model, hidden, row.targets, sampling, logprob_cfg,
                                           with_entropy)  # fmt: skip
    else:
        divergence, logprobs, entropy = _head_divergence(model, hidden, row.targets, sampling,
                                                         logprob_cfg, teacher)  # fmt: skip
    routing.finish(row, split)
    logprobs, entropy = split.gather(logprobs, entropy, row)
    if divergence is not None:
        divergence = split.gather(divergence, None, row)[0]
    return logprobs, entropy, divergence


def _head_divergence(model, hidden, targets, sampling, logprob_cfg, teacher: TeacherRows):
    _, head = backbone_and_head(model)
    options = {
        "beta": teacher.beta,
        "temperature": sampling.temperature,
        "row_tile": logprob_cfg.row_tile,
        "vocab_tile": logprob_cfg.vocab_tile,
    }
    if isinstance(head, ChunkedLMHead):  # a module call: FSDP gathers the head around it
        return head(hidden, targets, teacher=teacher, chunked=logprob_cfg.chunked, **options)
    return divergence(hidden, head.weight, targets, getattr(head, "bias", None), teacher,
                      chunked=logprob_cfg.chunked, **options)  # fmt: skip


def divergence(hidden, weight, targets, bias, teacher: TeacherRows, *, chunked: bool = True,
               **options):  # fmt: skip
    """(divergence, log-probs, entropy) of the student's head against `teacher`: tiled
    (`logprobs.chunked`, the default) or the full-logits reference."""
    if not chunked:
        options = {k: v for k, v in options.items() if k not in ("row_tile", "vocab_tile")}
        return naive_divergence(hidden, weight, teacher.hidden, teacher.weight, targets, bias,
                                teacher.bias, **options)  # fmt: skip
    return chunked_divergence(hidden, weight, teacher.hidden, teacher.weight, targets, bias,
                              teacher.bias, **options)  # fmt: skip


def _head_logprobs(model, hidden, targets, sampling, logprob_cfg, with_entropy: bool):
    _, head = backbone_and_head(model)
    options = {
        "chunked": logprob_cfg.chunked,
        "compile": getattr(logprob_cfg, "compile", False),  # duck-typed test configs lack it
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "with_entropy": with_entropy,
        "row_tile": logprob_cfg.row_tile,
        "vocab_tile": logprob_cfg.vocab_tile,
    }
    if isinstance(head, ChunkedLMHead):  # a module call: FSDP gathers the head around it
        return head(hidden, targets, **options)
    return token_logprobs(hidden, head.weight, targets, getattr(head, "bias", None), **options)


def reference_sampling(sampling: SamplingParams) -> SamplingParams:
    """The reference's transformation: the engine's temperature, no top-k/top-p/min-p."""
    return dataclasses.replace(sampling, top_k=0, top_p=1.0, min_p=0.0)


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class ChunkedLMHead(nn.Module):
    """The lm_head as a module whose forward can return chunked log-probs.

    It takes over the original head's `weight` (and `bias`) Parameter objects, so names
    (`lm_head.weight`), tying to the input embeddings and saved checkpoints are unchanged.
    `head(hidden)` returns logits as nn.Linear does (generation, plain forwards);
    `head(hidden, targets, **options)` returns `token_logprobs(...)`. Under FSDP2 the head
    is its own unit (or part of the root's) and the weight is only read inside a forward,
    when it is gathered, never as a sharded DTensor.
    """

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.weight = linear.weight
        self.bias = getattr(linear, "bias", None)
        self.in_features, self.out_features = self.weight.shape[1], self.weight.shape[0]

    def forward(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor | None = None,
        teacher: TeacherRows | None = None,
        copy_weight: bool = False,
        **options,
    ):
        """Logits (no targets); log-probs (and entropy) of `targets`; with `teacher`, the
        (divergence, log-probs, entropy) of ops/logprobs/divergence.py; with `copy_weight`,
        a detached copy of (weight, bias), taken while FSDP has them gathered (a frozen
        teacher's head for the student's divergence, forward and backward)."""
        if copy_weight:
            bias = None if self.bias is None else self.bias.detach().clone()
            return self.weight.detach().clone(), bias
        if targets is None:
            return nn.functional.linear(hidden, self.weight, self.bias)
        if teacher is not None:
            return divergence(hidden, self.weight, targets, self.bias, teacher, **options)
        return token_logprobs(hidden, self.weight, targets, self.bias, **options)


def install_chunked_head(model: nn.Module) -> ChunkedLMHead:
    """Replace the causal LM's output embeddings by a ChunkedLMHead (idempotent)."""
    lm = causal_lm(model)
    head = lm.get_output_embeddings()
    if isinstance(head, ChunkedLMHead):
        return head
    if not isinstance(head, nn.Linear):
        raise TypeError(
            f"the output embeddings are a {type(head).__name__}, not nn.Linear; the chunked "
            "lm_head needs a plain linear head (is lm_head a LoRA target? drop it from "
            "lora.target_modules)"
        )
    chunked = ChunkedLMHead(head)
    lm.set_output_embeddings(chunked)
    return chunked


class PackedScorer(nn.Module):
    """The packed scoring forward (backbone + chunked head) as one module call.

    FSDP2 gathers a unit's parameters in its forward pre-hook, so whatever is left outside
    the per-layer units (embeddings, final norm, a tied head) must be read inside some
    module's forward: this one is the root unit. `scorer(batch, sampling, logprob_cfg)`
    equals `score(model, ...)`. `split`: how the row is split over a context-parallel
    group (default: the whole row, one process's).
    """

    def __init__(self, model: nn.Module, split: RowSplit = WHOLE_ROW):
        super().__init__()
        self.model = model
        self.split = split

    def forward(self, batch: PackedBatch, sampling, logprob_cfg, with_entropy: bool = False,
                teacher: TeacherRows | None = None, rows_of: float | None = None):  # fmt: skip
        """(log-probs, entropy); with `teacher`, (log-probs, entropy, divergence); with
        `rows_of` (a distillation teacher's root: its jsd_beta), its `TeacherRows` of the
        batch's local row, under no_grad."""
        if rows_of is not None:
            return _teacher_rows(self.model, self.split.local_row(batch), rows_of)
        out = _score(self.model, batch, sampling, logprob_cfg, with_entropy, self.split, teacher)
        return out if teacher is not None else out[:2]


@torch.no_grad()
def teacher_rows(teacher: nn.Module, batch: PackedBatch, beta: float) -> TeacherRows:
    """A frozen teacher's `TeacherRows` of the batch (its FSDP root's: through its forward,
    the head copied while gathered; a plain model's: the whole row, its head as it is)."""
    if isinstance(teacher, PackedScorer):
        return teacher(batch, None, None, rows_of=beta)
    return _teacher_rows(teacher, whole_row(batch), beta, copy=False)


def _teacher_rows(model: nn.Module, row: LocalRow, beta: float, copy: bool = True) -> TeacherRows:
    hidden = row_hidden(model, row).detach()
    _, head = backbone_and_head(model)
    if isinstance(head, ChunkedLMHead) and copy:
        weight, bias = head(hidden, copy_weight=True)
    else:
        weight, bias = head.weight.detach(), getattr(head, "bias", None)
        bias = None if bias is None else bias.detach()
    return TeacherRows(hidden, weight, bias, float(beta))


@torch.no_grad()
def reference_logprobs(policy: Policy, batch: PackedBatch, sampling, logprob_cfg) -> torch.Tensor:
    """Unfiltered log-probs of the reference policy: adapters off (LoRA) or the frozen copy."""
    sampling = reference_sampling(sampling)
    if policy.reference is not None:
        return score(policy.reference, batch, sampling, logprob_cfg)[0]
    if not policy.is_lora:
        raise RuntimeError("a reference pass was asked for but no reference policy exists")
    with policy.model.disable_adapter():
        return score(policy.scoring_module, batch, sampling, logprob_cfg)[0]


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """No dropout for the no-grad scoring passes, restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
