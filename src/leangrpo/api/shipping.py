"""User code given as Python objects, sent to the workers: by name when they can import it,
else by value.

`reference(obj, label)` is what the config holds for a reward function, a tool or an
environment class passed to `leangrpo.GRPO` as an object:

- `'module:name'` when a worker can import it by that name: defined at the top level of a
  module other than `__main__` that the import system finds (the workers get the trainer's
  `sys.path`), under which this very object is found;
- else `ByValue(name, value)`: cloudpickle's bytes, base64 (the config's `value`), for
  functions and classes defined in `__main__` or a notebook cell, lambdas, closures,
  callable objects. The trainer never unpickles them: the workers do, once their sandbox
  is set up (rewards/registry.py `resolve`).

Before a value is made, what the object holds (closure variables, the globals its code
reads, defaults, a bound method's object, a class's attributes and methods, a callable
object's attributes) is pickled one by one, so a refusal names the first that cannot go,
and what inside it: one that does not pickle (a lock, a socket, a generator), an open file
(cloudpickle would read a readable one's contents in the trainer and send them),
`os.environ` (cloudpickle would copy every variable, secrets included, past the sandbox's
allow-listed environment and into config.yaml), a model or a model's weight (a
`torch.nn.Module` or `Parameter`: every worker would hold a copy, and a copy of the
trainer's model is not the model being trained), a leangrpo run or its machinery
(anything of leangrpo's but plain data: config sections, dataclasses), or more than
`MAX_VALUE_BYTES` of pickled state. What a function reads from its globals is copied into
the config: a secret it holds as a string would be too (the sandbox passes the variables
`pass_env` names instead), so a held object, or the whole value, whose pickled bytes
contain the value of an environment variable that looks secret (`secret_variables`: a
name with KEY, TOKEN, SECRET, PASSWORD or CREDENTIAL, a value of 8 characters or more) is
refused naming the variable: `dict(os.environ)`, a settings object that copied a token,
a literal pasted into the code. One sentence (`ShippingError`,
a UserError), raised when the config is built: before any check, worker or model load.
"""

from __future__ import annotations

import base64
import importlib.util
import inspect
import io
import os
import re
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import cloudpickle

from leangrpo.errors import UserError

MAX_VALUE_BYTES = 1 << 20  # the value is kept in config.yaml and every checkpoint's copy
MAX_DEPTH = 4  # how deep a refusal follows functions and classes held by value
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)
MIN_SECRET_CHARS = 8  # shorter values would match by chance
FIX = "define it in a module the workers can import (it is then sent by name), or create what it needs inside it"


class ShippingError(UserError):
    """A Python object given to leangrpo.GRPO cannot be sent to the workers (one sentence)."""


@dataclass(frozen=True)
class ByValue:
    """A function or class sent by value: its name and cloudpickle's bytes, base64."""

    name: str
    value: str


def reference(obj: Any, label: str) -> str | ByValue:
    """What the config holds for `obj` (see the module docstring); `label` names it in a
    refusal, e.g. "reward_funcs[0]"."""
    name = importable_name(obj)
    if name is not None:
        return name
    return ByValue(display_name(obj), base64.b64encode(pickled(obj, label)).decode("ascii"))


def display_name(obj: Any) -> str:
    """The object's name as metrics and messages show it ('<lambda>' becomes 'lambda')."""
    name = getattr(obj, "__name__", None) or getattr(getattr(obj, "func", None), "__name__", None)
    name = name or type(obj).__name__
    return "".join(c if c.isalnum() or c == "_" else "" for c in name) or "function"


def importable_name(obj: Any) -> str | None:
    """'module:name' when importing `module` in a fresh process gives `obj` as `name`."""
    module_name = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module_name, str) or module_name in ("__main__", "__mp_main__"):
        return None
    if not isinstance(qualname, str) or not qualname.isidentifier():
        return None  # a lambda, a nested function, a method
    module = sys.modules.get(module_name)
    if module is None or getattr(module, qualname, None) is not obj:
        return None
    loaded = getattr(module, "__spec__", None)
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None
    if loaded is None or found is None or found.origin != loaded.origin:
        return None  # loaded from a file by path, or made at run time: not found by name
    return f"{module_name}:{qualname}"


# -- by value ---------------------------------------------------------------------------------


class _Refused(Exception):
    """A held object that must not be sent, whatever pickle would make of it."""


class _CheckingPickler(cloudpickle.Pickler):
    """cloudpickle's pickler, refusing models and leangrpo's machinery on the way."""

    def reducer_override(self, obj: Any) -> Any:
        why = refusal(obj)
        if why is not None:
            raise _Refused(why)
        return super().reducer_override(obj)


def refusal(obj: Any) -> str | None:
    """Why `obj` must not be sent though it may pickle; None when it may."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.nn.Module):
        return f"a model (a {type(obj).__name__}, a torch.nn.Module): every worker would get a copy of it, not the model being trained"
    if torch is not None and isinstance(obj, torch.nn.Parameter):
        return "a model's weight (a torch.nn.Parameter): every worker would get a copy of it, not the weight being trained"
    if isinstance(obj, os._Environ):  # cloudpickle would copy every variable, secrets too
        return "the trainer's environment variables (os.environ): the workers get an allow-listed environment; name what a function needs in the sandbox's pass_env"
    if isinstance(obj, io.IOBase):  # cloudpickle would send a readable file's contents
        return f"an open file (a {type(obj).__name__}): its descriptor is the trainer's, and its contents are not the worker's to read"
    module = getattr(type(obj), "__module__", "") or ""
    if module.startswith("leangrpo.") and not isinstance(obj, type) and _is_machinery(obj):
        return f"leangrpo's own {type(obj).__name__}, which stays in the trainer"
    return None


def secret_variables() -> dict[str, bytes]:
    """The environment variables that look secret (SECRET_NAME, MIN_SECRET_CHARS; not a
    path that exists, such as a key file's, which a code object's file name may contain),
    by name: their values as UTF-8, as pickle writes a string."""
    return {
        name: value.encode("utf-8", "surrogateescape")
        for name, value in os.environ.items()
        if SECRET_NAME.search(name) and len(value) >= MIN_SECRET_CHARS and not os.path.exists(value)
    }


def secret_in(payload: bytes) -> str | None:
    """The name of the first secret-looking environment variable whose value `payload`
    (pickled bytes) contains; None when none does."""
    found = (name for name, value in sorted(secret_variables().items()) if value in payload)
    return next(found, None)


def _secret_refusal(name: str) -> str:
    return f"the value of the environment variable {name}, a secret that would be copied into config.yaml and every checkpoint (name it in the sandbox's pass_env and read os.environ inside the function)"


def _is_machinery(obj: Any) -> bool:
    """A leangrpo object that is not plain data (config sections, dataclasses of results)."""
    from pydantic import BaseModel

    return not (isinstance(obj, BaseModel) or hasattr(type(obj), "__dataclass_fields__"))


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _CheckingPickler(buffer, protocol=5).dump(obj)
    return buffer.getvalue()


def pickled(obj: Any, label: str) -> bytes:
    """cloudpickle's bytes of `obj`, after what it holds has been checked."""
    what = f"{label} ({display_name(obj)!r})"
    found = _first_problem(obj, depth=0, seen=set())
    if found is not None:
        raise ShippingError(
            f"{what} cannot be sent to the workers by value: it holds {found}; {FIX}."
        )
    try:
        payload = _dumps(obj)
        secret = secret_in(payload)
        if secret is not None:  # in the code itself (a literal), or where held() does not look
            raise _Refused(_secret_refusal(secret))
    except _Refused as e:
        raise ShippingError(
            f"{what} cannot be sent to the workers by value: it holds {e}; {FIX}."
        ) from None
    except Exception as e:  # a problem the held objects did not show alone
        raise ShippingError(
            f"{what} cannot be sent to the workers by value: {type(e).__name__}: {e}; {FIX}."
        ) from None
    if len(payload) > MAX_VALUE_BYTES:
        largest = max(held(obj), key=lambda item: _size(item[1]), default=None)
        inside = f", most of it {largest[0]} ({_size(largest[1]) >> 10} KiB)" if largest else ""
        raise ShippingError(
            f"{what} pickles to {len(payload) >> 10} KiB{inside}, over the {MAX_VALUE_BYTES >> 10} KiB a function sent by value may take (it is kept in config.yaml); pass large data as a data column, or read it from a file inside the function."
        )
    return payload


def _first_problem(obj: Any, depth: int, seen: set[int]) -> str | None:
    """'the global `x` (a T), which holds ...' for the first held object that cannot be
    sent, followed into functions and classes sent by value; None when all can."""
    for where, value in held(obj):
        if id(value) in seen:
            continue
        seen.add(id(value))
        why = refusal(value)
        if why is not None:  # the object itself
            return f"{where}, {why}"
        try:
            secret = secret_in(_dumps(value))
            if secret is None:
                continue
            inner = f"which holds {_secret_refusal(secret)}"
        except _Refused as e:  # something inside it
            inner = f"which holds {e}"
        except Exception as e:  # pickle's own: "cannot pickle '_thread.lock' object"
            inner = f"which cannot be pickled ({type(e).__name__}: {e})"
        if depth < MAX_DEPTH and _by_value(value):
            deeper = _first_problem(value, depth + 1, seen)
            if deeper is not None:
                inner = f"which holds {deeper}"
        return f"{where} ({_kind(value)}), {inner}"
    return None


def _by_value(value: Any) -> bool:
    """A function, method or class cloudpickle sends by value (not by name)."""
    if inspect.isfunction(value) or inspect.ismethod(value) or isinstance(value, type):
        return importable_name(value) is None
    return False


def _kind(value: Any) -> str:
    if inspect.isfunction(value):
        return "a function"
    if isinstance(value, type):
        return "a class"
    name = type(value).__name__
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


def _size(value: Any) -> int:
    try:
        return len(cloudpickle.dumps(value))
    except Exception:  # noqa: BLE001  sized only to name the largest
        return 0


def held(obj: Any) -> Iterator[tuple[str, Any]]:
    """(where, value) for what `obj` holds that pickling it by value would send."""
    if inspect.ismethod(obj):
        yield "its object (self)", obj.__self__
        yield from held(obj.__func__)
    elif inspect.isfunction(obj):
        yield from _function_held(obj)
    elif isinstance(obj, type):
        yield from _class_held(obj)
    elif isinstance(obj, types.BuiltinFunctionType):
        return
    else:  # a callable object: its attributes, and its class when that goes by value
        for name, value in sorted(getattr(obj, "__dict__", {}).items()):
            yield f"the attribute `{name}`", value
        if _by_value(type(obj)):
            yield from _class_held(type(obj))


def _function_held(fn: types.FunctionType) -> Iterator[tuple[str, Any]]:
    code = fn.__code__
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            yield f"the closure variable `{name}`", cell.cell_contents
        except ValueError:  # an empty cell: a name assigned later in the enclosing scope
            continue
    for name in sorted(global_names(code)):
        if name in fn.__globals__:
            yield f"the global `{name}`", fn.__globals__[name]
    for value in fn.__defaults__ or ():
        yield "a default argument", value
    for name, value in sorted((fn.__kwdefaults__ or {}).items()):
        yield f"the default of `{name}`", value


def _class_held(cls: type) -> Iterator[tuple[str, Any]]:
    for name, attr in vars(cls).items():
        if name in ("__dict__", "__weakref__", "__module__", "__qualname__", "__doc__"):
            continue
        fn = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
        if isinstance(fn, property):
            fn = fn.fget
        if inspect.isfunction(fn):
            for where, value in _function_held(fn):
                yield f"{where} of {cls.__name__}.{name}", value
        elif not (name.startswith("__") and name.endswith("__")):
            yield f"the class attribute `{cls.__name__}.{name}`", attr


def global_names(code: types.CodeType) -> set[str]:
    """The global names `code` and the code nested in it read (cloudpickle sends these)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= global_names(const)
    return names
