"""Which exceptions are the user's to fix: the CLI prints them as one sentence."""

from __future__ import annotations


def _user_error_types() -> tuple[type[BaseException], ...]:
    from leangrpo.config import ConfigError
    from leangrpo.data import DataError
    from leangrpo.rewards import RewardSpecError

    return (ConfigError, DataError, RewardSpecError, FileNotFoundError)


def __getattr__(name: str):
    if name == "USER_ERRORS":
        return _user_error_types()
    raise AttributeError(name)
