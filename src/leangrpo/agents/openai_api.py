"""The OpenAI wire format: requests checked and read, messages normalised, responses made.

- `Refused`: a request answered with an OpenAI-style error (`{"error": {"message", "type",
  "param", "code"}}`, status 400 unless said): one sentence saying what and why.
- `sampling_limits(body, params)`: the request's sampling settings against the run's.
  Generation runs at the run's policy and sampling transformation (the trainer recomputes
  its log-probs under it: a different temperature, top_p, top_k or min_p would make the
  behaviour log-probs those of another policy), so such a value is refused unless it
  equals the run's; so are n > 1, penalties, logit_bias and top_logprobs (nothing the
  engines report). `max_tokens` / `max_completion_tokens` are capped by
  rollout.max_new_tokens; `stop` strings apply per request.
- `template_messages(messages)`: the client's messages as chat-template messages (text
  content parts joined, `developer` as `system`, tool-call arguments parsed from their JSON
  string, a tool message named after the call it answers), and `view_key(message)`, what
  two messages are compared by when deciding whether a request extends a session's
  conversation: an assistant message by its text and its calls (name and arguments as
  parsed JSON: spacing and key order do not matter), any other by its fields.
- `assistant_message`, `chat_response`, `chat_chunks`, `completion_response`: the
  response bodies, OpenAI-shaped, with vLLM's `return_token_ids` convention (the choice's
  `token_ids`; the response's `prompt_token_ids` when asked) and log-probs when asked.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any

from leangrpo.contracts import SamplingParams
from leangrpo.environments.tools import ParsedTurn

ROLES = ("system", "developer", "user", "assistant", "tool")


class Refused(Exception):
    """A request the endpoint answers with an OpenAI-style error."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# -- sampling -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestLimits:
    """What one request may generate: its budget and its own stop strings."""

    max_new_tokens: int
    stop: tuple[str, ...]
    logprobs: bool


_RUN_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p"}
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1}


def sampling_limits(body: dict[str, Any], params: SamplingParams) -> RequestLimits:
    """The request's budget, stop strings and log-prob wish; refuses what the run cannot do."""
    for key, field in _RUN_KEYS.items():
        value = body.get(key)
        if value is not None and _number(value, key) != getattr(params, field):
            raise Refused(
                f"{key} = {value} differs from the run's rollout.{field} = {getattr(params, field)}: "
                "every turn is sampled as the trainer computes its log-probs (another value would "
                f"train on another policy's log-probs); leave {key} out or set it to {getattr(params, field)}",
                key,
            )
    n = body.get("n")
    if n is not None and n != 1:
        raise Refused(f"n = {n}: one choice per request (an agent's episode is one trajectory); leave n out or set it to 1", "n")
    for key, neutral in _NEUTRAL.items():
        value = body.get(key)
        if value is not None and _number(value, key) != neutral:
            raise Refused(f"{key} = {value} would change the sampled distribution away from the policy's; leave it out", key)
    if body.get("logit_bias"):
        raise Refused("logit_bias would change the sampled distribution away from the policy's; leave it out", "logit_bias")
    if body.get("top_logprobs"):
        raise Refused("top_logprobs is not available: the engines report the sampled token's log-prob only; leave it out or set it to 0", "top_logprobs")
    budget = params.max_new_tokens
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise Refused(f"{key} must be a positive integer, got {value!r}", key)
            budget = min(budget, value)
            break
    return RequestLimits(budget, _stops(body.get("stop")), bool(body.get("logprobs")))


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Refused(f"{key} must be a number, got {value!r}", key)
    return value


def _stops(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise Refused("stop must be a non-empty string or a list of at most 4 of them", "stop")
    return tuple(stops)


# -- messages -------------------------------------------------------------------------------


def text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise Refused(f"{where} has a content part of type {kind!r}; only text is taken", "messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise Refused(f"{where} has content of type {type(content).__name__}; give a string or text parts", "messages")


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """The request's messages as the chat template takes them (see the module docstring)."""
    if not isinstance(messages, list) or not messages:
        raise Refused("messages must be a non-empty list", "messages")
    names: dict[str, str] = {}  # tool_call_id -> the tool's name
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise Refused(f"{where} needs a role among {', '.join(ROLES)}", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        message: dict[str, Any] = {"role": role, "content": text_of(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = [_call(c, names, f"{where}.tool_calls[{k}]") for k, c in enumerate(m["tool_calls"])]
        elif role == "tool":
            call_id = m.get("tool_call_id")
            if call_id is not None:
                message["tool_call_id"] = str(call_id)
            name = m.get("name") or names.get(str(call_id))
            if name:
                message["name"] = str(name)
        elif m.get("name") and role in ("user", "system"):
            message["name"] = str(m["name"])
        out.append(message)
    return out


def _call(call: Any, names: dict[str, str], where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise Refused(f"{where} needs a function with a name", "messages")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        # not JSON: kept as the client wrote it (compared and rendered as a string)
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments) if arguments.strip() else {}
    if call.get("id") is not None:
        names[str(call["id"])] = function["name"]
    return {"type": "function", "function": {"name": function["name"], "arguments": arguments}}


def view_key(message: dict[str, Any]) -> str:
    """What a (template) message is compared by: see the module docstring."""
    if message["role"] == "assistant":
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
        return json.dumps(["assistant", message["content"].strip(), calls], sort_keys=True)
    return json.dumps(message, sort_keys=True)


def tools_key(tools: Any) -> str:
    if tools is None:
        return "null"
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise Refused("tools must be a list of tool objects", "tools")
    return json.dumps(tools, sort_keys=True)


def check_tool_choice(body: dict[str, Any]) -> None:
    """'auto' (or unset) is what the model does anyway; 'none' and named choices would need
    the sampler constrained, which the policy's log-probs do not allow for."""
    choice = body.get("tool_choice")
    if choice in (None, "auto") or (choice == "none" and not body.get("tools")):
        return
    raise Refused(
        f"tool_choice = {json.dumps(choice)}: the model chooses whether to call a tool (its turns are sampled from the policy unconstrained); leave tool_choice out or set it to 'auto'",
        "tool_choice",
    )


# -- responses ------------------------------------------------------------------------------


def assistant_message(parsed: ParsedTurn, turn: int) -> dict[str, Any]:
    """The OpenAI message of a model turn: its text and the calls the parser read."""
    calls = [
        {
            "id": f"call_{turn}_{k}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for k, c in enumerate(parsed.calls)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content if parsed.content or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


@dataclass
class Answer:
    """One generated turn, as the responses report it."""

    id: str
    model: str
    message: dict[str, Any]  # the assistant message (chat) or {"text": ...} (completions)
    finish_reason: str  # stop | length | tool_calls
    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]
    pieces: list[str]  # each token's text
    return_prompt_ids: bool
    with_logprobs: bool

    def usage(self) -> dict[str, int]:
        p, c = len(self.prompt_ids), len(self.ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def logprob_content(self) -> list[dict[str, Any]]:
        return [
            {"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []}
            for piece, lp in zip(self.pieces, self.logprobs)
        ]


def chat_response(a: Answer) -> dict[str, Any]:
    choice = {
        "index": 0,
        "message": a.message,
        "finish_reason": a.finish_reason,
        "logprobs": {"content": a.logprob_content()} if a.with_logprobs else None,
        "token_ids": a.ids,
    }
    out = {"id": a.id, "object": "chat.completion", "created": int(time.time()), "model": a.model,
           "choices": [choice], "usage": a.usage()}  # fmt: skip
    if a.return_prompt_ids:
        out["prompt_token_ids"] = a.prompt_ids
    return out


def chat_chunks(a: Answer, include_usage: bool) -> list[dict[str, Any]]:
    """The streamed form of `chat_response`: the turn's text (with its ids and log-probs),
    its calls, its finish reason, then the usage when asked. The turn is complete before
    its first chunk goes (the engines return whole turns)."""
    base = {"id": a.id, "object": "chat.completion.chunk", "created": int(time.time()), "model": a.model}

    def chunk(delta: dict, finish: str | None = None, **extra: Any) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None, **extra}
        return {**base, "choices": [choice]}

    content = a.message.get("content")
    first = chunk({"role": "assistant", "content": content or ""}, token_ids=a.ids)
    if a.with_logprobs:
        first["choices"][0]["logprobs"] = {"content": a.logprob_content()}
    if a.return_prompt_ids:
        first["prompt_token_ids"] = a.prompt_ids
    out = [first]
    calls = a.message.get("tool_calls") or []
    if calls:
        out.append(chunk({"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}))
    out.append(chunk({}, a.finish_reason))
    if include_usage:
        out.append({**base, "choices": [], "usage": a.usage()})
    return out


def completion_response(a: Answer) -> dict[str, Any]:
    logprobs = None
    if a.with_logprobs:
        logprobs = {"tokens": a.pieces, "token_logprobs": a.logprobs, "top_logprobs": None,
                    "text_offset": _offsets(a.pieces)}  # fmt: skip
    choice = {"index": 0, "text": a.message["text"], "finish_reason": a.finish_reason,
              "logprobs": logprobs, "token_ids": a.ids}  # fmt: skip
    out = {"id": a.id, "object": "text_completion", "created": int(time.time()), "model": a.model,
           "choices": [choice], "usage": a.usage()}  # fmt: skip
    if a.return_prompt_ids:
        out["prompt_token_ids"] = a.prompt_ids
    return out


def _offsets(pieces: list[str]) -> list[int]:
    out, pos = [], 0
    for piece in pieces:
        out.append(pos)
        pos += len(piece)
    return out
