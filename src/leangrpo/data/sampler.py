"""The order prompts are served in: `PromptSampler` hands out fixed-size batches over epochs.

Each epoch's order is a permutation drawn from numpy's Generator seeded by (seed, epoch),
never the global RNG, so the order is a pure function of (seed, epoch, position) and
resumes exactly. Re-queued prompts (re-rolls) are served first; the queue is part of the
state (`state_dict` / `load_state_dict`).
"""

from __future__ import annotations

from collections import deque

from leangrpo.contracts import Prompt
from leangrpo.data.files import DataError


class PromptSampler:
    """Deterministic, resumable batches of prompts over epochs, re-queued prompts first."""

    def __init__(self, prompts: list[Prompt], batch_size: int, seed: int = 0, shuffle: bool = True):
        if not prompts:
            raise DataError("no prompts to sample from; check data.path and data.max_prompt_tokens")
        if batch_size < 1:
            raise DataError(f"batch size {batch_size} must be >= 1 (rollout.prompts_per_batch)")
        self._prompts = list(prompts)
        self._by_uid = {p.uid: p for p in self._prompts}
        if len(self._by_uid) != len(self._prompts):
            raise DataError("prompt uids must be unique (they are row indices)")
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self._epoch, self._position = 0, 0
        self._order = self._permutation(0)
        self._requeued: deque[int] = deque()

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        return self._position

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self._prompts)))
        import numpy as np

        return np.random.default_rng([self.seed, epoch]).permutation(len(self._prompts)).tolist()

    def next_batch(self) -> list[Prompt]:
        batch = []
        while self._requeued and len(batch) < self.batch_size:
            batch.append(self._by_uid[self._requeued.popleft()])
        while len(batch) < self.batch_size:
            if self._position == len(self._order):
                self._epoch += 1
                self._position = 0
                self._order = self._permutation(self._epoch)
            batch.append(self._prompts[self._order[self._position]])
            self._position += 1
        return batch

    def requeue(self, prompts: list[Prompt]) -> None:
        """Serve these prompts again, before any new ones, from the next call on."""
        self.requeue_uids([p.uid for p in prompts])

    def requeue_uids(self, uids: list[int]) -> None:
        """`requeue` by uid (what a checkpoint stores)."""
        for uid in uids:
            if uid not in self._by_uid:
                raise DataError(f"cannot re-queue prompt uid {uid}: it is not in this sampler")
            self._requeued.append(uid)

    def state_dict(self) -> dict:
        return {
            "epoch": self._epoch,
            "position": self._position,
            "requeued": list(self._requeued),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": len(self._prompts),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["num_prompts"] != len(self._prompts):
            raise DataError(
                f"the saved sampler state is for {state['num_prompts']} prompts but "
                f"{len(self._prompts)} are loaded; resume with the same data settings"
            )
        unknown = [uid for uid in state["requeued"] if uid not in self._by_uid]
        if unknown:
            raise DataError(f"the saved sampler state re-queues unknown prompt uids {unknown[:5]}")
        self.seed, self.shuffle = state["seed"], state["shuffle"]
        self._epoch, self._position = state["epoch"], state["position"]
        self._order = self._permutation(self._epoch)
        self._requeued = deque(state["requeued"])
