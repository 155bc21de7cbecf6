"""Config input and its errors: YAML files, `--set` overrides, one-sentence messages.

Kept apart from the schema in root.py. Everything here takes the root model as an
argument, so this module does not import root.py, and neither imports torch.

- `read_yaml` returns a plain dict. It refuses, in one sentence, a file that is not UTF-8
  text (binary, UTF-16) and a mapping that sets the same key twice at any level (PyYAML
  would silently keep the second `run:` section): the composed node tree is walked for
  duplicates, with their line numbers, before it is constructed. `apply_override` sets `a.b.c=value` (or
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

from leangrpo.errors import UserError


class ConfigError(UserError):
    """One sentence naming the key, the problem and the fix; the CLI prints it as is."""


def rule_error(message: str) -> PydanticCustomError:
    """A cross-field rule's sentence, raised inside a validator so pydantic keeps collecting
    the other errors; `describe_validation_error` returns it verbatim."""
    return PydanticCustomError("config_rule", "{message}", {"message": message})


FIELD_HINTS = {
    "rollout.num_generations": "GRPO compares completions within a group, so each prompt needs at least 2 (1 only in pure distillation)",
}


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigError(f"Config file {str(path)!r} {what}; pass the path of a YAML file.")
    text = _read_config_text(path)
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _refuse_duplicate_keys(node, path)
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or exc
        raise ConfigError(
            f"Config file {str(path)!r} is not valid YAML{where}: {problem}."
        ) from None
    finally:
        loader.dispose()
    if data is None:
        return {}
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise ConfigError(
            f"Config file {str(path)!r} must hold a mapping of sections (run:, model:, ...), not a {kind}."
        )
    return data


UTF16_32_BOMS = (b"\xff\xfe", b"\xfe\xff")  # UTF-32 BOMs start with these too


def _read_config_text(path: Path) -> str:
    """The file as UTF-8 text; a binary or UTF-16/32 file is refused in one sentence."""
    raw = path.read_bytes()
    even, odd = raw[:64:2], raw[1:64:2]
    wide_ascii = len(odd) >= 2 and (  # "r\0u\0n\0" (LE) or "\0r\0u\0n" (BE), no BOM
        (odd.count(0) >= 0.9 * len(odd) and not even.count(0))
        or (even.count(0) >= 0.9 * len(even) and not odd.count(0))
    )
    if raw.startswith(UTF16_32_BOMS) or wide_ascii:
        raise ConfigError(
            f"Config file {str(path)!r} is UTF-16 or UTF-32 encoded; save it as UTF-8."
        )
    if b"\x00" in raw:
        raise ConfigError(f"Config file {str(path)!r} is a binary file, not YAML text.")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"Config file {str(path)!r} is not UTF-8 text (byte {raw[exc.start]:#04x} at line {line}); save it as UTF-8."
        ) from None


def _refuse_duplicate_keys(
    node: yaml.Node, path: Path, where: str = "", seen: set[int] | None = None
) -> None:
    """PyYAML keeps the last of two equal keys silently; a config must not lose a section."""
    seen = set() if seen is None else seen
    if id(node) in seen:  # an alias of a node already checked (or a recursive anchor)
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, path, f"{where}[{i}]", seen)
        return
    if not isinstance(node, yaml.MappingNode):
        return
    first_line: dict[str, int] = {}
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = f"{where}.{key_node.value}".lstrip(".")
        line = key_node.start_mark.line + 1
        if key in first_line:
            raise ConfigError(
                f"Config file {str(path)!r} sets {key!r} twice (lines {first_line[key]} and {line}); YAML would silently keep only the second, so merge them into one."
            )
        first_line[key] = line
        _refuse_duplicate_keys(value_node, path, key, seen)


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
