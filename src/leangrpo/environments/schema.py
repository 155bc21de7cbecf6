"""A tool's JSON schema from its type hints and Google-style docstring: the schema
`transformers.utils.get_json_schema` makes, made here without importing transformers.

Why not call transformers: importing it costs 1.3 s of CPU (3-5 s on a busy machine) in
the environment check that runs before the model loads and must answer in under 2 s; the
schema decides what the chat template lists, so the start-up check and training use this
one function. Its output is held equal to transformers' by tests/environments/test_tools.py
for every kind of hint it takes: int, float, str, bool, None, Any, list / tuple / dict
(bare or parametrised), Union / Optional / `X | Y`, Literal, Enum classes, defaults (not
required), `(choices: [...])` at the end of an argument's description, a Returns: section,
methods (self / cls left out). Anything else (a custom class, a one-element tuple) is a
`ToolError` naming the tool and the hint, as transformers refuses it.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import re
import types
from collections.abc import Callable
from enum import Enum
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from leangrpo.environments.tools import ToolError

# transformers' patterns (transformers.utils.chat_template_utils), so descriptions split alike
_DESCRIPTION = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
_ARGS = re.compile(r"\n\s*Args:\n(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
_ARG_SPLIT = re.compile(
    r"""
(?:^|\n)
([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:\s*
(.*?)\s*
(?=\n(?!\1[ \t])[ \t]*\w+(?:[ \t]*\([^()\n]*\))?:|\Z)
""",
    re.DOTALL | re.VERBOSE,
)
_RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)
_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_BARE = {**{t: {"type": name} for t, name in _SCALARS.items()},
         list: {"type": "array"}, tuple: {"type": "array"}, dict: {"type": "object"}}  # fmt: skip


class _Unsupported(Exception):
    pass


def tool_schema(fn: Callable) -> dict[str, Any]:
    """{"type": "function", "function": {name, description, parameters[, return]}}."""
    name = getattr(fn, "__name__", "operation")
    try:
        return _schema(fn, name)
    except _Unsupported as e:
        raise ToolError(
            f"tool {getattr(fn, '__qualname__', name)} cannot be offered to the model: {e} (a tool "
            "needs type hints and a docstring with an Args: line per argument)"
        ) from None


def _schema(fn: Callable, name: str) -> dict[str, Any]:
    doc = inspect.getdoc(fn)
    if not doc:
        raise _Unsupported("it has no docstring")
    description, arg_docs, returns_doc = _docstring(doc.strip())
    parameters = _parameters(fn, name)
    returns = parameters["properties"].pop("return", None)
    if returns is not None and returns_doc is not None:
        returns["description"] = returns_doc
    for arg, schema in parameters["properties"].items():
        if arg not in arg_docs:
            raise _Unsupported(f"its docstring has no description for the argument '{arg}'")
        text = arg_docs[arg]
        choices = _CHOICES.search(text)
        if choices:
            schema["enum"] = [c.strip() if isinstance(c, str) else c for c in json.loads(choices.group(1))]
            text = choices.string[: choices.start()].strip()
        schema["description"] = text
    out = {"name": name, "description": description, "parameters": parameters}
    if returns is not None:
        out["return"] = returns
    return {"type": "function", "function": out}


def _docstring(doc: str) -> tuple[str | None, dict[str, str], str | None]:
    description = _DESCRIPTION.search(doc)
    args = _ARGS.search(doc)
    returns = _RETURNS.search(doc)
    arg_docs = {}
    if args is not None:
        block = "\n".join(line for line in args.group(1).split("\n") if line.strip())
        arg_docs = {m[1]: re.sub(r"\s*\n+\s*", " ", m[2].strip()) for m in _ARG_SPLIT.findall(block)}
    return (
        description.group(1).strip() if description else None,
        arg_docs,
        returns.group(1).strip() if returns else None,
    )


def _parameters(fn: Callable, name: str) -> dict[str, Any]:
    try:
        hints = get_type_hints(fn)
    except Exception as e:  # noqa: BLE001  a hint naming something undefined
        raise _Unsupported(f"its type hints cannot be read ({type(e).__name__}: {e})") from None
    signature = inspect.signature(fn)
    params = signature.parameters
    first = next(iter(params), None)
    implicit = first if first in ("self", "cls") and params[first].annotation is inspect.Parameter.empty else None
    required = []
    for arg, param in params.items():
        if arg == implicit:
            continue
        if param.annotation is inspect.Parameter.empty:
            raise _Unsupported(f"the argument '{arg}' has no type hint")
        if param.default is inspect.Parameter.empty:
            required.append(arg)
    properties = {}
    for arg, hint in hints.items():
        if arg == implicit:
            continue
        if arg == "return":  # the model never writes it: a hint we cannot convert is left out
            with contextlib.suppress(_Unsupported):
                properties[arg] = _hint(hint)
        else:
            properties[arg] = _hint(hint)
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


def _enum(values: list) -> dict[str, Any]:
    kinds = list(dict.fromkeys(_SCALARS[type(v)] for v in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def _hint(hint: Any) -> dict[str, Any]:
    origin, args = get_origin(hint), get_args(hint)
    if origin is None and isinstance(hint, type) and issubclass(hint, Enum):
        values = [member.value for member in hint]
        if not values or any(type(v) not in _SCALARS for v in values):
            raise _Unsupported(f"the Enum {hint.__name__} has no members or values JSON cannot hold")
        return _enum(values)
    if origin is None:
        if hint is Any:
            return {}
        if hint not in _BARE:
            raise _Unsupported(f"the type hint {hint!r} has no JSON schema (a custom class or object)")
        return dict(_BARE[hint])
    if origin is Union or origin is types.UnionType:
        return _union(args)
    if origin is Literal and args:
        if any(type(a) not in _SCALARS for a in args):
            raise _Unsupported("typing.Literal lists a value JSON cannot hold")
        return _enum(list(args))
    if origin is list:
        return {"type": "array", "items": _hint(args[0])} if args else {"type": "array"}
    if origin is tuple:
        return _tuple(hint, args)
    if origin is dict:
        return {"type": "object", "additionalProperties": _hint(args[1])} if len(args) == 2 else {"type": "object"}
    raise _Unsupported(f"the type hint {hint!r} has no JSON schema")


def _union(args: tuple) -> dict[str, Any]:
    subtypes = [_hint(t) for t in args if t is not type(None)]
    if len(subtypes) == 1:
        out = subtypes[0]
    elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in subtypes):
        names = sorted({s["type"] for s in subtypes})
        out = {"type": names[0] if len(names) == 1 else names}
    else:
        out = {"anyOf": subtypes}
    if type(None) in args:
        out["nullable"] = True
    return out


def _tuple(hint: Any, args: tuple) -> dict[str, Any]:
    if not args:
        return {"type": "array"}
    if len(args) == 1:
        raise _Unsupported(f"the type hint {str(hint).replace('typing.', '')} is a one-element tuple; use list[...]")
    if ... in args:
        raise _Unsupported("a tuple hint with '...'; use list[...]")
    return {"type": "array", "prefixItems": [_hint(t) for t in args]}
