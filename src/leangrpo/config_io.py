"""Config input and its errors: YAML files, `--set` overrides, one-sentence messages.

Kept apart from the schema in config.py. Everything here takes the root model as an
argument, so this module does not import config.py, and neither imports torch.

- `read_yaml` returns a plain dict; `apply_override` sets `a.b.c=value` (or
  `a.list[0].b=value`) in it, parsing the value with `yaml.safe_load`.
- `describe_validation_error` turns a pydantic `ValidationError` into one sentence. It
  names the dotted key of the first problem, with unknown keys and missing keys first
  because they usually explain the rest. For an unknown key it suggests the closest
  sibling (difflib), or else the same leaf name in another section.
"""

from __future__ import annotations

import difflib
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError


class ConfigError(Exception):
    """One sentence naming the key, the problem and the fix; the CLI prints it as is."""


def rule_error(message: str) -> PydanticCustomError:
    """A cross-field rule's sentence, raised inside a validator so pydantic keeps collecting
    the other errors; `describe_validation_error` returns it verbatim."""
    return PydanticCustomError("config_rule", "{message}", {"message": message})


FIELD_HINTS = {
    "rollout.num_generations": "GRPO compares completions within a group, so each prompt needs at least 2",
}


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"Config file {str(path)!r} does not exist; pass the path of a YAML file."
        )
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or exc
        raise ConfigError(
            f"Config file {str(path)!r} is not valid YAML{where}: {problem}."
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise ConfigError(
            f"Config file {str(path)!r} must hold a mapping of sections (run:, model:, ...), not a {kind}."
        )
    return data


# -- overrides ------------------------------------------------------------------------------


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` (or `a.list[0].b=value`) in the nested dict, parsing value as YAML."""
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(
            f"Override {override!r} must look like key.path=value, e.g. --set train.learning_rate=1e-5."
        )
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw  # not YAML (e.g. an unbalanced bracket): keep the text
    parts = re.sub(r"\[(\d+)\]", r".\1", key).split(".")
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        node = _child_for_override(node, part, parts[: depth + 1], key)
    if isinstance(node, list):
        node[_list_index(node, parts[-1], key)] = value
    else:
        node[parts[-1]] = value


def _child_for_override(node: Any, part: str, path: list[str], key: str) -> Any:
    if isinstance(node, list):
        index = _list_index(node, part, key)
        if isinstance(node[index], str):  # reward shorthand `- math` becomes {name: math}
            node[index] = {"name": node[index]}
        child = node[index]
    else:
        if node.get(part) is None:
            node[part] = {}
        child = node[part]
    if not isinstance(child, dict | list):
        where = ".".join(path)
        raise ConfigError(
            f"Cannot set {key!r}: {where!r} holds the value {child!r}, not a section."
        )
    return child


def _list_index(node: list, part: str, key: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(
            f"Cannot set {key!r}: {part!r} is not an index of a list with {len(node)} items."
        )
    return int(part)


# -- pydantic errors as one sentence ---------------------------------------------------------


def describe_validation_error(exc: ValidationError, root: type[BaseModel]) -> str:
    errors = exc.errors(include_url=False)
    order = {"extra_forbidden": 0, "missing": 1, "config_rule": 3}
    errors.sort(key=lambda e: order.get(e["type"], 2))  # typos first: they explain the rest
    first = errors[0]
    if first["type"] == "config_rule":
        return first["msg"]
    key, siblings = resolve_loc(first["loc"], root)
    if first["type"] == "extra_forbidden":
        return unknown_key_message(key, siblings, root)
    if first["type"] == "missing":
        return f"Config key {key!r} is required but missing; set it in the config file or with --set {key}=..."
    same_key = [e["msg"] for e in errors if resolve_loc(e["loc"], root)[0] == key]
    problem = " or ".join(dict.fromkeys(_clean_msg(m) for m in same_key))
    hint = f" ({FIELD_HINTS[key]})" if key in FIELD_HINTS else ""
    return f"Config key {key!r} = {_short(first['input'])} is invalid: {problem}{hint}."


def resolve_loc(loc: tuple, root: type[BaseModel]) -> tuple[str, list[str]]:
    """Dotted key of a pydantic error location and the field names of its parent section."""
    model: type[BaseModel] | None = root
    key, siblings = "", list(root.model_fields)
    for part in loc:
        if isinstance(part, int):
            key += f"[{part}]"
            continue
        if model is None or part not in model.model_fields:
            if model is not None:  # an unknown key; otherwise `part` tags a union member
                key, siblings = f"{key}.{part}".lstrip("."), list(model.model_fields)
            break
        siblings = list(model.model_fields)
        key = f"{key}.{part}".lstrip(".")
        model = section_type(model.model_fields[part].annotation)
    return key, siblings


def section_type(annotation: Any) -> type[BaseModel] | None:
    """The model class inside an annotation such as `X`, `list[X]` or `X | None`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = section_type(arg)
        if found is not None:
            return found
    return None


def unknown_key_message(key: str, siblings: list[str], root: type[BaseModel]) -> str:
    parent, _, leaf = key.rpartition(".")
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    if close:
        suggestion = f"{parent}.{close[0]}".lstrip(".")
        return f"Unknown config key {key!r}; did you mean {suggestion!r}?"
    elsewhere = [k for k in all_keys(root) if k.rpartition(".")[2] == leaf]
    if elsewhere:
        options = " or ".join(repr(k) for k in elsewhere)
        return f"Unknown config key {key!r}; did you mean {options}?"
    where = f"in {parent!r}" if parent else "at the top level"
    return f"Unknown config key {key!r}; valid keys {where} are: {', '.join(siblings)}."


def all_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of a model tree, sections included (list items as `name[]`)."""
    keys = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        keys.append(key)
        sub = section_type(field.annotation)
        if sub is not None:
            is_list = typing.get_origin(field.annotation) is list
            keys += all_keys(sub, f"{key}[]." if is_list else f"{key}.")
    return keys


def _clean_msg(msg: str) -> str:
    msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    msg = msg.replace(
        "Input should be a valid dictionary or instance of",
        "input should be a section (a mapping of keys) for",
    )
    return msg[:1].lower() + msg[1:]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
