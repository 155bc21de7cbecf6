"""The typed records that flow between roles.

One place for the shapes every role agrees on, so that a rollout engine, the reward pool,
the packer, the scorer and the loss can be written and tested apart:

    Prompt ──engine──► Completion ──rewards──► RolloutSample ──packing──► PackedBatch
                                                                            │ scorer
                                                  LossOutputs ◄──loss── LossInputs

Tensor shapes are given in the comments: N = real tokens in a packed row, S = sequences
in it, T = completion tokens in it (the only positions that get log-probs; of a multi-turn
trajectory, the model's tokens only: the environment's are context, like the prompt).

The roles' interfaces live here too: `RolloutEngine`, `TurnEngine` and `TurnStream`
(rollout/; the multi-turn rollout of environments/ drives the latter two), `Producer`
(pipeline/ and distributed/rollout.py), and what differs between one process and torchrun, chosen once
at set-up (`Strategy`, picked by distributed/strategy.py: `StepRanks`, `Checkpointer`,
`MetricsLog`). See docs/ARCHITECTURE.md ("Contracts that cross roles").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:  # torch stays out of modules that only need the records' shapes
    from collections.abc import Callable, Iterable, Sequence
    from pathlib import Path

    from torch import Tensor

# "max_turns": a multi-turn trajectory used its environment.max_turns model turns
FinishReason = Literal["stop", "length", "error", "max_turns"]


@dataclass(frozen=True)
class SamplingParams:
    """How an engine samples; the trainer applies the same transformation to its log-probs."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter
    min_p: float = 0.0  # 0.0 = no min-p filter
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass
class Prompt:
    """One prompt as the data role hands it out: rendered text, token ids, extra columns."""

    uid: int  # stable index of the row in its dataset (used for re-rolls and resume)
    text: str  # after the chat template, exactly what is tokenised
    ids: list[int]
    columns: dict[str, Any] = field(default_factory=dict)  # passed to reward functions
    # the chat messages `text` was rendered from (data.chat_template); None for raw text
    messages: list[dict[str, Any]] | None = None


@dataclass
class Trajectory:
    """What a multi-turn completion adds (environments/): its ids are the model's turns
    and the environment's segments in between, as the engine and the chat template made
    them; only the model's tokens are trained on."""

    # run lengths over Completion.ids, in order: (tokens, is_model); the first is a model turn
    segments: list[tuple[int, bool]]
    turn_versions: list[int]  # policy version of each model turn
    # the conversation: the prompt's messages, each model turn (its raw text) and the
    # environment's replies
    messages: list[dict[str, Any]]
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # {"name", "arguments"}
    rewards: dict[str, float] = field(default_factory=dict)  # the environment's, summed
    metrics: dict[str, float] = field(default_factory=dict)  # the environment's: mean of its reports
    stats: dict[str, float] = field(default_factory=dict)  # counts and seconds (metrics)
    error: str | None = None  # the environment failed: the trajectory ended, unscored
    # the prompt the trajectory starts from: the environment's start messages rendered
    # with its tools (the sample's prompt); None once it is the sample's (checkpoints)
    start: Prompt | None = None

    def model_offsets(self) -> list[int]:
        """Position in Completion.ids of each model token, in order."""
        out, pos = [], 0
        for n, is_model in self.segments:
            if is_model:
                out.extend(range(pos, pos + n))
            pos += n
        return out

    @property
    def num_model_tokens(self) -> int:
        return sum(n for n, is_model in self.segments if is_model)


@dataclass
class Completion:
    """One generation from an engine, or one multi-turn trajectory (`trajectory` set)."""

    ids: list[int]
    text: str  # multi-turn: the text of the last model turn (what rewards read)
    # behaviour log-prob of each model token (every token of ids unless multi-turn), after
    # temperature + filters
    logprobs: list[float]
    finish_reason: FinishReason
    version: int  # policy version of the weights that generated it (multi-turn: the oldest)
    trajectory: Trajectory | None = None
    # routing replay (mixture of experts): a CPU tensor (model tokens, MoE layers, k) of the
    # experts the engine routed each model token's predicting position to, aligned with
    # `logprobs` (model/moe/routes.py); None when the engine reports no routes
    routes: Tensor | None = None

    @property
    def num_model_tokens(self) -> int:
        return len(self.ids) if self.trajectory is None else self.trajectory.num_model_tokens


@dataclass(frozen=True)
class TurnRequest:
    """One model turn of one trajectory (`TurnStream.submit`, `TurnEngine.generate_turns`):
    the ids so far (ending with the generation prompt), its own seed and its own token
    budget. `key` names the trajectory within its generation call (its kept KV cache, its
    server); None: a turn of its own, nothing kept."""

    ids: list[int]
    seed: int | None
    max_new_tokens: int
    key: int | None = None


def sample_prompt(prompt: Prompt, completion: Completion) -> Prompt:
    """The prompt a sample of `completion` has: a multi-turn trajectory's own start (its
    environment's messages, rendered with the tools), else the prompt it was asked for."""
    trajectory = completion.trajectory
    return trajectory.start if trajectory is not None and trajectory.start is not None else prompt


@dataclass
class RolloutSample:
    """A prompt, one of its G completions, its rewards and its advantage."""

    group_id: int  # the G samples of one prompt share it
    prompt: Prompt
    completion: Completion
    rewards: dict[str, float | None] = field(default_factory=dict)  # per function; None = unscored
    reward: float | None = None  # weighted sum; None when any weighted function gave None
    advantage: float = 0.0
    replayed: bool = False  # came from the replay buffer, not from fresh generation

    @property
    def version(self) -> int:
        return self.completion.version

    @property
    def num_tokens(self) -> int:
        return len(self.prompt.ids) + len(self.completion.ids)

    @property
    def truncated(self) -> bool:
        """Cut short by a limit: max_new_tokens / max_total_tokens, or max_turns."""
        return self.completion.finish_reason in ("length", "max_turns")


@dataclass
class RolloutBatch:
    """One generation batch: groups of G consecutive samples sharing a group_id."""

    samples: list[RolloutSample]
    group_size: int
    metrics: dict[str, float] = field(default_factory=dict)  # generation/reward metrics

    def groups(self) -> list[list[RolloutSample]]:
        g = self.group_size
        return [self.samples[i : i + g] for i in range(0, len(self.samples), g)]


@dataclass
class PackedBatch:
    """Sequences laid end to end in one row of real tokens; the only batch layout we use.

    `completion_index[t]` is the position whose final hidden state predicts completion token
    `targets[t]` (the position just before it), so log-probs are taken only there.
    """

    input_ids: Tensor  # (1, N) int64
    position_ids: Tensor  # (1, N) int64, restarting at 0 for each sequence
    cu_seqlens: Tensor  # (S + 1,) int32, sequence boundaries in the row
    max_seqlen: int
    completion_index: Tensor  # (T,) int64, positions in [0, N)
    targets: Tensor  # (T,) int64, completion token ids
    token_seq: Tensor  # (T,) int64, sequence index in [0, S) of each completion token
    completion_lens: Tensor  # (S,) int64, completion tokens per sequence (model tokens only)
    sample_index: Tensor  # (S,) int64, index of each sequence in its RolloutBatch
    advantages: Tensor  # (S,) float32
    truncated: Tensor  # (S,) bool, finish_reason "length" (or "max_turns")
    behaviour_logprobs: Tensor  # (T,) float32, from the engine
    old_logprobs: Tensor | None = None  # (T,) float32, trainer's no-grad pass (decoupled IS)
    ref_logprobs: Tensor | None = None  # (T,) float32, reference policy (beta > 0)
    teacher_logprobs: Tensor | None = None  # (T,) float32, distillation teacher (distill/)
    versions: Tensor | None = None  # (S,) int64, policy version that generated each sequence
    # routing replay: (T, MoE layers, k) experts the engine routed each completion token's
    # predicting position to (model/moe/routes.py); None when samples carry no route records
    routes: Tensor | None = None
    # torchrun: a one-token batch that keeps a rank's forward/backward count equal to its
    # peers' (distributed/dealing.py: `padding_batch`); it runs no loss
    padding: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.numel() - 1)

    @property
    def num_completion_tokens(self) -> int:
        return int(self.targets.numel())

    def to(self, device: Any) -> PackedBatch:
        import torch

        moved = {
            name: (
                value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
            )
            for name, value in self.__dict__.items()
        }
        return PackedBatch(**moved)


@dataclass
class LocalRow:
    """One rank's part of a packed micro-batch, as the scoring forward runs it (the
    `RowSplit`'s record: ops/context_parallel/shards.py makes it)."""

    input_ids: Tensor  # (1, n) this rank's tokens
    position_ids: Tensor  # (1, n)
    model_kwargs: dict[str, Any]  # the whole row's packed-attention kwargs (+ the split's)
    completion_index: Tensor  # (T_c,) predicting positions, in [0, n)
    targets: Tensor  # (T_c,)
    tokens: Tensor | None  # (T_c,) which of the row's T completion tokens; None: all of them
    num_targets: int  # T of the whole row
    routes: Tensor | None = None  # (T_c, layers, k) route records (routing replay), or None
    real_tokens: int | None = None  # this rank's tokens that are not padding; None: all
    # (real,) float: sequences each real position belongs to (a shared prefix: a group's
    # prompt positions count once per completion); None: one each (the plain layout)
    sequences_per_position: Tensor | None = None


class RowSplit(Protocol):
    """How the scoring forward splits a packed row over a context-parallel group: one
    process's `ops.context_parallel.shards.WHOLE_ROW` (the row itself), or a strategy such
    as `ops.context_parallel.ulysses.Ulysses` (each rank a shard of the row; attention over
    the whole row through `attend`). model/scoring.py runs the backbone on `local_row`'s
    tokens and the head on its completion tokens, and `gather` hands back the whole row's
    (T,) values, so nothing after scoring depends on the split."""

    size: int  # ranks in the group (1: nothing split)

    def local_row(self, batch: PackedBatch) -> LocalRow: ...

    def gather(
        self, logprobs: Tensor, entropy: Tensor | None, row: LocalRow
    ) -> tuple[Tensor, Tensor | None]: ...

    def sum_over_group(self, values: Tensor) -> Tensor:
        """The element-wise sum over the group's ranks, without gradient (identity for one
        process): the routing figures of a row (model/moe/control.py)."""
        ...


@dataclass(frozen=True)
class TeacherRows:
    """A distillation teacher's view of one micro-batch's local row (this rank's part under
    context parallelism), for the tiled divergence in the student's scoring pass
    (`distill.objective: jsd`): its final hidden states at the completion-predicting
    positions and its lm_head, all detached (the teacher is frozen)."""

    hidden: Tensor  # (T_c, H_teacher) the local row's completion-predicting positions
    weight: Tensor  # (V_teacher, H_teacher) its lm_head, a plain tensor (gathered if sharded)
    bias: Tensor | None
    beta: float  # distill.jsd_beta: 0 = forward KL, 1 = reverse KL


@dataclass(frozen=True)
class LossNormalisers:
    """Global counts that make a token-level loss exact under any micro-batching.

    They are counted over the whole optimizer step (all micro-batches, and all ranks where
    the name says global) before the first micro-batch runs.
    """

    # sequences / unmasked completion tokens of the optimizer step on this rank; across
    # ranks, the rank's share of the global count (global / world_size, maybe fractional)
    sequences: float
    tokens: float
    global_tokens: int  # completion tokens in the optimizer step, summed over ranks
    world_size: int = 1
    max_completion_length: int = 1


@dataclass
class LossInputs:
    """Per-token tensors on the packed layout of one micro-batch; never padding."""

    logprobs: Tensor  # (T,) current policy, carries grad
    old_logprobs: Tensor  # (T,) denominator of the ratio (trainer's old or the behaviour's)
    advantages: Tensor  # (T,) per token (each sequence's advantage repeated)
    mask: Tensor  # (T,) float32 0/1: 1 = token counts in the loss (a selection, not a weight)
    token_seq: Tensor  # (T,) int64, sequence index in [0, num_sequences)
    num_sequences: int  # S of this micro-batch
    ref_logprobs: Tensor | None = None  # (T,) reference policy, needed when beta > 0
    is_weights: Tensor | None = None  # (T,) detached off-policy correction weights
    entropy: Tensor | None = None  # (T,) per-token entropy, for metrics/masking
    # (T,) a distillation teacher's log-probs: the `distill/reverse_kl` metric only (its
    # signal is already in `advantages`)
    teacher_logprobs: Tensor | None = None
    # (T,) per-token divergence to a distillation teacher (distill.objective: jsd), carries
    # grad; added to the loss as divergence_weight x its token mean over the step
    divergence: Tensor | None = None
    divergence_weight: float = 0.0


@dataclass
class LossOutputs:
    loss: Tensor  # scalar; already divided by the global normalisers: just call backward()
    metrics: dict[str, Tensor]  # sums over this micro-batch; see loss.METRIC_COUNTS


@runtime_checkable
class RolloutEngine(Protocol):
    """What the pipeline needs of a generator (hf in-process, vLLM colocated or server).

    An engine holds one policy version at a time; `generate` refuses a request tagged with
    a version it does not hold, so a sample's version is never a guess.
    """

    @property
    def version(self) -> int: ...

    def generate(
        self,
        prompts: list[Prompt],
        params: SamplingParams,
        n: int,
        version: int,
        prompt_offset: int = 0,
    ) -> list[list[Completion]]:
        """n completions per prompt, in prompt order.

        `prompt_offset` is the index of `prompts[0]` in its generation batch: per-prompt
        seeds derive from (params.seed, batch index of the prompt), so a share of a batch
        (one torchrun rank's) is sampled as the whole batch would be.
        """
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Load full weights (or LoRA adapter tensors, by their peft names) as `version`."""
        ...

    def load_adapter(self, path: str, version: int) -> None:
        """Load a LoRA adapter saved by peft at `path` as `version`."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class TurnEngine(Protocol):
    """An engine that generates one turn for each of many trajectories at once (the
    multi-turn rollout's engine: hf and vLLM)."""

    @property
    def version(self) -> int: ...

    def generate_turns(
        self, requests: list[TurnRequest], params: SamplingParams, version: int
    ) -> list[Completion]:
        """One completion per request, in order; each request sampled with its own seed and
        at most its own max_new_tokens (params.seed and params.max_new_tokens unused)."""
        ...

    def open_turns(self, params: SamplingParams, version: int) -> TurnStream:
        """A stream for one generation call's turns at `version` (close it when done)."""
        ...


@runtime_checkable
class TurnStream(Protocol):
    """The turns of one generation call, generated as they are submitted (per-trajectory
    scheduling): the hf engine's continuous batch, colocated vLLM's engine loop, or
    requests in flight to vLLM servers. One thread drives it. A key has at most one turn
    pending; each turn is sampled with its own seed and budget, as in `generate_turns`."""

    def submit(self, request: TurnRequest) -> None:
        """Start generating `request` (its key must not have a turn pending)."""
        ...

    def pending(self) -> int:
        """Turns submitted and not yet returned by `advance`."""
        ...

    def advance(self, timeout_s: float) -> list[tuple[TurnRequest, Completion]]:
        """Make progress and return the turns that finished: an engine that computes does
        one step (timeout_s unused); one that waits on servers waits at most timeout_s."""
        ...

    def release(self, key: int) -> None:
        """The trajectory `key` ended: whatever the stream kept for it (a KV cache, its
        server) may go."""
        ...

    def metrics(self) -> dict[str, float]:
        """What the stream did so far: prefill tokens computed and saved, evictions, load."""
        ...

    def close(self) -> None:
        """Abandon pending turns and free what the stream holds (idempotent)."""
        ...


class EngineVersionError(RuntimeError):
    """A generation request named a policy version the engine does not hold."""


@runtime_checkable
class Producer(Protocol):
    """Where the trainer's scored rollout batches come from: `pipeline.producers`'
    SyncProducer (made when asked) and AsyncProducer (a background thread), and under
    torchrun `distributed.rollout.MainRankProducer` (rank 0's behind a broadcast)."""

    def start(self) -> None:
        """Begin producing (a background thread starts; a sync producer has nothing to do)."""
        ...

    def next_batch(self, trainer_version: int) -> RolloutBatch:
        """The next scored batch, checked against the staleness bound at this version."""
        ...

    def report_progress(self, version: int, steps_left: int) -> None:
        """The trainer's version and the optimizer steps left on its batch (admission)."""
        ...

    def push_weights(
        self, version: int, tensors: Callable[[], Iterable[tuple[str, Tensor]]]
    ) -> float:
        """New weights for the generator as `version`; returns the seconds it took."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """As of the last batch handed out (what a resume continues from)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


# ------------------------------------------------ one process or torchrun, chosen at set-up


class StepRanks(Protocol):
    """What the no-grad passes and an optimizer step need of the trainer's ranks: one
    process (`train.ranks.OneProcess`: identities, torch's gradient clipping) or torchrun
    (`distributed.strategy.TorchrunRanks`: collectives, the sharded gradient norm).

    A step's groups are dealt to data-parallel *shares*: one per process, or under context
    parallelism one per context-parallel group, whose ranks all train on the share's
    micro-batches (distributed/mesh.py). `all_reduce` and `all_gather_object` count each
    share once; `all_true` asks every process."""

    rank: int  # this process's share (its data-parallel rank)
    world_size: int  # shares (data-parallel ranks): processes / context_parallel_size
    processes: int  # processes whose gradients are averaged (FSDP: every one)

    def all_reduce(self, values: Sequence[float], op: str = "sum") -> list[float]:
        """Over the shares (each counted once)."""
        ...

    def all_true(self, flag: bool) -> bool:
        """True on every process iff `flag` is True on every process."""
        ...

    def all_gather_object(self, obj: Any) -> list[Any]:
        """One entry per share, in share order."""
        ...

    def clip_gradients(self, parameters: list[Tensor], max_norm: float | None) -> float:
        """Clip the step's gradients to `max_norm` (None: measure only); the global norm."""
        ...

    def release_gathered(self, policy: Any) -> None:
        """After the no-grad passes: free whatever the passes left gathered (FSDP units)."""
        ...


@dataclass
class RestoredCheckpoint:
    """What a checkpoint gives back once model, optimizer, scheduler and RNGs are restored."""

    trainer_state: dict[str, Any]  # trainer_state.json
    bulky_state: dict[str, Any]  # trainer_state.pt ({} when saved without one), less `inflight`
    inflight: dict[str, Any] | None  # the batch in progress as this rank saved it (None: none)


class Checkpointer(Protocol):
    """Checkpoints of one run directory: written by one process (`checkpoint.local.
    LocalCheckpointer`) or by every torchrun rank, sharded (`checkpoint.sharded.
    ShardedCheckpointer`). Every rank calls every method."""

    def save(
        self,
        step: int,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        trainer_state: dict[str, Any],
        *,
        extra_files: dict[str, str],
        bulky_state: dict[str, Any],
        inflight: dict[str, Any] | None,
    ) -> Path:
        """`checkpoints/step-N`, atomically; `inflight` is the batch in progress (this
        rank's old/reference log-probs: a sharded save gathers every rank's)."""
        ...

    def load(self, path: Path, model: Any, optimizer: Any, scheduler: Any) -> RestoredCheckpoint:
        ...

    def save_final(self, model: Any, tokenizer: Any, step: int, version: int) -> Path:
        """`final/`, a directory transformers / peft / vLLM load directly, recording the
        step and policy version it holds (checkpoint/rundir.py FINAL_STATE)."""
        ...


class MetricsLog(Protocol):
    """The run's metrics: `metrics.logger.MetricsLogger`, or `NullLogger` on torchrun
    ranks > 0 (rank 0 writes metrics.jsonl)."""

    def stage(self, metrics: dict[str, Any]) -> None: ...

    def log(self, step: int, metrics: dict[str, Any]) -> None: ...

    def rows_logged_at(self, step: int) -> int: ...

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Strategy:
    """What differs between one process and torchrun, picked once at set-up
    (`distributed.strategy.choose_strategy`): the single-process pieces live in their roles'
    packages (assembled by train/strategy.py), the torchrun ones in distributed/ and
    checkpoint/sharded.py."""

    device: Any  # the torch.device the policy trains on
    reference_on_meta: bool  # full fine-tuning's reference starts on the meta device
    abandon_waits: bool  # a stop signal may cut short the wait for a batch
    # this process makes rollouts (engines, environment workers): one process always;
    # torchrun every rank with the hf engine, rank 0 alone with vLLM
    generates: bool
    ranks: StepRanks
    checkpointer: Checkpointer
    logger: Callable[..., MetricsLog]  # takes MetricsLogger's arguments
    # the policy sharded in place (torchrun); returns the per-rank hf engine's own copy
    shard: Callable[[Any], Any]
    weights: Callable[[Any], Iterable[tuple[str, Tensor]]]  # policy -> what engines receive
    # (this step's metrics, its tokens, this rank's seconds in collectives) -> logged ones
    reduce_metrics: Callable[[dict[str, float], float, float], dict[str, float]]
    stop_producer: Callable[[Producer, Any], None]  # (producer, its RankShare) at a clean end
