"""Prompts: validate, load, render, tokenise, and hand out in a resumable order.

- `check_data(cfg.data)` runs before any model loads (and before torch is imported): the
  source settings, then each local file's encoding, lines, columns and prompt cells
  (files.py). Hub datasets get the same row checks when they load.
- `load_prompts(cfg.data, tokenizer, seed)` loads local .jsonl/.json with the same
  stdlib reader the checks use (values keep their JSON types; a key a row lacks reads
  None), .parquet/.csv and hub names with `datasets` (imported only then: what it adds to
  start-up and trainer memory is in benchmarks/RESULTS.md, "per-step overhead"), renames
  columns, renders each prompt and tokenises it:
  with `data.chat_template` the messages [system?, user] go through
  `tokenizer.apply_chat_template(add_generation_prompt=True)` (with the template
  data.chat_template names, when it names one: data/templates.py) and the text is encoded with
  `add_special_tokens=False` (the template already holds BOS and friends); without it the
  raw prompt is encoded with `add_special_tokens=True` (a BOS is added where the tokenizer
  adds one, so `ids` may start with a token that `text` does not show). A prompt column
  may also hold a message list (`[{"role": ..., "content": ...}]`) when the template is on.
  The messages are kept (`Prompt.messages`): a multi-turn environment starts from them.
  `Prompt.uid` is the row index in its file (train or eval), so it survives filtering.
  Eval prompts come from `data.eval_path`, else `data.eval_split` of the hub dataset, else
  `data.eval_size` train rows held out by a seeded permutation.
- Prompt length: a `PromptLimit` (the smaller of `data.max_prompt_tokens` and the model's
  context minus `rollout.max_new_tokens`, computed by preflight.py) is applied to train
  and eval prompts after tokenising. Over it, `data.overlong_prompts` decides: 'error'
  names the row and the numbers, 'drop' leaves it out, 'truncate_left' / 'truncate_right'
  keep the last / first tokens (the text becomes the decoded kept tokens). Empty prompts
  (blank text, or no token ids) follow `data.empty_prompts`. `load_prompts` returns the
  counts as metrics (data/dropped_prompts, data/truncated_prompts), logged at step 0.
  A multi-turn run renders each prompt as its trajectory's first turn does (`first_turn`:
  the environment's tools listed, environment.chat_template), so the limit it is held to
  (environment.max_total_tokens minus rollout.max_new_tokens among them) is checked on
  what the model will be given, not on the data template's rendering without the tools.

The order in which prompts are served is sampler.py's (`PromptSampler`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from leangrpo.contracts import Prompt
from leangrpo.data.files import (
    FILE_BUILDERS,
    CheckedFile,
    DataError,
    check_columns,
    check_file,
    check_prompt_cells,
    local_prompt_cells,
    prompt_problem,
    read_json_table,
)
from leangrpo.data.lengths import TextBound, prompt_text, too_long
from leangrpo.data.templates import data_template

logger = logging.getLogger(__name__)

# ---- cheap validation ---------------------------------------------------------------------


def check_data(data_cfg: Any) -> dict[str, CheckedFile]:
    """Validate `cfg.data` without loading a model or the whole dataset; returns what the
    checks learnt of each local file (its columns and rows) by key: data.path, data.eval_path."""
    if (data_cfg.path is None) == (data_cfg.dataset is None):
        raise DataError(
            "set exactly one of data.path (a local .jsonl/.json/.parquet/.csv file) and "
            "data.dataset (a `datasets` hub name)"
        )
    if data_cfg.eval_path is not None and data_cfg.eval_split is not None:
        raise DataError("set at most one of data.eval_path and data.eval_split")
    if data_cfg.eval_split is not None and data_cfg.dataset is None:
        raise DataError("data.eval_split needs data.dataset; for a local file use data.eval_path")
    if data_cfg.eval_size < 0:
        raise DataError(f"data.eval_size = {data_cfg.eval_size} must be >= 0")
    if data_cfg.system_prompt is not None and not data_cfg.chat_template:
        raise DataError(
            "data.system_prompt is only used with data.chat_template = true; enable the "
            "chat template or put the instruction into the prompts"
        )
    data_template(data_cfg)  # a name or a file: known, readable, valid Jinja
    checked = {}
    for key in ("path", "eval_path"):
        if getattr(data_cfg, key) is not None:
            checked[f"data.{key}"] = check_file(getattr(data_cfg, key), f"data.{key}", data_cfg)
    if "data.path" in checked:
        check_eval_size(data_cfg.eval_size, checked["data.path"].rows)
    return checked


def check_eval_size(eval_size: int, num_rows: int) -> None:
    """data.eval_size rows held out of `num_rows` must leave some to train on."""
    if eval_size > 0 and eval_size >= num_rows:
        raise DataError(
            f"data.eval_size = {eval_size} leaves no train rows out of {num_rows}; lower it"
        )


def check_chat_rows(data_cfg: Any, tokenizer: Any) -> None:
    """With data.chat_template, before the model loads (preflight.py passes the tokenizer's
    record, model/tokenizer.py `recall`): the first prompt of each kind in the local files
    (its messages' roles and content types) rendered by the chat template (the one
    data.chat_template names, else the tokenizer's), so that a role
    the template refuses is named now, as `load_prompts` names it, not seconds later."""
    if not data_cfg.chat_template or tokenizer is None:
        return
    template = data_template(data_cfg)
    if template is None and getattr(tokenizer, "chat_template", None) is None:
        return
    render = lambda m: _render(m, tokenizer, template)  # noqa: E731
    for key in ("path", "eval_path"):
        path = getattr(data_cfg, key)
        seen: set[tuple] = set()
        for row, _, value in local_prompt_cells(path, data_cfg) if path else ():
            messages = _messages({data_cfg.prompt_column: value}, data_cfg, tokenizer)
            kind = tuple((m.get("role"), type(m.get("content")).__name__) for m in messages)
            if kind not in seen:
                seen.add(kind)
                _rendered(render, messages, f"data.{key} = '{path}' row {row}")


# ---- loading ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptLimit:
    """The most tokens a prompt may have, and why (for the messages)."""

    tokens: int
    reason: str  # e.g. "data.max_prompt_tokens = 512"
    # set when prompt text can be bounded untokenised (lengths.py): what a token covers
    text: TextBound | None = None

    def over_by_text(self, value: Any) -> int | None:
        """The size of a prompt cell that is over the limit for certain, untokenised."""
        if self.text is None:
            return None
        size = self.text.measure(prompt_text(value))
        return size if size > self.tokens * self.text.per_token else None


@dataclass
class PromptSet:
    """Loaded prompts and what loading them did (logged once, at step 0)."""

    train: list[Prompt]
    eval: list[Prompt]
    metrics: dict[str, float] = field(default_factory=dict)


def load_prompts(
    data_cfg: Any,
    tokenizer: Any,
    seed: int = 0,
    limit: PromptLimit | None = None,
    first_turn: Callable[[list[dict]], str] | None = None,
    longest: int | None = None,
) -> PromptSet:
    """Train and eval prompts, rendered, tokenised and checked; see the module docstring.

    `limit` defaults to data.max_prompt_tokens alone (preflight.py adds the model's context).
    `first_turn` (multi-turn runs: environments/rendering.py `Renderer.first_turn`) renders
    a prompt's messages as a trajectory's first turn does, tools listed, with
    environment.chat_template: the text, ids and limit are then those of that rendering.
    `longest`: only the prompts with the most characters, that many of each split (a
    quick check of the limit before the model loads; the set-up checks them all).
    """
    check_data(data_cfg)
    if limit is None and data_cfg.max_prompt_tokens is not None:
        limit = PromptLimit(
            data_cfg.max_prompt_tokens, f"data.max_prompt_tokens = {data_cfg.max_prompt_tokens}"
        )
    train_source = (
        f"data.path = '{data_cfg.path}'"
        if data_cfg.path
        else f"data.dataset = '{data_cfg.dataset}'"
    )
    train_rows = _load_rows(data_cfg, data_cfg.path, data_cfg.split)
    if data_cfg.eval_path is not None:
        eval_rows, eval_source = (
            _load_rows(data_cfg, data_cfg.eval_path, None),
            f"data.eval_path = '{data_cfg.eval_path}'",
        )
        train_uids, eval_uids = list(range(len(train_rows))), list(range(len(eval_rows)))
    elif data_cfg.eval_split is not None:
        eval_rows = _load_rows(data_cfg, None, data_cfg.eval_split)
        eval_source = f"data.dataset = '{data_cfg.dataset}' split '{data_cfg.eval_split}'"
        train_uids, eval_uids = list(range(len(train_rows))), list(range(len(eval_rows)))
    else:
        eval_rows, eval_source = train_rows, train_source
        train_uids, eval_uids = _hold_out(len(train_rows), data_cfg.eval_size, seed)
    counts = {"dropped": 0, "truncated": 0}
    if longest is not None:
        train_uids, eval_uids = (_longest(rows, uids, data_cfg, longest) for rows, uids in ((train_rows, train_uids), (eval_rows, eval_uids)))  # fmt: skip
    train = _make_prompts(train_rows, train_uids, data_cfg, tokenizer, train_source, limit, counts, first_turn)  # fmt: skip
    evals = _make_prompts(eval_rows, eval_uids, data_cfg, tokenizer, eval_source, limit, counts, first_turn)  # fmt: skip
    if not train:
        raise DataError(
            f"no train prompts left in {train_source} after dropping empty and overlong ones; "
            f"check data.empty_prompts, data.overlong_prompts and data.max_prompt_tokens"
        )
    metrics = {
        "data/prompts": float(len(train)),
        "data/eval_prompts": float(len(evals)),
        "data/dropped_prompts": float(counts["dropped"]),
        "data/truncated_prompts": float(counts["truncated"]),
    }
    return PromptSet(train, evals, metrics)


def _longest(rows: list[dict], uids: list[int], data_cfg: Any, count: int) -> list[int]:
    """The `count` rows whose prompt has the most characters, in row order."""

    def chars(uid: int) -> int:
        cell = rows[uid].get(data_cfg.prompt_column)
        if isinstance(cell, list):
            return sum(len(str(m.get("content", ""))) if isinstance(m, dict) else 0 for m in cell)
        return len(cell) if isinstance(cell, str) else 0

    return sorted(sorted(uids, key=chars, reverse=True)[:count])


def _hold_out(num_rows: int, eval_size: int, seed: int) -> tuple[list[int], list[int]]:
    if eval_size == 0:
        return list(range(num_rows)), []
    check_eval_size(eval_size, num_rows)
    import numpy as np

    held = set(np.random.default_rng(seed).permutation(num_rows)[:eval_size].tolist())
    train = [i for i in range(num_rows) if i not in held]
    return train, sorted(held)


def _load_rows(data_cfg: Any, path: str | None, split: str | None) -> list[dict]:
    """Rows as dicts, columns renamed by data.column_map."""
    if path is not None and Path(path).suffix.lower() in (".json", ".jsonl"):
        rows = read_json_table(Path(path).expanduser())  # stdlib: `datasets` not imported
        mapping = dict(data_cfg.column_map or {})
        return [{mapping.get(k, k): v for k, v in row.items()} for row in rows]
    import datasets

    if path is not None:
        builder = FILE_BUILDERS[Path(path).suffix.lower()]
        try:
            ds = datasets.load_dataset(builder, data_files=str(path), split="train")
        except Exception as e:
            cause = _root_cause(e)  # datasets wraps it: "An error occurred while generating"
            raise DataError(f"could not read {path}: {type(cause).__name__}: {cause}") from e
    else:
        name, config = data_cfg.dataset, data_cfg.dataset_config
        try:
            ds = datasets.load_dataset(name, config, split=split)
        except Exception as e:
            raise DataError(
                f"data.dataset = '{name}' (config {config!r}, split '{split}') could not be "
                f"loaded: {type(e).__name__}: {e}; check the name, data.dataset_config and the "
                f"split, and that it is cached or the hub is reachable"
            ) from e
        source = f"dataset '{name}' split '{split}'"
        check_columns(list(ds.column_names), source, data_cfg)
    if data_cfg.column_map:
        ds = ds.rename_columns(dict(data_cfg.column_map))
    columns = ds.to_dict()
    num_rows = len(ds)
    return [{name: values[i] for name, values in columns.items()} for i in range(num_rows)]


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost exception of a chain (bounded: a chain may loop)."""
    for _ in range(32):
        inner = exc.__cause__ or exc.__context__
        if inner is None:
            break
        exc = inner
    return exc


def _make_prompts(
    rows: list[dict],
    uids: list[int],
    data_cfg: Any,
    tokenizer: Any,
    source: str,
    limit: PromptLimit | None,
    counts: dict[str, int],
    first_turn: Callable[[list[dict]], str] | None = None,
) -> list[Prompt]:
    column = data_cfg.prompt_column
    check_prompt_cells(((uid, None, rows[uid].get(column)) for uid in uids), source, data_cfg)
    blank = [uid for uid in uids if prompt_problem(rows[uid].get(column), True) == "empty"]
    dropped = set(blank)
    uids = [uid for uid in uids if uid not in dropped]
    uids = _drop_by_text(rows, uids, data_cfg, source, limit, counts)
    messages = [_messages(rows[uid], data_cfg, tokenizer) for uid in uids]
    template = data_template(data_cfg)
    render = first_turn or (lambda m: _render(m, tokenizer, template))
    texts = [
        rows[uid].get(column) if m is None else _rendered(render, m, f"{source} row {uid}")
        for uid, m in zip(uids, messages)
    ]
    ids = (
        tokenizer(texts, add_special_tokens=not data_cfg.chat_template)["input_ids"]
        if texts
        else []
    )
    extra = data_cfg.columns
    prompts, no_ids = [], []
    for uid, text, token_ids, chat in zip(uids, texts, ids, messages):
        if not token_ids:
            no_ids.append(uid)
            continue
        row = rows[uid]
        names = extra if extra is not None else [c for c in row if c != column]
        columns = {c: row[c] for c in names}
        prompts.append(Prompt(uid, text, list(token_ids), columns, messages=chat))
    if no_ids and data_cfg.empty_prompts == "error":
        raise DataError(
            f"{source} row {no_ids[0]} tokenises to no tokens; remove it, or set "
            f"data.empty_prompts: drop to leave such rows out"
        )
    if blank or no_ids:
        logger.warning(
            "dropped %d empty prompts of %s (rows %s)",
            len(blank) + len(no_ids),
            source,
            _rows(blank + no_ids),
        )
        counts["dropped"] += len(blank) + len(no_ids)
    if not limit:
        return prompts
    return _apply_limit(prompts, limit, data_cfg, tokenizer, source, counts, first_turn is not None)


def _drop_by_text(
    rows: list[dict], uids: list[int], data_cfg: Any, source: str, limit: Any, counts: dict
) -> list[int]:
    """Prompts too long by their text alone (lengths.py) are refused or dropped before
    they are tokenised; truncation tokenises everything."""
    mode = data_cfg.overlong_prompts
    if limit is None or limit.text is None or mode not in ("error", "drop"):
        return uids
    column = data_cfg.prompt_column
    long = {uid: size for uid in uids if (size := limit.over_by_text(rows[uid].get(column)))}
    if not long:
        return uids
    if mode == "error":
        uid = next(iter(long))
        raise DataError(too_long(f"{source} row {uid}", long[uid], limit, limit.text))
    logger.warning(
        "dropped %d prompts of %s longer than %d tokens can hold by their text alone (%s; rows %s)",
        len(long), source, limit.tokens, limit.reason, _rows(list(long)),
    )  # fmt: skip
    counts["dropped"] += len(long)
    return [uid for uid in uids if uid not in long]


def _apply_limit(
    prompts: list[Prompt],
    limit: PromptLimit,
    data_cfg: Any,
    tokenizer: Any,
    source: str,
    counts: dict,
    first_turn: bool = False,
) -> list[Prompt]:
    over = [p for p in prompts if len(p.ids) > limit.tokens]
    if not over:
        return prompts
    mode = data_cfg.overlong_prompts
    if mode == "error":
        longest = max(over, key=lambda p: len(p.ids))
        more = (
            f" ({len(over)} of the {len(prompts)} prompts checked are over it, the longest is row {longest.uid} with {len(longest.ids)})"
            if len(over) > 1
            else ""
        )
        what = "tokens as its first turn renders it (tools listed, with environment.chat_template)" if first_turn else "prompt tokens"  # fmt: skip
        options = "to drop" if first_turn else "to drop, truncate_left or truncate_right"
        raise DataError(
            f"{source} row {over[0].uid} has {len(over[0].ids)} {what}, more than the "
            f"{limit.tokens} allowed by {limit.reason}{more}; shorten it, or set "
            f"data.overlong_prompts {options}"
        )
    logger.warning(
        "%s %d of %d prompts of %s longer than %d tokens (%s; rows %s)",
        "dropped" if mode == "drop" else "truncated", len(over), len(prompts), source,
        limit.tokens, limit.reason, _rows([p.uid for p in over]),
    )  # fmt: skip
    if mode == "drop":
        counts["dropped"] += len(over)
        return [p for p in prompts if len(p.ids) <= limit.tokens]
    counts["truncated"] += len(over)
    for p in over:
        p.ids = p.ids[-limit.tokens :] if mode == "truncate_left" else p.ids[: limit.tokens]
        p.text = tokenizer.decode(p.ids, skip_special_tokens=not data_cfg.chat_template)
    return prompts


def _rows(uids: list[int], shown: int = 5) -> str:
    text = ", ".join(str(u) for u in sorted(uids)[:shown])
    return text + (f" and {len(uids) - shown} more" if len(uids) > shown else "")


def _messages(row: dict, data_cfg: Any, tokenizer: Any) -> list[dict] | None:
    """The chat messages of a row ([system?, user], or the row's own list); None without
    data.chat_template (the raw text is the prompt)."""
    prompt = row.get(data_cfg.prompt_column)
    if not data_cfg.chat_template:
        return None
    if data_cfg.chat_template is True and getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            "the tokenizer has no chat template; name one with data.chat_template (e.g. "
            "chatml-hermes, or a .jinja file), or set data.chat_template: false to use the "
            "raw prompt text"
        )
    is_messages = isinstance(prompt, list)
    messages = [dict(m) for m in prompt] if is_messages else [{"role": "user", "content": prompt}]
    if data_cfg.system_prompt is not None and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": data_cfg.system_prompt})
    return messages


def _rendered(render: Callable[[list[dict]], str], messages: list[dict], where: str) -> str:
    """`render(messages)`; a row the chat template refuses (a role it does not know, a
    message it cannot take) is named with the template's own message."""
    try:
        return render(messages)
    except Exception as e:  # jinja2's TemplateError (raise_exception), TypeError, ...
        roles = ", ".join(repr(m.get("role")) for m in messages if isinstance(m, dict))
        raise DataError(
            f"{where}: the chat template cannot render its messages (roles {roles}): "
            f"{type(e).__name__}: {str(e).strip()[:200]}; fix the row (use the roles the "
            f"template knows, usually system, user, assistant) or drop it"
        ) from None


def _render(messages: list[dict], tokenizer: Any, template: str | None = None) -> str:
    """`template`: data.chat_template's own (a name or a file), else the tokenizer's."""
    kwargs = {} if template is None else {"chat_template": template}
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **kwargs
    )
