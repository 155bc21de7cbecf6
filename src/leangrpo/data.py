"""Prompts: validate, load, render, tokenise, and hand out in a resumable order.

- `check_data(cfg.data)` runs before any model loads and reads only what it must: the file
  exists, its type is supported, and the prompt column and requested extra columns exist
  (after `data.column_map`) in its header or first row. A JSONL file is parsed line by line
  so a broken line is reported with its number now, not after the model has loaded.
- `load_prompts(cfg.data, tokenizer, seed)` loads with `datasets` (local .jsonl/.json/
  .parquet/.csv, or a hub name), renames columns, renders each prompt and tokenises it:
  with `data.chat_template` the messages [system?, user] go through
  `tokenizer.apply_chat_template(add_generation_prompt=True)` and the text is encoded with
  `add_special_tokens=False` (the template already holds BOS and friends); without it the
  raw prompt is encoded with `add_special_tokens=True` (a BOS is added where the tokenizer
  adds one, so `ids` may start with a token that `text` does not show). A prompt column
  may also hold a message list (`[{"role": ..., "content": ...}]`) when the template is on.
  `Prompt.uid` is the row index in its file (train or eval), so it survives filtering.
  Eval prompts come from `data.eval_path`, else `data.eval_split` of the hub dataset, else
  `data.eval_size` train rows held out by a seeded permutation. Prompts longer than
  `data.max_prompt_tokens` are dropped, counted and logged.
- `PromptSampler` serves fixed-size batches over epochs; each epoch's order is a
  permutation drawn from numpy's Generator seeded by (seed, epoch), never the global RNG,
  so the order is a pure function of (seed, epoch, position) and resumes exactly.
  Re-queued prompts (re-rolls) are served first; the queue is part of the state.
"""

from __future__ import annotations

import csv
import json
import logging
from collections import deque
from pathlib import Path
from typing import Any

from leangrpo.contracts import Prompt

logger = logging.getLogger(__name__)

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataError(ValueError):
    """The data settings or the data itself cannot be used; the message says how to fix it."""


# ---- cheap validation ---------------------------------------------------------------------


def check_data(data_cfg: Any) -> None:
    """Validate `cfg.data` without loading a model or the whole dataset."""
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
    if data_cfg.path is not None:
        _check_file(data_cfg.path, "data.path", data_cfg)
    if data_cfg.eval_path is not None:
        _check_file(data_cfg.eval_path, "data.eval_path", data_cfg)


def _check_file(path_str: str, key: str, data_cfg: Any) -> None:
    path = Path(path_str).expanduser()
    if not path.is_file():
        raise DataError(f"{key} = '{path_str}': file not found ({path.resolve()})")
    if path.suffix.lower() not in FILE_BUILDERS:
        raise DataError(
            f"{key} = '{path_str}': unsupported file type '{path.suffix}'; "
            f"use one of {', '.join(FILE_BUILDERS)}"
        )
    columns = _file_columns(path)
    if not columns:
        raise DataError(f"{key} = '{path_str}' holds no rows (or no columns)")
    _check_columns(columns, str(path), data_cfg)


def _file_columns(path: Path) -> list[str]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    if suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as f:
            return next(csv.reader(f), [])
    if suffix == ".json":
        rows = _read_json_rows(path)
        return list(rows[0]) if rows else []
    first = _scan_jsonl(path)
    return list(first) if first is not None else []


def _read_json_rows(path: Path) -> list:
    """A .json file holds a JSON array of row objects, or JSON lines."""
    text = path.read_text(encoding="utf-8")
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        if text.lstrip().startswith("["):
            raise DataError(f"{path} is not valid JSON (line {e.lineno}: {e.msg})") from None
        first = _scan_jsonl(path)  # JSON lines under a .json name
        return [first] if first is not None else []
    if isinstance(rows, dict):
        rows = [rows]  # one row: JSON lines with a single line
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise DataError(f"{path} must hold a JSON array of objects (one per row) or JSON lines")
    return rows


def _scan_jsonl(path: Path) -> dict | None:
    """Parse every line (one object per line); return the first row."""
    first = None
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path} line {line_no} is not valid JSON ({e.msg} at column {e.colno}); "
                    f"each line must be one JSON object"
                ) from None
            if not isinstance(row, dict):
                raise DataError(
                    f"{path} line {line_no} is a {type(row).__name__}, not a JSON object"
                )
            first = row if first is None else first
    return first


def _check_columns(columns: list[str], source: str, data_cfg: Any) -> None:
    """The prompt and requested columns must exist after `data.column_map` renames."""
    column_map = dict(data_cfg.column_map or {})
    for src in column_map:
        if src not in columns:
            raise DataError(
                f"data.column_map renames '{src}' but {source} has no such column "
                f"(it has: {', '.join(columns) or 'none'})"
            )
    renamed = [column_map.get(c, c) for c in columns]
    for needed in [data_cfg.prompt_column, *(data_cfg.columns or [])]:
        if needed not in renamed:
            hint = f"e.g. data.column_map = {{'{renamed[0]}': '{needed}'}}" if renamed else ""
            raise DataError(
                f"{source} has no column '{needed}' (it has: {', '.join(renamed) or 'none'}); "
                f"rename one with data.column_map {hint}".rstrip()
            )


# ---- loading ------------------------------------------------------------------------------


def load_prompts(data_cfg: Any, tokenizer: Any, seed: int = 0) -> tuple[list[Prompt], list[Prompt]]:
    """Train and eval prompts, rendered and tokenised; see the module docstring."""
    check_data(data_cfg)
    train_rows = _load_rows(data_cfg, data_cfg.path, data_cfg.split)
    if data_cfg.eval_path is not None:
        eval_rows = _load_rows(data_cfg, data_cfg.eval_path, None)
        train_uids, eval_uids = list(range(len(train_rows))), list(range(len(eval_rows)))
    elif data_cfg.eval_split is not None:
        eval_rows = _load_rows(data_cfg, None, data_cfg.eval_split)
        train_uids, eval_uids = list(range(len(train_rows))), list(range(len(eval_rows)))
    else:
        eval_rows = train_rows
        train_uids, eval_uids = _hold_out(len(train_rows), data_cfg.eval_size, seed)
    train = _make_prompts(train_rows, train_uids, data_cfg, tokenizer, "train")
    evals = _make_prompts(eval_rows, eval_uids, data_cfg, tokenizer, "eval")
    if not train:
        raise DataError(
            f"no train prompts left (every prompt is longer than data.max_prompt_tokens = "
            f"{data_cfg.max_prompt_tokens}); raise the limit"
        )
    return train, evals


def _hold_out(num_rows: int, eval_size: int, seed: int) -> tuple[list[int], list[int]]:
    if eval_size == 0:
        return list(range(num_rows)), []
    if eval_size >= num_rows:
        raise DataError(
            f"data.eval_size = {eval_size} leaves no train rows out of {num_rows}; lower it"
        )
    import numpy as np

    held = set(np.random.default_rng(seed).permutation(num_rows)[:eval_size].tolist())
    train = [i for i in range(num_rows) if i not in held]
    return train, sorted(held)


def _load_rows(data_cfg: Any, path: str | None, split: str | None) -> list[dict]:
    """Rows as dicts, columns renamed by data.column_map."""
    import datasets

    if path is not None:
        builder = FILE_BUILDERS[Path(path).suffix.lower()]
        try:
            ds = datasets.load_dataset(builder, data_files=str(path), split="train")
        except Exception as e:
            if builder == "json" and Path(path).suffix.lower() == ".jsonl":
                _scan_jsonl(Path(path))  # raises with the line number when a line is broken
            raise DataError(f"could not read {path}: {type(e).__name__}: {e}") from e
        source = str(path)
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
        _check_columns(list(ds.column_names), source, data_cfg)
    if data_cfg.column_map:
        ds = ds.rename_columns(dict(data_cfg.column_map))
    columns = ds.to_dict()
    num_rows = len(ds)
    return [{name: values[i] for name, values in columns.items()} for i in range(num_rows)]


def _make_prompts(
    rows: list[dict], uids: list[int], data_cfg: Any, tokenizer: Any, split: str
) -> list[Prompt]:
    texts = [_render(rows[uid], uid, data_cfg, tokenizer) for uid in uids]
    if not texts:
        return []
    ids = tokenizer(texts, add_special_tokens=not data_cfg.chat_template)["input_ids"]
    extra = data_cfg.columns
    prompts = []
    for uid, text, token_ids in zip(uids, texts, ids):
        row = rows[uid]
        names = extra if extra is not None else [c for c in row if c != data_cfg.prompt_column]
        prompts.append(
            Prompt(uid=uid, text=text, ids=list(token_ids), columns={c: row[c] for c in names})
        )
    limit = data_cfg.max_prompt_tokens
    if limit is not None:
        kept = [p for p in prompts if len(p.ids) <= limit]
        if len(kept) < len(prompts):
            logger.warning(
                "dropped %d of %d %s prompts longer than data.max_prompt_tokens = %d",
                len(prompts) - len(kept),
                len(prompts),
                split,
                limit,
            )
        prompts = kept
    return prompts


def _render(row: dict, uid: int, data_cfg: Any, tokenizer: Any) -> str:
    prompt = row.get(data_cfg.prompt_column)
    is_messages = isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt)
    if not (isinstance(prompt, str) or (is_messages and prompt)):
        raise DataError(
            f"row {uid}: column '{data_cfg.prompt_column}' holds {prompt!r}; a prompt must be "
            f"a string (or, with data.chat_template, a list of chat messages)"
        )
    if not data_cfg.chat_template:
        if is_messages:
            raise DataError(
                f"row {uid}: the prompt is a list of chat messages; set data.chat_template = true"
            )
        return prompt
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            "the tokenizer has no chat template; set data.chat_template = false to use the "
            "raw prompt text, or use an instruct model's tokenizer"
        )
    messages = list(prompt) if is_messages else [{"role": "user", "content": prompt}]
    if data_cfg.system_prompt is not None and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": data_cfg.system_prompt})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# ---- order --------------------------------------------------------------------------------


class PromptSampler:
    """Deterministic, resumable batches of prompts over epochs, re-queued prompts first."""

    def __init__(self, prompts: list[Prompt], batch_size: int, seed: int = 0, shuffle: bool = True):
        if not prompts:
            raise DataError("no prompts to sample from; check data.path and data.max_prompt_tokens")
        if batch_size < 1:
            raise DataError(f"batch size {batch_size} must be >= 1 (rollout.prompts_per_batch)")
        self._prompts = list(prompts)
        self._by_uid = {p.uid: p for p in self._prompts}
        if len(self._by_uid) != len(self._prompts):
            raise DataError("prompt uids must be unique (they are row indices)")
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self._epoch, self._position = 0, 0
        self._order = self._permutation(0)
        self._requeued: deque[int] = deque()

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        return self._position

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self._prompts)))
        import numpy as np

        return np.random.default_rng([self.seed, epoch]).permutation(len(self._prompts)).tolist()

    def next_batch(self) -> list[Prompt]:
        batch = []
        while self._requeued and len(batch) < self.batch_size:
            batch.append(self._by_uid[self._requeued.popleft()])
        while len(batch) < self.batch_size:
            if self._position == len(self._order):
                self._epoch += 1
                self._position = 0
                self._order = self._permutation(self._epoch)
            batch.append(self._prompts[self._order[self._position]])
            self._position += 1
        return batch

    def requeue(self, prompts: list[Prompt]) -> None:
        """Serve these prompts again, before any new ones, from the next call on."""
        self.requeue_uids([p.uid for p in prompts])

    def requeue_uids(self, uids: list[int]) -> None:
        """`requeue` by uid (what a checkpoint stores)."""
        for uid in uids:
            if uid not in self._by_uid:
                raise DataError(f"cannot re-queue prompt uid {uid}: it is not in this sampler")
            self._requeued.append(uid)

    def state_dict(self) -> dict:
        return {
            "epoch": self._epoch,
            "position": self._position,
            "requeued": list(self._requeued),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": len(self._prompts),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["num_prompts"] != len(self._prompts):
            raise DataError(
                f"the saved sampler state is for {state['num_prompts']} prompts but "
                f"{len(self._prompts)} are loaded; resume with the same data settings"
            )
        unknown = [uid for uid in state["requeued"] if uid not in self._by_uid]
        if unknown:
            raise DataError(f"the saved sampler state re-queues unknown prompt uids {unknown[:5]}")
        self.seed, self.shuffle = state["seed"], state["shuffle"]
        self._epoch, self._position = state["epoch"], state["position"]
        self._order = self._permutation(self._epoch)
        self._requeued = deque(state["requeued"])
