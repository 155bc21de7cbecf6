"""Tools: calls parsed from the model's turn, and the tool messages that answer them.

- Schemas (the JSON the chat template's `tools=` lists) are schema.py's `tool_schema`.
- Calls: the default parser (`environment.tool_parser: hermes`) reads the format Qwen2.5,
  Qwen3 and Hermes templates ask for, JSON in tags, one block per call:
  `<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>`; arguments given
  as a JSON string are decoded (some models write them so). A block that is not valid
  JSON (NaN, Infinity and numbers that overflow a float included: JSON has none), lacks a
  name or has arguments that are not an object, one over `MAX_CALL_CHARS` characters
  (never parsed), nested deeper than the decoder goes or holding an integer too long to
  read, and an unclosed block (a turn cut short), are parse errors: the parser never
  raises on what a model writes. The text outside the blocks is the turn's content.
  Any other parser is a function `parse(text) -> (content, calls, errors)` (calls as
  {"name", "arguments"} dicts), resolved in the environment worker; whatever it raises on
  a turn is that turn's parse error (worker.py).
- Results: `tool_messages(parsed, tools, call)` gives one tool message per call, and one
  per parse error: the result as text, or `error: ...` for an unknown tool, wrong
  arguments or a tool that raised or timed out (`call` runs the tool under its limit in
  the worker), counted per tool (calls of tools that do not exist under `<unknown>`: the
model does not get to name metrics). Nothing a tool does reaches the trainer's process.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
MAX_ERROR_CHARS = 300
MAX_CALL_CHARS = 65536  # a tool call block longer than this is a parse error, unread
UNKNOWN = "<unknown>"  # calls of a tool that does not exist are counted under this name


class ToolError(ValueError):
    """A tool cannot be offered (no type hints or docstring), or a parser returned garbage."""


class ToolCallFailed(Exception):
    """A tool raised, timed out or used its CPU time (the message names which)."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedTurn:
    content: str  # the text outside the tool-call blocks, stripped
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one line per block that did not parse


def parse_hermes(text: str) -> ParsedTurn:
    """Hermes / Qwen2.5 tool calls: JSON objects {"name", "arguments"} in <tool_call> tags."""
    calls, errors = [], []
    for match in HERMES_BLOCK.finditer(text):
        call, error = _hermes_call(match.group(1))
        if call is not None:
            calls.append(call)
        else:
            errors.append(error)
    rest = HERMES_BLOCK.sub("", text)
    if "<tool_call>" in rest:  # a block the turn never closed (cut by max_new_tokens)
        errors.append("unclosed <tool_call> block")
        rest = rest.split("<tool_call>")[0]
    return ParsedTurn(rest.strip(), calls, errors)


def _hermes_call(body: str) -> tuple[ToolCall | None, str]:
    if len(body) > MAX_CALL_CHARS:
        return None, f"tool call has {len(body)} characters, more than the {MAX_CALL_CHARS} a call may have"
    obj, error = model_json(body)
    if error:
        return None, f"tool call {error}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, 'tool call needs {"name": <string>, "arguments": <object>}'
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        arguments, error = model_json(arguments)
        if error:
            return None, f"tool call arguments are a string that {error}"
    if not isinstance(arguments, dict):
        return None, "tool call arguments must be a JSON object"
    return ToolCall(obj["name"], arguments), ""


class _NotJSON(ValueError):
    pass


def _no_constant(name: str) -> Any:
    raise _NotJSON(f"holds {name}, which JSON does not have")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotJSON(f"holds the number {text[:20]}, too large for a float")
    return value


def model_json(text: str) -> tuple[Any, str]:
    """(value, "") or (None, why it is not JSON a tool can be called with): strict JSON
    (no NaN or Infinity, finite floats), and no exception whatever the text."""
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite), ""
    except json.JSONDecodeError as e:
        return None, f"is not valid JSON ({e.msg} at char {e.pos})"
    except _NotJSON as e:
        return None, str(e)
    except RecursionError:
        return None, "is nested too deeply to read"
    except ValueError as e:  # an integer over the interpreter's digit limit
        return None, f"cannot be read ({one_line(str(e), 80)})"


def parsed_turn(value: Any) -> ParsedTurn:
    """A user parser's return, (content, calls, errors) or a ParsedTurn, checked."""
    if isinstance(value, ParsedTurn):
        return value
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise ToolError(
            f"the tool parser returned {type(value).__name__}; return (content, calls, errors)"
        )
    content, calls, errors = value
    checked = []
    for call in calls:
        name = call.get("name") if isinstance(call, dict) else getattr(call, "name", None)
        arguments = call.get("arguments") if isinstance(call, dict) else getattr(call, "arguments", None)  # fmt: skip
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise ToolError(
                'the tool parser returned a call that is not {"name": str, "arguments": dict}'
            )
        checked.append(ToolCall(name, arguments))
    return ParsedTurn(str(content), checked, [str(e) for e in errors])


def tool_messages(
    parsed: ParsedTurn,
    tools: dict[str, Callable],
    call: Callable[[Callable, dict], Any],
    counts: Counter,
    max_calls: int = 16,
    max_chars: int | None = None,
) -> list[dict[str, str]]:
    """One tool message per parse error and per call, in order; `counts` gets
    `tool_calls`, `tool_errors` and the same per tool (`tool_calls/<name>`, ...). Calls
    beyond `max_calls` in one turn are not run (an error message each); a result longer
    than `max_chars` is cut, with a marker the model reads, and counted (`tool_truncated`)."""
    out = []
    for error in parsed.errors:
        out.append({"role": "tool", "content": f"error: {error}"})
        counts["tool_errors"] += 1
        counts["parse_errors"] += 1
    for k, c in enumerate(parsed.calls):
        if k >= max_calls:
            out.append({"role": "tool", "name": c.name,
                        "content": f"error: more than {max_calls} tool calls in one turn"})  # fmt: skip
            counts["tool_errors"] += 1
            continue
        fn, failed = tools.get(c.name), True
        name = c.name if fn is not None else UNKNOWN  # metric names: the tools', not the model's
        counts["tool_calls"] += 1
        counts[f"tool_calls/{name}"] += 1
        if fn is None:
            text = f"error: unknown tool {c.name!r}; tools: {', '.join(tools) or 'none'}"
        else:
            try:
                text, failed = as_text(call(fn, c.arguments)), False
            except ToolCallFailed as e:  # the worker's limited call: already described
                text = one_line(f"error: {e}")
            except Exception as e:  # noqa: BLE001  model-written arguments: any failure is a message
                text = one_line(f"error: {type(e).__name__}: {e}")
        if failed:
            counts["tool_errors"] += 1
            counts[f"tool_errors/{name}"] += 1
        elif max_chars is not None and len(text) > max_chars:
            text = truncated(text, max_chars)
            counts["tool_truncated"] += 1
        out.append({"role": "tool", "name": c.name, "content": text})
    return out


def truncated(text: str, max_chars: int) -> str:
    """The first `max_chars` characters of a tool result, and a line saying it was cut."""
    return (
        f"{text[:max_chars]}\n[truncated: the tool returned {len(text)} characters; only the "
        f"first {max_chars} are shown]"
    )


def as_text(value: Any) -> str:
    """A tool's return as the text of its message (JSON for a dict or list)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    except (TypeError, ValueError):
        return str(value)


def one_line(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
