"""The replay buffer: groups with reward variance from finished batches, to stand in for
flat groups (scored, without variance: every advantage 0) of later batches. Also the
signal predicates the re-roll rule shares (`has_signal`, `is_flat`).
"""

from __future__ import annotations

import collections
from dataclasses import replace

from leangrpo.checkpoint.local import sample_from_state, sample_state
from leangrpo.contracts import RolloutSample


class ReplayBuffer:
    """Groups with reward variance from batches already finished, to stand in for flat ones.

    A group is added once its own batch is finished, so a stand-in always comes from an
    earlier batch; `take` hands each group out once, as a copy with a group id of its own
    (-1, -2, ...: generated ids are >= 0), its versions and behaviour log-probs kept.
    """

    def __init__(self, capacity: int):
        self.groups: collections.deque[list[RolloutSample]] = collections.deque(maxlen=capacity)
        self.taken = 0  # stand-ins handed out so far: the next one's group id is -(taken + 1)

    def add(self, group: list[RolloutSample]) -> None:
        if has_signal(group) and not any(s.replayed for s in group):
            self.groups.append(group)

    def take(self, min_version: int) -> list[RolloutSample] | None:
        """The oldest buffered group generated at `min_version` or later (older ones are
        discarded on the way), or None."""
        while self.groups:
            group = self.groups.popleft()
            if min(s.version for s in group) >= min_version:
                self.taken += 1
                return [_as_replayed(s, -self.taken) for s in group]
        return None

    def state_dict(self) -> dict:
        return {"groups": [[sample_state(s) for s in g] for g in self.groups], "taken": self.taken}

    def load_state_dict(self, state: dict | list) -> None:
        if isinstance(state, list):  # checkpoints before stand-ins had ids of their own
            state = {"groups": state, "taken": 0}
        self.groups.clear()
        self.groups.extend([sample_from_state(s) for s in g] for g in state["groups"])
        self.taken = state["taken"]


def has_signal(group: list[RolloutSample]) -> bool:
    rewards = [s.reward for s in group if s.reward is not None]
    return len(rewards) >= 2 and max(rewards) > min(rewards)


def is_flat(group: list[RolloutSample]) -> bool:
    """Scored, but without reward variance: every advantage of the group is 0."""
    return any(s.reward is not None for s in group) and not has_signal(group)


def _as_replayed(sample: RolloutSample, group_id: int) -> RolloutSample:
    return replace(sample, group_id=group_id, replayed=True, advantage=0.0)
