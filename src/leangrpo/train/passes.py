"""The no-grad passes before a batch's first update: old, reference and teacher log-probs.

- old log-probs (the ratio's denominator): a separate pass only when the weights will have
  moved before a micro-batch is trained on (mu > 1 or several steps per batch); otherwise
  they are the detached current log-probs and cost nothing. In `bypass` mode the
  behaviour log-probs from the engine stand in for them.
- reference log-probs, only when beta > 0: unfiltered (temperature only, see
  `model.scoring.reference_logprobs`), so the KL never meets a reference that excludes a
  token.
- teacher log-probs, only with a distillation teacher (`policy.teacher`, distill/) and
  distill.objective: sampled: the same pass on the teacher, under the reference's
  transformation (`distill.teacher.teacher_logprobs`). The jsd objective needs the
  teacher's hidden states, not its log-probs: its forward runs in the training step
  (train/step.py). A served teacher (distill.teacher_urls, `distill.served.ServedTeacher`)
  is asked for the same log-probs before the trainer's own passes start, and answers
  while they run. A batch in progress restored without them (distill added on a resume)
  gets them at the resume, the same way (`attach_missing_teacher`).

All run in eval mode over every planned micro-batch (torchrun's padding ones too: every
rank makes the same forwards), then `ranks.release_gathered` frees what the passes left
gathered (FSDP2 reshards neither the root nor, under shard_grad_op, any unit after a
forward that no backward follows). See docs/training.md ("Reference log-probs are
unfiltered") and docs/distributed.md ("Units").
"""

from __future__ import annotations

import torch

from leangrpo.config.distill import DistillConfig
from leangrpo.config.training import LogprobsConfig, LossConfig
from leangrpo.contracts import SamplingParams, StepRanks
from leangrpo.distill.served import ServedTeacher
from leangrpo.distill.teacher import teacher_logprobs
from leangrpo.model.policy import Policy
from leangrpo.model.scoring import eval_mode, reference_logprobs, score
from leangrpo.train.planning import PlannedStep
from leangrpo.train.ranks import ONE_PROCESS


def needs_old_pass(loss: LossConfig, num_steps: int) -> bool:
    """Whether the old log-probs need a pass of their own (the weights move before use)."""
    reused = loss.mu > 1 or num_steps > 1
    return loss.is_correction != "bypass" and reused


@torch.no_grad()
def attach_old_and_ref(
    policy: Policy,
    steps: list[PlannedStep],
    loss: LossConfig,
    logprobs: LogprobsConfig,
    sampling: SamplingParams,
    ranks: StepRanks = ONE_PROCESS,
    distill: DistillConfig | None = None,
    served: ServedTeacher | None = None,
) -> None:
    """Fill in old, reference and teacher log-probs on every micro-batch before the first
    update (`distill`: the run's section; the teacher's pass is the sampled objective's;
    `served`: a served teacher's client, asked instead of a local teacher's pass)."""
    want_old = needs_old_pass(loss, len(steps))
    want_ref = loss.beta > 0
    jsd = distill is not None and distill.objective == "jsd"
    teacher = None if jsd else policy.teacher
    batches = [mb for step in steps for mb in step.micro_batches]
    pending = served.start(batches, sampling.temperature) if served is not None else None
    if want_old or want_ref or teacher is not None:
        _local_passes(policy, batches, want_old, want_ref, teacher, logprobs, sampling, ranks)
    if pending is not None:
        pending.attach()


@torch.no_grad()
def attach_missing_teacher(
    policy: Policy,
    steps: list[PlannedStep],
    logprobs: LogprobsConfig,
    sampling: SamplingParams,
    ranks: StepRanks = ONE_PROCESS,
    distill: DistillConfig | None = None,
    served: ServedTeacher | None = None,
) -> bool:
    """A restored batch in progress (train/inflight.py) saved without teacher log-probs
    (a resume that adds distill, or turns jsd into sampled, under run.allow_config_changes)
    gets them now from the run's teacher, by the fresh batch's path (`attach_old_and_ref`'s
    teacher pass, or its request to the servers); the old and reference log-probs it was
    saved with stay. True when it was scored. Every rank of a torchrun decides alike: the
    checkpoint's micro-batches, padding ones too, hold teacher log-probs on all or none."""
    if distill is None or distill.objective == "jsd":
        return False
    batches = [mb for step in steps for mb in step.micro_batches]
    if all(mb.teacher_logprobs is not None for mb in batches):
        return False
    if served is not None:
        served.start(batches, sampling.temperature).attach()
    else:
        _local_passes(policy, batches, False, False, policy.teacher, logprobs, sampling, ranks)
    return True


def _local_passes(policy: Policy, batches: list, want_old: bool, want_ref: bool, teacher,
                  logprobs: LogprobsConfig, sampling: SamplingParams, ranks: StepRanks) -> None:
    """The passes on the trainer's own models (`teacher`: a local one, or None)."""
    with eval_mode(policy.model):  # torchrun: padding micro-batches run these passes too
        for mb in batches:
            if want_old:
                module = policy.scoring_module
                mb.old_logprobs = score(module, mb, sampling, logprobs)[0].float()
            if want_ref:
                mb.ref_logprobs = reference_logprobs(policy, mb, sampling, logprobs).float()
            if teacher is not None:
                mb.teacher_logprobs = teacher_logprobs(teacher, mb, sampling, logprobs)
    ranks.release_gathered(policy)
