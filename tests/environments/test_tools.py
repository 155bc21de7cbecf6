"""Tools (environments/tools.py): the Hermes parser, pluggable parsers' returns checked,
tool messages with their counts (schemas: test_schema.py)."""

from __future__ import annotations

from collections import Counter

import pytest
from support.environments import add, divide

from leangrpo.environments.tools import (
    MAX_CALL_CHARS,
    ParsedTurn,
    ToolCall,
    ToolError,
    parse_hermes,
    parsed_turn,
    tool_messages,
)


@pytest.mark.parametrize(
    ("text", "calls", "errors", "content"),
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>', [("add", {"a": 1, "b": 2})], [], ""),
        ('Sure.\n<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 3}"}\n</tool_call>', [("add", {"a": 3})], [], "Sure."),
        ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": }}</tool_call>', [], ["tool call is not valid JSON (Expecting value at char 43)"], ""),
        ('<tool_call>["add"]</tool_call>', [], ['tool call needs {"name": <string>, "arguments": <object>}'], ""),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', [], ["tool call arguments must be a JSON object"], ""),
        ('579 <tool_call>{"name": "add", "argu', [], ["unclosed <tool_call> block"], "579"),
        ("579", [], [], "579"),
    ],
)  # fmt: skip
def test_hermes_parser(text, calls, errors, content):
    parsed = parse_hermes(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == calls
    assert parsed.errors == errors and parsed.content == content


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ('{"a": NaN, "b": 1}', "tool call holds NaN, which JSON does not have"),
        ('{"a": -Infinity}', "tool call holds -Infinity, which JSON does not have"),
        ('{"a": 1e999}', "tool call holds the number 1e999, too large for a float"),
        ('{"a": ' + "9" * 5000 + "}", "tool call cannot be read (Exceeds the limit (4300 digits)"),
        ('{"a": ' + "[" * 5000 + "]" * 5000 + "}", "tool call is nested too deeply to read"),
        ('{"a": "' + "x" * MAX_CALL_CHARS + '"}', f"more than the {MAX_CALL_CHARS} a call may have"),
        ('"{\\"a\\": NaN}"', "tool call arguments are a string that holds NaN"),
    ],
)  # fmt: skip
def test_malformed_model_json_is_a_parse_error_never_an_exception(arguments, error):
    """What json.loads rejects with ValueError or RecursionError (not JSONDecodeError), or
    accepts but JSON has no value for (NaN, inf), is the call's parse error; the good call
    of the same turn is still read."""
    text = f'<tool_call>{{"name": "add", "arguments": {arguments}}}</tool_call>'
    parsed = parse_hermes(text + '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    assert len(parsed.errors) == 1 and error in parsed.errors[0], parsed.errors
    assert parsed.calls == [ToolCall("add", {"a": 1})]


def test_a_pluggable_parsers_return_is_checked():
    parsed = parsed_turn(("x", [{"name": "add", "arguments": {"a": 1}}], []))
    assert parsed == ParsedTurn("x", [ToolCall("add", {"a": 1})], [])
    with pytest.raises(ToolError, match="return \\(content, calls, errors\\)"):
        parsed_turn("x")
    with pytest.raises(ToolError, match="not {\"name\": str"):
        parsed_turn(("x", [{"name": 3}], []))


def test_tool_messages_answer_every_call_and_count_per_tool():
    parsed = parse_hermes(
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        '<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 5, "b": 5}}</tool_call>'
    )
    counts = Counter()
    tools = {"add": add, "divide": divide}
    out = tool_messages(parsed, tools, lambda fn, args: fn(**args), counts, max_calls=2)
    assert [m["content"] for m in out] == [
        "3",
        "error: ZeroDivisionError: division by zero",
        "error: more than 2 tool calls in one turn",
    ]
    assert counts == Counter({"tool_calls": 2, "tool_calls/add": 1, "tool_calls/divide": 1,
                              "tool_errors": 2, "tool_errors/divide": 1})  # fmt: skip
