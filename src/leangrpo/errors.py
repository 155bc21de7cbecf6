"""Which exceptions are the user's to fix: the CLI prints them as one sentence (exit 2).

`UserError` is the base of every error whose message names the bad input and the fix:
ConfigError (config/io.py), DataError (data/files.py), RunDirError (checkpoint/rundir.py),
ModelFilesError (model/files.py), RewardSpecError and RewardFailedError
(rewards/registry.py) derive from it, each declared where its role lives. This module is
the lowest floor: it imports nothing of leangrpo and names no higher role's types, so an
error found by the cheap checks prints without torch ever being imported.
"""

from __future__ import annotations


class UserError(Exception):
    """One sentence naming the problem and the fix; the CLI prints it as is (exit 2)."""


class RunError(UserError, RuntimeError):
    """A run that cannot go on for a reason its user must fix (settings, data, services)."""


def is_user_error(exc: BaseException) -> bool:
    """The user's to fix, printed as one sentence: a UserError, or a file that is missing."""
    return isinstance(exc, UserError | FileNotFoundError)
