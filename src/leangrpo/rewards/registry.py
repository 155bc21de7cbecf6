"""Resolve reward-function names to callables, and every reference to user code (rewards,
environments, tools, parsers) to its object in a worker: `resolve`, the one place.

A name takes one of three forms:

    math | format | length            a built-in (leangrpo.rewards.builtin)
    package.module:function           imported with importlib.import_module
    path/to/file.py:function          loaded from the file (relative to the working directory)

or a reference carries the object itself, pickled by value (cloudpickle, base64: the
config's `value` beside the name, which is then only the object's name): what
`leangrpo.GRPO` sends for a function or class defined in `__main__` or a notebook, which no
module can import (api/shipping.py makes and checks it in the trainer, never unpickling).
It is unpickled here, in the worker, after the sandbox is set up; a payload that does not
unpickle there (a module the worker cannot import) is one RewardSpecError.

Every reward has the signature `fn(prompts, completions, **columns) -> list[float | None]`:
`prompts` and `completions` are aligned lists of strings, each extra data column arrives as
an aligned list under its own name, and the spec's `kwargs` are passed as keyword arguments
too (a kwarg wins over a data column of the same name). Multi-turn trajectories add the
columns `messages`, `num_turns`, `tool_calls` and `env_rewards` (pool.py
`trajectory_columns`); `completions` is then each trajectory's last model turn.

Functions travel to the worker processes as a `ResolvedReward` (name, resolved file path,
kwargs, or the pickled value) and are resolved there only, never in the trainer: importing
or unpickling user code may exit, hang or print (check.py resolves it in a worker with a
time limit), and the worker must not depend on the trainer's memory (a value is a copy,
checked in the trainer for what it holds before it is sent).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import importlib
import importlib.util
import math
import pickle
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from leangrpo.errors import UserError

RewardFn = Callable[..., list]

BUILTIN_NAMES = ("math", "format", "length")
ACCEPTED_FORMS = (
    "a built-in (math, format, length), 'package.module:function' or 'path/to/file.py:function'"
)


class RewardError(RuntimeError):
    """A reward function failed while scoring (with rewards.fail_fast), or its pool broke."""


class RewardSpecError(RewardError, ValueError, UserError):
    """A configured reward function cannot be resolved or its kwargs are wrong."""


class RewardFailedError(RewardError, UserError):
    """With rewards.fail_fast: a reward function failed on a sample (a user error: the CLI
    prints it as one sentence)."""


class PoolClosedError(RewardError):
    """The pool was closed (by another thread, at shutdown) while or before scoring."""


@dataclass(frozen=True)
class ResolvedReward:
    """One configured reward function, in a form a worker process can resolve by itself."""

    key: str  # metric / `sample.rewards` key: the function name, made unique
    name: str  # as written in the config
    weight: float
    kwargs: dict[str, Any] = field(default_factory=dict)
    file: str | None = None  # absolute path for the file form
    value: str | None = None  # the function pickled by value (base64); `name` is its name


def resolve(name: str, file: str | None = None, value: str | None = None) -> Any:
    """The object a reference names (worker side): `value` unpickled, a built-in, or `name`
    imported; `file` (absolute) overrides the path in the file form."""
    if value is not None:
        return unpickle_value(name, value)
    if name in BUILTIN_NAMES:
        from leangrpo.rewards import builtin

        return builtin.BUILTINS[name]
    target, sep, attr = name.rpartition(":")
    if not sep or not target or not attr:
        raise RewardSpecError(f"'{name}' is not a reward name; use {ACCEPTED_FORMS}")
    if target.endswith(".py"):
        module = _load_file(Path(file or target))
    else:
        module = _import_module(target)
    fn = getattr(module, attr, None)
    if fn is None:
        available = sorted(
            n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
        )
        raise RewardSpecError(
            f"'{target}' has no attribute '{attr}' (its public callables: {', '.join(available) or 'none'})"
        )
    if not callable(fn):
        raise RewardSpecError(f"'{target}:{attr}' is a {type(fn).__name__}, not a function")
    return fn


def decode_value(name: str, value: str) -> bytes:
    """The pickled bytes of a by-value reference (trainer and worker: no unpickling)."""
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise RewardSpecError(
            f"the value of '{name}' is not base64-encoded pickled bytes; pass the function itself to leangrpo.GRPO, which writes this value"
        ) from None


def unpickle_value(name: str, value: str) -> Any:
    payload = decode_value(name, value)
    try:
        obj = pickle.loads(payload)
    except Exception as e:
        raise RewardSpecError(
            f"'{name}' (passed by value) could not be unpickled in the worker: {type(e).__name__}: {e}; a module it needs must be importable there (installed, or on sys.path)"
        ) from e
    if not callable(obj):
        raise RewardSpecError(
            f"'{name}' (passed by value) is a {type(obj).__name__}, not a function"
        )
    return obj


def _import_module(module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name.startswith(e.name):
            raise RewardSpecError(
                f"module '{module_name}' not found (is it installed or on PYTHONPATH?)"
            ) from e
        raise RewardSpecError(f"importing module '{module_name}' failed: {e}") from e
    except Exception as e:
        raise RewardSpecError(
            f"importing module '{module_name}' failed: {type(e).__name__}: {e}"
        ) from e


def _load_file(path: Path) -> Any:
    path = path.expanduser().resolve()
    if not path.is_file():
        raise RewardSpecError(f"file {path} not found")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", path.stem)
    module_name = f"leangrpo_user_reward_{stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    folder = str(path.parent)  # modules beside the file import, as under `python file.py`
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RewardSpecError(f"file {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # before exec: dataclasses/pickle look it up there
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise RewardSpecError(f"executing {path} failed: {type(e).__name__}: {e}") from e
    return module


def _display_name(name: str) -> str:
    return name if name in BUILTIN_NAMES else name.rpartition(":")[2]


def _check_name(name: str) -> str | None:
    """The absolute file of a file-form name (None otherwise), after the checks that need no
    import: the form, identifiers, the file's existence. RewardSpecError if one fails."""
    if name in BUILTIN_NAMES:
        return None
    target, sep, attr = name.rpartition(":")
    if not sep or not target or not attr:
        raise RewardSpecError(f"'{name}' is not a reward name")
    if not attr.isidentifier():
        raise RewardSpecError(f"'{attr}' is not a Python function name")
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise RewardSpecError(f"file {path} not found")
        return str(path)
    if not all(part.isidentifier() for part in target.split(".")):
        raise RewardSpecError(f"'{target}' is not a module name")
    return None


def parse_specs(rewards_cfg: Any) -> list[ResolvedReward]:
    """The configured functions as specs, after every check that imports nothing (names,
    files, built-in kwargs, weights). `check_rewards` adds the import check in a worker."""
    functions = list(getattr(rewards_cfg, "functions", None) or [])  # none: env rewards only
    specs: list[ResolvedReward] = []
    seen: dict[str, int] = {}
    for i, fn_cfg in enumerate(functions):
        where = f"rewards.functions[{i}]"
        name = str(fn_cfg.name)
        weight = float(getattr(fn_cfg, "weight", 1.0))
        kwargs = dict(getattr(fn_cfg, "kwargs", None) or {})
        value = getattr(fn_cfg, "value", None)
        if not math.isfinite(weight):
            raise RewardSpecError(f"{where}.weight = {weight} must be a finite number")
        if value is not None:  # by value: `name` is the function's own name
            try:
                decode_value(name, value)
            except RewardSpecError as e:
                raise RewardSpecError(f"{where}.value: {e}") from None
            key = _unique_key(name.rpartition(":")[2] or name, seen)
            specs.append(ResolvedReward(key, name, weight, kwargs, value=value))
            continue
        try:
            file = _check_name(name)
        except RewardSpecError as e:
            raise RewardSpecError(
                f"{where}.name = '{name}': {e}; accepted forms: {ACCEPTED_FORMS}"
            ) from None
        if name in BUILTIN_NAMES:
            from leangrpo.rewards import builtin

            try:
                builtin.check_kwargs(name, kwargs)
            except ValueError as e:
                raise RewardSpecError(f"{where}.kwargs: {e}") from None
        key = _unique_key(_display_name(name), seen)
        specs.append(ResolvedReward(key=key, name=name, weight=weight, kwargs=kwargs, file=file))
    return specs


def _unique_key(base: str, seen: dict[str, int]) -> str:
    seen[base] = seen.get(base, 0) + 1
    return base if seen[base] == 1 else f"{base}_{seen[base]}"


def is_user_code(spec: ResolvedReward) -> bool:
    """Imported or unpickled in a worker (the start-up check resolves it first)."""
    return spec.value is not None or spec.name not in BUILTIN_NAMES
