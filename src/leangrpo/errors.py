"""Which exceptions are the user's to fix: the CLI prints them as one sentence (exit 2).

`UserError` is the base of every error whose message names the bad input and the fix:
ConfigError (config/io.py), DataError (data/files.py), RunDirError (checkpoint/rundir.py)
and ModelFilesError (model/files.py) derive from it. This module imports nothing heavy, and
neither do the modules `user_error_types` imports, so that an error found by the cheap
checks prints without torch ever being imported.
"""

from __future__ import annotations


class UserError(Exception):
    """One sentence naming the problem and the fix; the CLI prints it as is (exit 2)."""


class RunError(UserError, RuntimeError):
    """A run that cannot go on for a reason its user must fix (settings, data, services)."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """Imported on demand so that `leangrpo --help` stays instant."""
    from leangrpo.rewards import RewardFailedError, RewardSpecError

    return (UserError, RewardSpecError, RewardFailedError, FileNotFoundError)
