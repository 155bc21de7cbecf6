"""Which exceptions are the user's to fix: the CLI prints them as one sentence."""

from __future__ import annotations


def user_error_types() -> tuple[type[BaseException], ...]:
    """Imported on demand so that `leangrpo --help` stays instant."""
    from leangrpo.config import ConfigError
    from leangrpo.data import DataError
    from leangrpo.rewards import RewardFailedError, RewardSpecError

    return (ConfigError, DataError, RewardSpecError, RewardFailedError, FileNotFoundError)
