"""Local prompt files, read cheaply and checked row by row before any model loads.

What `data.check_data` runs on `data.path` / `data.eval_path`, without `datasets` or
torch: the file exists and has a supported type, it is UTF-8 text (a bad byte is named
with its line), JSON lines parse one by one (a broken line is named), the prompt column
and requested columns exist after `data.column_map`, and every prompt cell is a string
(or a chat-message list) that is not empty or whitespace unless `data.empty_prompts` is
'drop'. `check_prompt_cells` is shared with loading, where hub datasets get the same row
checks.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leangrpo.errors import UserError

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataError(UserError, ValueError):
    """The data settings or the data itself cannot be used; the message says how to fix it."""


@dataclass(frozen=True)
class CheckedFile:
    """What `check_file` learnt about a local file: its columns (after data.column_map)
    and how many rows it holds."""

    columns: list[str]
    rows: int


def check_file(path_str: str, key: str, data_cfg: Any) -> CheckedFile:
    path = Path(path_str).expanduser()
    if path.is_dir():
        raise DataError(
            f"{key} = '{path_str}' is a directory, but {key} takes one file ({', '.join(FILE_BUILDERS)}); "
            f"name a file in it, or load the directory's data files with data.dataset: '{path_str}' instead of {key}"
        )
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
    check_columns(columns, str(path), data_cfg)
    keys = dict.fromkeys(columns)  # JSON rows may each have other keys: their union
    rows = 0

    def counted() -> Iterator[tuple[int, int | None, Any]]:
        nonlocal rows
        for cell in local_prompt_cells(path_str, data_cfg, keys):
            rows += 1
            yield cell

    check_prompt_cells(counted(), f"{key} = '{path_str}'", data_cfg)
    column_map = dict(data_cfg.column_map or {})
    return CheckedFile([column_map.get(c, c) for c in keys], rows)


def local_prompt_cells(
    path_str: str, data_cfg: Any, keys: dict | None = None
) -> Iterator[tuple[int, int | None, Any]]:
    """(row index, line number or None, prompt value) of every row of a checked local file
    (`check_file`), its prompt column found through data.column_map; `keys` collects the
    keys of JSON rows."""
    source_column = {v: k for k, v in data_cfg.column_map.items()}.get(
        data_cfg.prompt_column, data_cfg.prompt_column
    )
    return _prompt_cells(Path(path_str).expanduser(), source_column, keys)


def _file_columns(path: Path) -> list[str]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return list(_parquet(path, lambda pq: pq.read_schema(path)).names)
    if suffix == ".csv":
        return _read_csv(path)[0]
    if suffix == ".json":
        rows = _read_json_rows(path)
        return list(rows[0]) if rows else []
    first = next(_jsonl_rows(path), None)
    return list(first[2]) if first is not None else []


def _prompt_cells(
    path: Path, column: str, keys: dict | None = None
) -> Iterator[tuple[int, int | None, Any]]:
    """(row index, line number or None, prompt value) of every row of a local file; the
    keys of JSON rows are added to `keys` as they are read."""
    keys = {} if keys is None else keys
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        table = _parquet(path, lambda pq: pq.read_table(path, columns=[column]))
        yield from ((i, None, v) for i, v in enumerate(table.column(0).to_pylist()))
    elif suffix == ".csv":
        yield from ((i, line, row.get(column)) for i, (line, row) in enumerate(_read_csv(path)[1]))
    else:
        rows = (
            ((i, None, row) for i, row in enumerate(_read_json_rows(path)))
            if suffix == ".json"
            else _jsonl_rows(path)
        )
        for i, line, row in rows:
            keys.update(dict.fromkeys(row))
            yield i, line, row.get(column)


PARQUET_MAGIC = b"PAR1"  # a Parquet file starts and ends with it


def _parquet(path: Path, read: Any) -> Any:
    """`read(pyarrow.parquet)`, for a file that is Parquet: one that is not (a wrong
    extension, a truncated copy) is named before pyarrow is imported."""
    with path.open("rb") as f:
        head = f.read(4)
        f.seek(max(path.stat().st_size - 4, 0))
        tail = f.read(4)
    if head != PARQUET_MAGIC or tail != PARQUET_MAGIC or path.stat().st_size < 12:
        found = "it is empty" if not head else f"it starts with {head!r}"
        if head == PARQUET_MAGIC:
            found = "its end is missing (a truncated copy?)"
        raise DataError(
            f"{path} is not a Parquet file ({found}; Parquet files start and end with "
            f"{PARQUET_MAGIC!r}); convert it to Parquet, or give it the extension of its format "
            f"({', '.join(FILE_BUILDERS)})"
        )
    import pyarrow.parquet as pq

    try:
        return read(pq)
    except Exception as e:  # pyarrow's ArrowInvalid, OSError ...
        raise DataError(f"{path} cannot be read as Parquet: {type(e).__name__}: {e}") from None


def _read_csv(path: Path) -> tuple[list[str], list[tuple[int, dict]]]:
    """The header and every record (its first line, its fields by column) of a CSV file,
    parsed as strictly as the loader (pandas) needs: an unclosed or malformed quote, and a
    record with more fields than the header (pandas would shift it into an index), are
    named with their line. Blank lines are skipped, as pandas does."""
    reader = csv.reader(io.StringIO(read_utf8(path)), strict=True)
    header: list[str] | None = None
    records: list[tuple[int, dict]] = []
    while True:
        start = reader.line_num + 1
        try:
            fields = next(reader)
        except StopIteration:
            return header or [], records
        except csv.Error as e:
            raise DataError(_csv_problem(path, start, reader.line_num, str(e))) from None
        if not fields:
            continue
        if header is None:
            header = fields
        elif len(fields) > len(header):
            raise DataError(
                f"{path} line {start} has {len(fields)} fields but the header has "
                f"{len(header)}; quote fields that hold a comma (\"like, this\")"
            )
        else:
            records.append((start, dict(zip(header, fields))))


def _csv_problem(path: Path, start: int, end: int, error: str) -> str:
    if error == "unexpected end of data":
        return (
            f"{path} line {start}: a quoted field opens there and is never closed (the file "
            f"ends inside it); close the quote, and double any quote inside a quoted field (\"\")"
        )
    return (
        f"{path} line {end}: malformed quoting ({error}); quote the whole field and double "
        f"any quote inside it (\"say \"\"hi\"\"\")"
    )


def read_utf8(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError(
            f"{path} is not UTF-8 text (byte {raw[e.start]:#04x} at line {line}); save it as UTF-8"
        ) from None


def read_json_table(path: Path) -> list[dict]:
    """Every row of a .json / .jsonl file, over the union of the rows' keys (in the order
    they first appear); a key a row lacks reads None, as `datasets` fills it. Values keep
    their JSON types (no column-wide casts)."""
    rows = (
        _read_json_rows(path)
        if path.suffix.lower() == ".json"
        else [r for _, _, r in _jsonl_rows(path)]
    )
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return [{key: row.get(key) for key in columns} for row in rows]


def _read_json_rows(path: Path) -> list:
    """A .json file holds a JSON array of row objects, or JSON lines."""
    text = read_utf8(path)
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        if text.lstrip().startswith("["):
            raise DataError(f"{path} is not valid JSON (line {e.lineno}: {e.msg})") from None
        return [row for _, _, row in _jsonl_rows(path)]  # JSON lines under a .json name
    if isinstance(rows, dict):
        rows = [rows]  # one row: JSON lines with a single line
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise DataError(f"{path} must hold a JSON array of objects (one per row) or JSON lines")
    return rows


def _jsonl_rows(path: Path) -> Iterator[tuple[int, int, dict]]:
    """(row index, line number, row) of every non-blank line, each checked as it is read."""
    with path.open("rb") as f:
        index = 0
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path} line {line_no} is not UTF-8 text (byte {raw[e.start]:#04x}); save the file as UTF-8"
                ) from None
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
            yield index, line_no, row
            index += 1


def prompt_problem(value: Any, chat_template: bool) -> str | None:
    """Why a raw prompt cell cannot be used ('empty' for blank text), or None."""
    is_messages = isinstance(value, list) and all(isinstance(m, dict) for m in value)
    if not (isinstance(value, str) or (is_messages and value)):
        return (
            f"holds {_short(value)}; a prompt must be a string (or, with "
            f"data.chat_template, a list of chat messages)"
        )
    if is_messages and not chat_template:
        return "is a list of chat messages; set data.chat_template = true"
    text = value if isinstance(value, str) else "".join(str(m.get("content", "")) for m in value)
    return "empty" if not text.strip() else None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_prompt_cells(
    cells: Iterator[tuple[int, int | None, Any]], source: str, data_cfg: Any
) -> None:
    """Refuse a wrongly typed prompt, and an empty one unless data.empty_prompts is 'drop'."""
    empty: list[tuple[int, int | None]] = []
    for row, line, value in cells:
        problem = prompt_problem(value, data_cfg.chat_template)
        where = f"{source} row {row}" + (f" (line {line})" if line else "")
        if problem == "empty":
            empty.append((row, line))
        elif problem is not None:
            raise DataError(f"{where}: column '{data_cfg.prompt_column}' {problem}")
    if empty and data_cfg.empty_prompts == "error":
        row, line = empty[0]
        more = f" (and {len(empty) - 1} more rows)" if len(empty) > 1 else ""
        raise DataError(
            f"{source} row {row}" + (f" (line {line})" if line else "") + f" has an empty "
            f"prompt{more}; remove it, or set data.empty_prompts: drop to leave such rows out"
        )


def check_columns(columns: list[str], source: str, data_cfg: Any) -> None:
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
