"""A served distillation teacher (`distill.teacher_urls`): its log-probs of the sampled
tokens from `leangrpo serve TEACHER` processes instead of a forward in the trainer.

The batch is already planned when the teacher is asked: each packed micro-batch is read
back into its sequences (`scored_sequences`: the plain layout's segments, or a shared
prefix's prompt followed by each completion of its group) and, for each of its T
completion tokens in the batch's order, the sequence it belongs to and its position
there (its predicting position's `position_ids` + 1: the layouts' positions are the
sequence's own). The servers get every micro-batch's sequences of the batch at once
(rollout/vllm/client.py `ServerPool.score`: spread evenly over the servers, a failed
server's share re-sent to another, a reply that is not the log-probs asked for a
failure too, a server marked down probed before the next batch, one error when none
answers within distill.teacher_timeout_s), score them with vLLM's
prompt log-probs (the log-softmax of the unscaled logits over the full vocabulary, no
filter: the reference's transformation at temperature 1, which the config requires), and
the (T,) float32 log-probs land on `PackedBatch.teacher_logprobs` exactly where the local
teacher's do, so they are kept with the batch in progress and resumed like them.

Multi-turn trajectories are sent whole: the environment's tokens are context, and only the
model's tokens (the batch's completion tokens) are read from the reply. Each sequence is
scored from its first completion token on (`starts`), so the reply holds no prompt
positions. The request runs while the trainer's own old and reference passes run
(`start` then `PendingScores.attach`, train/passes.py). A padding micro-batch (torchrun)
runs no loss and gets zeros without a request.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from leangrpo.config.distill import DistillConfig
from leangrpo.contracts import EngineVersionError, PackedBatch
from leangrpo.distill.check import URLS_KEY, TeacherServerError, one_sentence
from leangrpo.rollout.vllm.client import ServerPool, VLLMServerError, read_token


@dataclass
class ScoredSequences:
    """One micro-batch read back into sequences: `sequences[s]` the ids of sequence s in
    its own order, and for each completion token t, `token_seq[t]` and `positions[t]` (the
    position of its target in that sequence)."""

    sequences: list[list[int]]
    token_seq: list[int]
    positions: list[int]

    def starts(self) -> list[int]:
        """Each sequence's first scored position (its first completion token's)."""
        first = [len(ids) for ids in self.sequences]
        for s, position in zip(self.token_seq, self.positions):
            first[s] = min(first[s], position)
        return first


def scored_sequences(batch: PackedBatch) -> ScoredSequences:
    """The sequences of a packed micro-batch and where its completion tokens sit in them
    (see the module docstring); checked against the batch's targets."""
    row = batch.input_ids[0].tolist()
    prefix = getattr(batch, "prefix", None)  # train/packing.py PrefixPackedBatch
    if prefix is None:
        cu = batch.cu_seqlens.tolist()
        sequences = [row[a:b] for a, b in zip(cu, cu[1:])]
    else:
        sequences = []
        for group in prefix.groups:
            prompt = row[group.prompt_start : group.prompt_start + group.prompt_len]
            for start, length in zip(group.completion_starts, group.completion_lens):
                sequences.append(prompt + row[start : start + length])
    positions = (batch.position_ids[0][batch.completion_index] + 1).tolist()
    token_seq = batch.token_seq.tolist()
    targets = batch.targets.tolist()
    for t, (s, position) in enumerate(zip(token_seq, positions)):
        ids = sequences[s]
        if position >= len(ids) or ids[position] != targets[t]:
            raise RuntimeError(
                f"completion token {t} of the micro-batch ({targets[t]}) is not at position "
                f"{position} of its sequence {s}: the packed layout was misread"
            )
    return ScoredSequences(sequences, token_seq, positions)


class ServedTeacher:
    """The client of the servers in distill.teacher_urls (their health asked at start)."""

    def __init__(self, distill: DistillConfig):
        with teacher_errors():
            token = read_token(distill.teacher_token_file, "distill.teacher_token_file")
            self.pool = ServerPool(
                distill.teacher_urls, timeout_s=distill.teacher_timeout_s, token=token,
                key=URLS_KEY,
            )  # fmt: skip
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="teacher")

    def start(self, batches: list[PackedBatch], temperature: float) -> PendingScores:
        """Send every real micro-batch's sequences to the servers; `attach` waits.
        `temperature`: the run's (the servers score at 1 only, as the config requires)."""
        real = [mb for mb in batches if not mb.padding]
        read = [scored_sequences(mb) for mb in real]
        sequences = [ids for r in read for ids in r.sequences]
        starts = [start for r in read for start in r.starts()]
        future = self._thread.submit(self.pool.score, sequences, starts, temperature)
        return PendingScores(batches, read, starts, future)

    def close(self) -> None:
        self._thread.shutdown(wait=False)
        self.pool.close()


@dataclass
class PendingScores:
    """A batch's scoring request in flight."""

    batches: list[PackedBatch]
    read: list[ScoredSequences]
    starts: list[int]
    future: Future

    def attach(self) -> None:
        """Wait for the servers' reply and set every micro-batch's teacher log-probs
        (padding micro-batches: zeros)."""
        with teacher_errors():
            replies = iter(zip(self.future.result(), self.starts))
        read = iter(self.read)
        for mb in self.batches:
            device = mb.targets.device
            if mb.padding:
                mb.teacher_logprobs = torch.zeros(mb.num_completion_tokens, device=device)
                continue
            seqs = next(read)
            rows = [next(replies) for _ in seqs.sequences]
            values = [rows[s][0][p - rows[s][1]] for s, p in zip(seqs.token_seq, seqs.positions)]
            mb.teacher_logprobs = torch.tensor(values, dtype=torch.float32, device=device)


@contextmanager
def teacher_errors() -> Iterator[None]:
    """A server that cannot be reached or refuses (every one of them, for a request) as
    one `TeacherServerError` sentence naming distill.teacher_urls."""
    try:
        yield
    except (ValueError, VLLMServerError, EngineVersionError) as error:
        raise TeacherServerError(f"{URLS_KEY}: {one_sentence(error)}.") from None
