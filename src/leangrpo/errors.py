"""Which exceptions are the user's to fix: the CLI prints them as one sentence."""

from __future__ import annotations


class RunError(RuntimeError):
    """A run that cannot go on for a reason its user must fix (settings, data, services)."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """Imported on demand so that `leangrpo --help` stays instant."""
    from leangrpo.config import ConfigError
    from leangrpo.data import DataError
    from leangrpo.rewards import RewardSpecError

    return (ConfigError, DataError, RewardSpecError, FileNotFoundError, RunError)
