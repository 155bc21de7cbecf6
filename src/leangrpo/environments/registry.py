"""Names of environments, tools and tool parsers, resolved in an environment worker.

    environment.name   'tools' | 'verifiers' | 'pkg.module:Class' | 'path/to/file.py:Class'
    environment.tools  'pkg.module:function' | 'path/to/file.py:function', each
    tool_parser        'hermes' | 'pkg.module:function' | 'path/to/file.py:function'

or, the environment class and each tool, passed by value (the config's `value`, written by
`leangrpo.GRPO` for a class or function no module can import; the name is then its own).
Like reward functions (rewards/registry.py, whose `resolve` this uses: the one place a
reference becomes an object), they are imported or unpickled in worker processes only:
user code never runs in the trainer. `EnvironmentSpec` is what travels to a worker;
`spec_of(cfg.environment)` checks what needs no import (the forms, that files exist, that a
value is base64) in the trainer.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from leangrpo.errors import UserError

BUILTIN_ENVIRONMENTS = ("tools", "verifiers")
FORMS = "'pkg.module:Name' or 'path/to/file.py:Name'"


class EnvironmentSpecError(UserError):
    """The configured environment, a tool or the parser cannot be used (one sentence)."""


@dataclass(frozen=True)
class EnvironmentSpec:
    """The environment section as a worker needs it (paths absolute)."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    tools: tuple[tuple[str, str | None], ...] = ()  # (name, value: None when by name)
    parser: str = "hermes"
    value: str | None = None  # the environment class pickled by value (base64)


def spec_of(env_cfg: Any) -> EnvironmentSpec:
    """The section's names checked without importing anything; files made absolute."""
    value = getattr(env_cfg, "value", None)
    if value is not None:
        name = _by_value(env_cfg.name, value)
    else:
        name = _checked(env_cfg.name, "environment.name", BUILTIN_ENVIRONMENTS)
    tools = tuple(_tool(t, f"environment.tools[{i}]") for i, t in enumerate(env_cfg.tools))
    parser = _checked(env_cfg.tool_parser, "environment.tool_parser", ("hermes",))
    return EnvironmentSpec(name, dict(env_cfg.kwargs), tools, parser, value)


def _tool(entry: Any, key: str) -> tuple[str, str | None]:
    if isinstance(entry, str):
        return _checked(entry, key, ()), None
    return _by_value(entry.name, entry.value), entry.value


def _by_value(name: str, value: str) -> str:
    from leangrpo.rewards import RewardSpecError
    from leangrpo.rewards.registry import decode_value

    try:
        decode_value(name, value)
    except RewardSpecError as e:
        raise EnvironmentSpecError(str(e)) from None
    return name


def _checked(name: str, key: str, builtins: tuple[str, ...]) -> str:
    if name in builtins:
        return name
    target, sep, attr = name.rpartition(":")
    if not sep or not target or not attr.isidentifier():
        known = f"{', '.join(repr(b) for b in builtins)} or " if builtins else ""
        raise EnvironmentSpecError(
            f"{key} = {name!r} is not a name leangrpo knows; use {known}{FORMS}"
        )
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise EnvironmentSpecError(f"{key} = {name!r}: file {path} not found")
        return f"{path}:{attr}"
    if not all(part.isidentifier() for part in target.split(".")):
        raise EnvironmentSpecError(f"{key} = {name!r}: {target!r} is not a module name")
    return name


def load(name: str, key: str, value: str | None = None) -> Any:
    """The object `name` ('module:attr' or 'file.py:attr') names, or `value` unpickled
    (worker side)."""
    from leangrpo.rewards import RewardSpecError, resolve

    try:
        return resolve(name, value=value) if value is not None else resolve(_checked(name, key, ()))
    except RewardSpecError as e:
        raise EnvironmentSpecError(f"{key} = {name!r}: {e}") from None


def tool_functions(spec: EnvironmentSpec) -> list[Callable]:
    return [
        checked_tool(
            load(name, f"environment.tools[{i}]", value), f"environment.tools[{i}] = {name!r}"
        )
        for i, (name, value) in enumerate(spec.tools)
    ]


def checked_tool(fn: Any, label: str) -> Callable:
    """A tool is a plain function (or a bound method): the model calls it by its name with
    the arguments its schema lists."""
    if inspect.isfunction(fn) or inspect.ismethod(fn):
        return fn
    if isinstance(fn, type):
        why = f"the class {fn.__name__}, not a function; offer a function (type hints, a docstring) that uses it"
    else:
        why = f"a {type(fn).__name__} object, not a function; a tool is a function with type hints and a docstring"
    raise EnvironmentSpecError(f"{label} is {why}")


def offered_tools(env: Any, configured: list[Callable], spec: EnvironmentSpec) -> list[Callable]:
    """The environment's tools (its class's and the configured ones), each a function and
    no two with one name (the model calls them by name: one would shadow the other)."""
    offered = list(env.offered_tools())
    own = len(offered) - len(configured)  # the class's come first, the configured ones last
    seen: dict[str, str] = {}
    tools = []
    for j, fn in enumerate(offered):
        is_own = j < own or offered[own:] != configured
        label = f"{type(env).__name__}.tools[{j}]" if is_own else f"environment.tools[{j - own}] = {spec.tools[j - own][0]!r}"  # fmt: skip
        checked_tool(fn, label)
        name = fn.__name__
        if name in seen:
            raise EnvironmentSpecError(
                f"{label} and {seen[name]} are both named {name!r}; the model calls tools by name, so one would shadow the other: rename one"
            )
        seen[name] = label
        tools.append(fn)
    return tools


def tool_parser(spec: EnvironmentSpec) -> Callable[[str], Any]:
    if spec.parser == "hermes":
        from leangrpo.environments.tools import parse_hermes

        return parse_hermes
    fn = load(spec.parser, "environment.tool_parser")
    if not callable(fn):
        raise EnvironmentSpecError(f"environment.tool_parser = {spec.parser!r} is not a function")
    return fn
