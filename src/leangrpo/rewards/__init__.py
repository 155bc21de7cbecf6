"""Reward functions: a registry (built-ins, `module:function`, `file.py:function`) and a
pool of worker processes that runs them with a time limit. See registry.py and pool.py."""

from leangrpo.rewards.pool import RewardPool
from leangrpo.rewards.registry import (
    BUILTIN_NAMES,
    ResolvedReward,
    RewardError,
    RewardSpecError,
    check_rewards,
    resolve,
)

__all__ = [
    "BUILTIN_NAMES",
    "RewardError",
    "RewardPool",
    "ResolvedReward",
    "RewardSpecError",
    "check_rewards",
    "resolve",
]
