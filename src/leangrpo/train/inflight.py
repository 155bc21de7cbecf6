"""The batch in progress: a generation batch being trained on, resumable at any step.

A `BatchInProgress` holds a batch's planned steps (old/reference/teacher log-probs
attached by the no-grad passes) and how many of its mu x steps_per_generation optimizer
steps are done, taken iteration-major. A checkpoint inside a batch saves it whole: its samples
(re-planned identically on load) and the passes' tensors, so a resume continues with the
same micro-batches and never recomputes old or reference log-probs with weights that
have moved since; the batch's metrics (rewards, advantages, lengths, ...), logged with its
first step, are saved too while that step is still to come. Under torchrun the tensors
are each rank's own (the checkpointer gathers and hands them back). See
docs/checkpoints.md ("Exact resume").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from leangrpo.checkpoint.local import sample_from_state, sample_state
from leangrpo.checkpoint.rundir import unrouted_batch
from leangrpo.contracts import RolloutBatch
from leangrpo.errors import RunError
from leangrpo.model.policy import Policy
from leangrpo.train.planning import PlannedStep, plan_steps

# what the no-grad passes attach to a micro-batch: a checkpoint inside a batch keeps them
NO_GRAD_FIELDS = ("old_logprobs", "ref_logprobs", "teacher_logprobs")


@dataclass
class BatchInProgress:
    """A generation batch being trained on: mu iterations over its planned steps."""

    batch: RolloutBatch
    steps: list[PlannedStep]
    iterations: int  # loss.mu
    done: int = 0  # optimizer steps taken on it, over all iterations
    metrics: dict[str, float] = field(default_factory=dict)  # logged with its next step

    @property
    def remaining(self) -> int:
        return self.iterations * len(self.steps) - self.done

    def summary(self, step: int) -> dict:
        """What a resume checks before the model loads (checkpoint/rundir.py
        `check_batch_routes`): the step the batch ends at, and whether its samples carry
        route records (MoE routing replay)."""
        routes = all(s.completion.routes is not None for s in self.batch.samples)
        return {"ends_at_step": step + self.remaining, "routes": routes}

    def take(self) -> tuple[PlannedStep, dict[str, float]]:
        """The next step to train (iteration-major order) and the metrics to log with it."""
        planned = self.steps[self.done % len(self.steps)]
        metrics, self.metrics = {**self.metrics, **planned.metrics}, {}
        self.done += 1
        return planned, metrics

    def state_dict(self) -> dict:
        """The samples (re-planned identically on load), the no-grad passes' tensors and the
        batch's metrics not logged yet (a stop after scoring, before its first step)."""
        attached = [
            [{k: _cpu(getattr(mb, k)) for k in NO_GRAD_FIELDS} for mb in step.micro_batches]
            for step in self.steps
        ]
        return {
            "samples": [sample_state(s) for s in self.batch.samples],
            "group_size": self.batch.group_size,
            "attached": attached,
            "iterations": self.iterations,
            "done": self.done,
            "metrics": {k: float(v) for k, v in self.metrics.items()},
        }

    @classmethod
    def from_state(
        cls, state: dict, cfg, policy: Policy, rank: int = 0, world_size: int = 1
    ) -> BatchInProgress:
        """`state["attached"]` must be this rank's (the checkpointer hands back its own)."""
        batch = RolloutBatch([sample_from_state(s) for s in state["samples"]], state["group_size"])
        scored = [s for s in batch.samples if s.reward is not None]
        if policy.routing.replay and any(s.completion.routes is None for s in scored):
            raise RunError(unrouted_batch("The checkpoint", None))  # saved without its summary
        steps = plan_steps(scored, cfg, policy, rank, world_size)
        micro_batches = [mb for step in steps for mb in step.micro_batches]
        attached = [fields for step in state["attached"] for fields in step]
        fits = len(attached) == len(micro_batches) and all(
            v is None or v.numel() == mb.num_completion_tokens
            for mb, fields in zip(micro_batches, attached)
            for v in fields.values()
        )
        if not fits:
            raise RunError(
                "the checkpoint's batch in progress does not re-plan into the micro-batches "
                "it was saved with; resume with its packing and train settings"
            )
        for mb, fields in zip(micro_batches, attached):
            for name, value in fields.items():
                setattr(mb, name, None if value is None else value.to(policy.device))
        metrics = {str(k): float(v) for k, v in state.get("metrics", {}).items()}
        return cls(batch, steps, state["iterations"], state["done"], metrics)


def _cpu(value):
    return value.cpu() if value is not None else None
