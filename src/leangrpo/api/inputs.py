"""The config a `leangrpo.GRPO` is given: a config, Python objects and section overrides
made into one validated `Config`, which is what runs (the API adds nothing a config cannot
say, and a config loses nothing through it).

- `config`: a `Config`, a dict of sections, a YAML path, or None (everything from the
  keyword arguments).
- `reward_funcs`: each a callable, a name (`'math'`, `'module:fn'`, `'file.py:fn'`) or a
  `rewards.functions` entry ({name, weight, kwargs}, whose name may be a callable);
  callables become references (shipping.py: by name, or by value). They replace
  rewards.functions.
- `train_dataset` / `eval_dataset`: a path (a file: data.path / data.eval_path; a
  directory or any other string: data.dataset, a `datasets` name), a list of row dicts or
  a `datasets.Dataset`. Rows are written as JSON lines into the cache
  (`$LEANGRPO_CACHE/datasets/<sha256>.jsonl`, named by their content: the same rows make
  the same data.path, so a resume sees no change, and other rows another one, which a
  resume refuses as it refuses any data change). An eval set replaces data.eval_size and
  data.eval_split.
- `environment`: an `Environment` subclass, a name, or an `environment` section (whose
  name may be a class); `tools`: callables or names (environment.tools; the built-in
  `tools` environment unless one is named).
- `**overrides`: `section={key: value}` merged into that section (`model='name'` is
  model.name_or_path), or `key=value` for a key that only one section has
  (`learning_rate=1e-5` is train.learning_rate); anything else is refused naming the
  choices. The environment section counts only in a run with an environment (the
  `environment=` / `tools=` arguments, or an environment section in the config): there a
  key it shares with another section (`num_workers`, `allow_network`, `chat_template`
  ...) is refused as ambiguous, naming both sections; without one, it is the other
  section's.
Every refusal is one sentence (a UserError) before anything starts.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from leangrpo.api.shipping import ByValue, reference
from leangrpo.config import Config, ConfigError, config_from_dict
from leangrpo.config.io import all_keys, read_yaml
from leangrpo.config.run import DATA_SUFFIXES
from leangrpo.data.files import DataError
from leangrpo.model.smollm2 import cache_dir

SECTIONS = tuple(Config.model_fields)
OPTIONAL_SECTIONS = ("environment.", "agent.")  # absent unless asked for (environment=/tools=,
# agent={...}); a run has at most one of them, and only the environment's keys are set by name


def build_config(
    config: Any = None,
    *,
    reward_funcs: list | None = None,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    environment: Any = None,
    tools: list | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """The run's validated config (see the module docstring)."""
    data = config_dict(config)
    _objects_in_config(data)
    overrides = dict(overrides or {})
    with_environment = (
        environment is not None
        or tools is not None
        or data.get("environment") is not None
        or overrides.get("environment") is not None
    )
    for key, value in overrides.items():
        apply_override(data, key, value, with_environment)
    if reward_funcs is not None:
        section(data, "rewards")["functions"] = reward_entries(reward_funcs)
    if train_dataset is not None:
        data_section = section(data, "data")
        data_section.pop("dataset" if _is_file(train_dataset) else "path", None)
        data_section.update(dataset_source(train_dataset, "train_dataset", train=True))
    if eval_dataset is not None:
        data_section = section(data, "data")
        data_section.update(dataset_source(eval_dataset, "eval_dataset", train=False))
        data_section.update(eval_size=0, eval_split=None)
    if environment is not None or tools is not None:
        set_environment(data, environment, tools)
    return config_from_dict(data)


def config_dict(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, Config):
        return config.model_dump(mode="json")
    if isinstance(config, (str, os.PathLike)):
        return read_yaml(config)
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))  # functions and classes are kept, not copied
    raise ConfigError(
        f"GRPO's config is a {type(config).__name__}; pass a leangrpo Config, a dict of sections or the path of a YAML file."
    )


def _objects_in_config(data: dict[str, Any]) -> None:
    """Functions and classes written into a config dict (rewards.functions entries, the
    environment's name, its tools) become references, as the keyword arguments do."""
    functions = (
        (data.get("rewards") or {}).get("functions")
        if isinstance(data.get("rewards"), dict)
        else None
    )
    if isinstance(functions, list) and any(
        callable(f) or (isinstance(f, Mapping) and callable(f.get("name"))) for f in functions
    ):
        data["rewards"]["functions"] = reward_entries(functions)
    env = data.get("environment")
    if isinstance(env, dict):
        name, tools = env.get("name"), env.get("tools")
        has_objects = isinstance(tools, list) and any(callable(t) for t in tools)
        if callable(name) or has_objects:
            set_environment(data, name if callable(name) else None, tools if has_objects else None)


def section(data: dict[str, Any], name: str) -> dict[str, Any]:
    if not isinstance(data.get(name), dict):
        data[name] = {}
    return data[name]


# -- overrides --------------------------------------------------------------------------------


def apply_override(
    data: dict[str, Any], key: str, value: Any, with_environment: bool = False
) -> None:
    """`section={...}` merged in, `model='name'`, or `leaf=value` for a unique leaf key
    (of the environment section too when the run has an environment)."""
    if key in SECTIONS:
        if key == "model" and isinstance(value, str):
            section(data, "model")["name_or_path"] = value
        elif isinstance(value, Mapping):
            _merge(section(data, key), dict(value))
        else:
            raise ConfigError(
                f"GRPO({key}={value!r}): a section is given as a mapping of its keys, e.g. {key}={{...}}; see docs/config.md for them."
            )
        return
    owners = [k for k in all_keys(Config) if "[]" not in k and k.rpartition(".")[2] == key]
    # a key of a section given whole (environment: multi-turn) is not set by its name alone:
    # without an environment it is another section's (or refused), with one it may be either
    owners = [
        k
        for k in owners
        if k.count(".") >= 1
        and not k.startswith("agent.")
        and (with_environment or not k.startswith(OPTIONAL_SECTIONS))
    ]
    if len(owners) == 1:
        *path, leaf = owners[0].split(".")
        node = data
        for part in path:
            node = section(node, part)
        node[leaf] = value
        return
    if owners:
        names = f"{', '.join(owners[:-1])} and {owners[-1]} {'both' if len(owners) == 2 else 'all'}"
        ways = " or ".join(_as_section(k) for k in owners)
        raise ConfigError(
            f"GRPO({key}=...) is ambiguous: {names} have it; say which section, as {ways}."
        )
    optional = [
        k
        for k in all_keys(Config)
        if k.startswith(OPTIONAL_SECTIONS) and k.rpartition(".")[2] == key
    ]
    if optional:
        head = optional[0].split(".")[0]
        raise ConfigError(
            f"GRPO({key}=...) is a key of the {head} section; give it as {head}={{'{key}': ...}}."
        )
    close = difflib.get_close_matches(
        key, [*SECTIONS, *(k.rpartition(".")[2] for k in all_keys(Config))], n=1
    )
    hint = (
        f"; did you mean {close[0]!r}?"
        if close
        else "; its keyword arguments are config sections (run, model, data, ...) or their keys"
    )
    raise ConfigError(f"GRPO got an unknown keyword argument {key!r}{hint}")


def _as_section(dotted: str) -> str:
    """`rewards.sandbox.pass_env` as the keyword that sets it: rewards={'sandbox': {'pass_env': ...}}."""
    head, *rest = dotted.split(".")
    inner = "..."
    for part in reversed(rest):
        inner = f"{{{part!r}: {inner}}}"
    return f"{head}={inner}"


def _merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], dict(value))
        else:
            into[key] = value


# -- user code ------------------------------------------------------------------------------


def reward_entries(reward_funcs: Any) -> list[Any]:
    if callable(reward_funcs) or isinstance(reward_funcs, (str, Mapping)):
        reward_funcs = [reward_funcs]  # one function given alone
    entries = []
    for i, item in enumerate(reward_funcs):
        label = f"reward_funcs[{i}]"
        if isinstance(item, str):
            entries.append({"name": item})
        elif isinstance(item, Mapping):
            entry = dict(item)
            if callable(entry.get("name")):
                entry.update(_entry(entry["name"], label))
            entries.append(entry)
        elif callable(item):
            entries.append(_entry(item, label))
        else:
            raise ConfigError(
                f"{label} is a {type(item).__name__}; give a function fn(prompts, completions, **columns), a name ('math', 'module:fn', 'file.py:fn') or a {{name, weight, kwargs}} mapping."
            )
    return entries


def _entry(obj: Any, label: str) -> dict[str, Any]:
    ref = reference(obj, label)
    return {"name": ref.name, "value": ref.value} if isinstance(ref, ByValue) else {"name": ref}


def set_environment(data: dict[str, Any], environment: Any, tools: list | None) -> None:
    env = section(data, "environment")
    if isinstance(environment, Mapping):
        environment = dict(environment)
        name = environment.pop("name", None)
        _merge(env, environment)
        environment = name
    if environment is not None:
        env.pop("value", None)
        if isinstance(environment, str):
            env["name"] = environment
        else:
            env.update(_entry(_checked_environment(environment), "environment"))
    if tools is not None:
        if callable(tools) or isinstance(tools, str):
            tools = [tools]
        env["tools"] = [
            t if isinstance(t, str) else _tool_entry(t, f"tools[{i}]") for i, t in enumerate(tools)
        ]


def _tool_entry(fn: Any, label: str) -> Any:
    if not callable(fn):
        raise ConfigError(
            f"{label} is a {type(fn).__name__}; a tool is a function with type hints and a docstring, or its name ('module:fn', 'file.py:fn')."
        )
    entry = _entry(fn, label)
    return entry if "value" in entry else entry["name"]


def _checked_environment(cls: Any) -> Any:
    from leangrpo.environments import Environment

    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        what = f"the class {cls.__name__}" if isinstance(cls, type) else f"a {type(cls).__name__}"
        raise ConfigError(
            f"GRPO's environment is {what}, not a subclass of leangrpo.environments.Environment; pass the class itself (not an instance), a name ('tools', 'module:Class') or an environment section."
        )
    return cls


# -- data -------------------------------------------------------------------------------------


def _is_file(source: Any) -> bool:
    return (
        not isinstance(source, (str, os.PathLike))
        or Path(source).is_file()
        or str(source).lower().endswith(DATA_SUFFIXES)
    )


def dataset_source(source: Any, label: str, train: bool) -> dict[str, Any]:
    """The data keys for a dataset argument: a path or name as it is, rows as a file."""
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if _is_file(source):
            return {"path" if train else "eval_path": text}
        if not train:
            raise DataError(
                f"{label} = {text!r} is not a data file; give a .jsonl, .json, .parquet or .csv file, rows, or a datasets.Dataset (a split of data.dataset is data.eval_split)."
            )
        return {"dataset": text}
    path = write_rows(rows_of(source, label), label)
    return {"path" if train else "eval_path": str(path)}


def rows_of(source: Any, label: str) -> list[dict]:
    """The rows of a list of dicts or a `datasets.Dataset` (one split)."""
    if hasattr(source, "to_list") and hasattr(source, "column_names"):
        return source.to_list()
    if hasattr(source, "keys") and hasattr(source, "column_names"):  # a DatasetDict
        raise DataError(
            f"{label} is a DatasetDict of splits {sorted(source.keys())}; pass one split, e.g. {label}=ds['train']."
        )
    if isinstance(source, (list, tuple)) and all(isinstance(row, Mapping) for row in source):
        return [dict(row) for row in source]
    raise DataError(
        f"{label} is a {type(source).__name__}; give a data file's path, a list of row dicts or a datasets.Dataset."
    )


def write_rows(rows: list[dict], label: str) -> Path:
    """The rows as a JSON-lines file in the cache, named by its content."""
    lines = []
    for i, row in enumerate(rows):
        try:
            lines.append(json.dumps(row, ensure_ascii=False, default=_plain))
        except (TypeError, ValueError) as e:
            raise DataError(
                f"{label} row {i} cannot be written as JSON ({e}); keep to text, numbers, lists and mappings (drop or convert the other columns)."
            ) from None
    text = "".join(line + "\n" for line in lines).encode("utf-8")
    folder = cache_dir() / "datasets"
    path = folder / f"{hashlib.sha256(text).hexdigest()[:24]}.jsonl"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(text)
        os.replace(tmp, path)
    return path


def _plain(value: Any) -> Any:
    """numpy scalars and arrays (what a Dataset may hold) as JSON values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"a {type(value).__name__} is not JSON")
