"""The agent section's checks that import nothing (preflight, before torch): the entry's
form, its file or module, and the command's program.

`check_agent(agent_cfg)` raises `AgentSpecError` (one sentence naming the key and the fix)
when `agent.entry` is not a Python file and a function or 'pkg.module:function', names a file that
does not exist, a file that defines no such top-level function (read, never executed), or
a module that cannot be found (found, never imported); or when `agent.command` is empty,
does not parse as a shell command line, or names a program that is neither on PATH nor a
file. Importing the agent is the workers' start-up (agents/episodes.py, in the sandbox).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shlex
import shutil
from pathlib import Path
from typing import Any

from leangrpo.errors import UserError

ENTRY_FORMS = "'path/to/agent.py:run' or 'package.module:run'"


class AgentSpecError(UserError):
    """agent.entry or agent.command cannot name an agent."""


def check_agent(agent_cfg: Any) -> None:
    if agent_cfg.entry is not None:
        check_entry(agent_cfg.entry)
    if agent_cfg.command is not None:
        check_command(agent_cfg.command)


def check_entry(entry: str) -> None:
    target, sep, attr = entry.rpartition(":")
    if not sep or not target or not attr.isidentifier():
        raise AgentSpecError(f"agent.entry = {entry!r} does not name a function; use {ENTRY_FORMS}.")
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise AgentSpecError(f"agent.entry = {entry!r}: file {path} not found; give the path of the agent's .py file (relative to where you run leangrpo).")
        if attr not in _top_level_names(path, entry):
            raise AgentSpecError(f"agent.entry = {entry!r}: {path.name} defines no top-level {attr!r}; name the function run(client, task) it defines.")
        return
    if not all(part.isidentifier() for part in target.split(".")):
        raise AgentSpecError(f"agent.entry = {entry!r}: {target!r} is not a module name; use {ENTRY_FORMS}.")
    try:
        found = importlib.util.find_spec(target)
    except (ImportError, ValueError):  # a parent package that is not there
        found = None
    if found is None:
        raise AgentSpecError(f"agent.entry = {entry!r}: module {target!r} not found; install it or put its folder on PYTHONPATH.")


def _top_level_names(path: Path, entry: str) -> set[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    except (SyntaxError, UnicodeDecodeError) as e:
        raise AgentSpecError(f"agent.entry = {entry!r}: {path.name} is not valid Python: {e}") from None
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def check_command(command: str) -> None:
    try:
        words = shlex.split(command)
    except ValueError as e:
        raise AgentSpecError(f"agent.command = {command!r} is not a shell command line ({e}); fix its quoting.") from None
    words = [w for w in words if "=" not in w or w.startswith(("/", "."))]  # VAR=value prefixes
    if not words:
        raise AgentSpecError("agent.command is empty; give the program to run once per episode, e.g. agent.command: python my_agent.py")
    program = words[0]
    if os.sep in program:
        if not Path(program).expanduser().is_file():
            raise AgentSpecError(f"agent.command = {command!r}: program {program} not found; give its path or a program on PATH.")
    elif shutil.which(program) is None:
        raise AgentSpecError(f"agent.command = {command!r}: program {program!r} is not on PATH; install it or give its path.")
