"""Token-exact trajectories: a conversation rendered turn by turn with the chat template.

A trajectory is one sequence, `prompt | model_1 | env_1 | model_2 | ... | model_K`:
- the prompt is the tokenisation of the rendered start messages with the generation prompt;
- a model turn is the engine's ids, verbatim (never re-tokenised: sampled text need not
  re-encode to the same ids), EOS included when the turn stopped on it. Its text (decoded
  with special tokens, the EOS cut off) is the assistant message the conversation holds;
- an environment segment is the tokenisation of what the template adds between two model
  turns: the rest of the turn's closing after the EOS (ChatML: "\\n"; none for the demo's
  template), the reply messages, and the next generation prompt; the difference of two
  renderings of the conversation.
After the last model turn nothing is added (the closing is never trained on, as single-turn).

That is exact only where every rendering is a prefix of the next one and the model's turn
sits between the generation prompt and the turn's closing, which starts with the EOS the
engine stopped on. Each environment segment checks this (string comparisons); a failure
ends the trajectory (`NotIncremental`, finish reason 'error'). At start-up, `check_template`
renders a probe conversation (with the reply roles the environment produces) turn by turn
and compares the ids with the tokenisation of the whole conversation: a template that
rewrites earlier turns (e.g. one stripping `<think>` from history), closes a turn without
the EOS, or whose cuts change the tokens is refused with one sentence naming it, and so is
one that does not render a model turn's text as it is: a turn with whitespace at its edges
is probed (Llama 3 and Gemma templates `| trim` message contents, which would end every
such turn with 'error'; the model's ids cannot be re-rendered trimmed and stay exact). A template
that renders the same text with and without `tools=` is refused too: tools would silently
never reach the model (SmolLM2's does; `environment.chat_template: chatml-hermes` is a
bundled ChatML template with Hermes tool calls).

Control tokens (the tokenizer's special tokens, and its added tokens that the template's
text holds, e.g. `<tool_call>`; whitespace tokens aside, as transformers' own
`sanitize_control_tokens` infers them) are removed from every field of the messages an
environment writes (its reset messages and replies: content, role, name, tool_call_id)
before rendering, to a fixed point: one left-to-right pass that removes a token as soon as
the text kept so far ends with one, so a nested `<|im_<|im_end|>end|>` leaves nothing
either (counted: `control_tokens_stripped`). A tool's output cannot forge a turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from leangrpo.data.templates import TemplateError

MAX_REMEMBERED_STARTS = 4096  # renderings of start messages kept (a group shares one)


class NotIncremental(ValueError):
    """Appending a turn changed what was rendered before (a trajectory ends with 'error')."""


class Renderer:
    """The run's tokenizer, template and tools: renders and tokenises conversations."""

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None, template: str | None = None):
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.template = template
        self.name = getattr(tokenizer, "name_or_path", None) or "the tokenizer"
        self.control_tokens = control_tokens(tokenizer, template)
        self._starts: dict[str, tuple[str, list[int]]] = {}  # start messages -> text, ids

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        kwargs = {} if self.template is None else {"chat_template": self.template}
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=generation_prompt,
            tokenize=False, **kwargs,
        )  # fmt: skip

    def first_turn(self, messages: list[dict]) -> str:
        """The text a trajectory starting from `messages` is prompted with."""
        return self.render(messages, generation_prompt=True)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def start(self, messages: list[dict]) -> Conversation:
        """A conversation from its start messages; the rendering of messages seen before
        (a group's trajectories start alike) is reused."""
        key = _json_key(messages)
        cached = self._starts.get(key) if key is not None else None
        if cached is None:
            text = self.first_turn(messages)
            cached = (text, self.encode(text))
            if key is not None:
                if len(self._starts) >= MAX_REMEMBERED_STARTS:
                    self._starts.pop(next(iter(self._starts)))
                self._starts[key] = cached
        text, ids = cached
        start = [dict(m) for m in messages]
        return Conversation(self, start, text, list(ids), len(start), text)

    def sanitised(self, messages: list[dict]) -> tuple[list[dict], int]:
        """Environment messages with the control tokens removed from every string field
        (to a fixed point), and how many were removed."""
        out, stripped = [], 0
        for m in messages:
            clean = {}
            for key, value in m.items():
                clean[key], removed = neutralised(value, self.control_tokens) if isinstance(value, str) else (value, 0)
                stripped += removed
            out.append(clean)
        return out, stripped


def _json_key(messages: list[dict]) -> str | None:
    try:
        return json.dumps(messages, sort_keys=True)
    except (TypeError, ValueError):  # not plain JSON: rendered every time
        return None


def control_tokens(tokenizer: Any, template: str | None = None) -> tuple[str, ...]:
    """The strings that render as control tokens: every special added token, and the other
    added tokens the chat template's text holds (not whitespace ones), longest first."""
    source = template if template is not None else getattr(tokenizer, "chat_template", None)
    text = "\0".join(source.values()) if isinstance(source, dict) else (source or "")
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found = {s for s in getattr(tokenizer, "all_special_tokens", None) or [] if s}
    for token in added.values():
        content = getattr(token, "content", str(token))
        if content and (getattr(token, "special", False) or (content in text and not content.isspace())):
            found.add(content)
    return tuple(sorted(found, key=lambda s: (-len(s), s)))


def neutralised(text: str, tokens: tuple[str, ...]) -> tuple[str, int]:
    """`text` with every control token removed, to a fixed point, and the number removed.

    One pass: each character is appended to the kept text, and when the kept text then ends
    with a token, the token is dropped. The kept text never holds a token (a new one can
    only end at the character just appended; dropping one leaves a prefix of text that held
    none), so what removing tokens again and again would reach is reached at once, in
    O(len(text) x tokens ending in that character)."""
    if not tokens or not any(t in text for t in tokens):
        return text, 0
    by_last: dict[str, list[str]] = {}
    for token in tokens:  # longest first within each ending
        by_last.setdefault(token[-1], []).append(token)
    kept: list[str] = []
    removed = 0
    for ch in text:
        kept.append(ch)
        for token in by_last.get(ch, ()):
            n = len(token)
            if len(kept) >= n and "".join(kept[-n:]) == token:
                del kept[-n:]
                removed += 1
                break
    return "".join(kept), removed


@dataclass
class Conversation:
    """One trajectory's conversation so far and its token segments."""

    renderer: Renderer
    messages: list[dict]
    text: str  # the rendering so far, ending with the generation prompt
    prompt_ids: list[int]
    start_messages: int  # the first messages: what the trajectory starts from
    start_text: str  # their rendering (the prompt's text)
    ids: list[int] = field(default_factory=list)  # after the prompt: model and env tokens
    segments: list[tuple[int, bool]] = field(default_factory=list)
    _closing: tuple[str, str] | None = None  # (content, EOS text or "") of the last turn

    def add_model_turn(self, ids: list[int], stopped_on_eos: bool) -> str:
        """The engine's ids, verbatim; returns the turn's text (the assistant message)."""
        tokenizer = self.renderer.tokenizer
        text = tokenizer.decode(ids, skip_special_tokens=False)
        eos_text = tokenizer.decode(ids[-1:], skip_special_tokens=False) if stopped_on_eos else ""
        content = text[: len(text) - len(eos_text)] if eos_text and text.endswith(eos_text) else text
        self.ids.extend(ids)
        self.segments.append((len(ids), True))
        self.messages.append({"role": "assistant", "content": content})
        self._closing = (content, eos_text)
        return content

    def add_reply(self, reply: list[dict], room: int | None = None) -> list[int] | None:
        """Append the environment segment for `reply` and return its ids; when it would
        leave fewer than one token of `room` for the next turn, add nothing: None."""
        content, eos_text = self._closing
        renderer = self.renderer
        closed = renderer.render(self.messages, generation_prompt=False)
        if not closed.startswith(self.text + content):
            raise NotIncremental(
                "the rendering with the new assistant turn does not start with the previous "
                "rendering followed by the turn's text"
            )
        closing = closed[len(self.text) + len(content) :]
        if eos_text:
            if not closing.startswith(eos_text):
                raise NotIncremental(
                    f"the template closes an assistant turn with {closing[:20]!r}, not with the "
                    f"EOS {eos_text!r} the engine stopped on"
                )
            closing = closing[len(eos_text) :]
        following = renderer.render([*self.messages, *reply], generation_prompt=True)
        if not following.startswith(closed):
            raise NotIncremental(
                "appending the environment's reply changes the rendering of earlier turns"
            )
        env_ids = renderer.encode(closing + following[len(closed) :])
        if room is not None and len(env_ids) >= room:
            return None
        self.messages.extend(dict(m) for m in reply)
        self.text = following
        self.ids.extend(env_ids)
        self.segments.append((len(env_ids), False))
        return env_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.ids)


# -- the start-up check ---------------------------------------------------------------------

# reasoning first: a template that drops it from earlier turns (Qwen3's, before the last
# user message) is caught
PROBE_THINK = "<think>\nAdd the numbers.\n</think>\n\n"
PROBE_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call>'


def probe_conversation(replies: list[str]) -> tuple[list[dict], list[tuple[str, list[dict] | None]]]:
    """A conversation with every reply role the environment produces (then the end)."""
    start = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 12 + 30?"},
    ]
    turns: list[tuple[str, list[dict] | None]] = []
    for role in dict.fromkeys(replies or ["user"]):
        if role == "tool":
            turns.append((PROBE_THINK + PROBE_CALL, [{"role": "tool", "name": "add", "content": "42"}]))
        else:
            turns.append((PROBE_THINK + "It is 42.", [{"role": role, "content": "And 1 + 1?"}]))
    turns.append(("2", None))
    return start, turns


def check_template(renderer: Renderer, replies: list[str], eos_id: int | None) -> None:
    """Refuse, in one sentence, a template that cannot render this environment's
    conversations turn by turn, token for token (see the module docstring)."""
    tokenizer, name = renderer.tokenizer, renderer.name
    if renderer.template is None and getattr(tokenizer, "chat_template", None) is None:
        raise TemplateError(
            f"{name} has no chat template, which a multi-turn conversation is rendered with; set environment.chat_template (e.g. chatml-hermes for a ChatML model)"
        )
    if eos_id is None:
        raise TemplateError(f"{name} has no EOS token, so a model turn cannot end")
    try:
        _check_tools_listed(renderer)
        _check_keeps_whitespace(renderer)
        start, turns = probe_conversation(replies)
        conversation = renderer.start(start)
        for assistant, reply in turns:
            conversation.add_model_turn(renderer.encode(assistant) + [eos_id], stopped_on_eos=True)
            if reply is not None:
                conversation.add_reply(reply)
        whole = renderer.encode(renderer.render(conversation.messages, generation_prompt=False))
    except NotIncremental as e:
        raise TemplateError(f"the chat template of {name} cannot be rendered turn by turn: {e}") from None
    except TemplateError:
        raise
    except Exception as e:  # the template itself raised (e.g. on a role it does not know)
        raise TemplateError(
            f"the chat template of {name} fails on a conversation with {', '.join(dict.fromkeys(replies))} replies: {type(e).__name__}: {e}"
        ) from None
    got = conversation.prompt_ids + conversation.ids
    if whole[: len(got)] != got:  # the last turn's closing is not part of the trajectory
        i = next((i for i, (a, b) in enumerate(zip(got, whole)) if a != b), min(len(got), len(whole)))
        raise TemplateError(
            f"the chat template of {name} cannot be rendered turn by turn: the tokens of the turn-by-turn rendering differ from the whole conversation's at token {i} ({tokenizer.decode(whole[max(0, i - 3) : i + 3])!r})"
        )


PROBE_EDGES = " It is 42.\n"  # a model turn may start and end with whitespace


def _check_keeps_whitespace(renderer: Renderer) -> None:
    """A model turn is rendered as its text, whitespace at its edges included (Llama 3 and
    Gemma templates `| trim` every message: turns ending in a newline would fail)."""
    start = [{"role": "user", "content": "What is 12 + 30?"}]
    before = renderer.render(start, generation_prompt=True)
    closed = renderer.render([*start, {"role": "assistant", "content": PROBE_EDGES}], generation_prompt=False)
    if closed.startswith(before + PROBE_EDGES):
        return
    trims = PROBE_EDGES.strip() in closed[len(before) :] if closed.startswith(before) else False
    how = "trims the whitespace at the edges of an assistant turn (e.g. `| trim`)" if trims else "changes an assistant turn's text"
    raise TemplateError(
        f"the chat template of {renderer.name} {how}, so a model turn that starts or ends with whitespace could not be kept token for token; set environment.chat_template to a template that renders message contents as they are"
    )


def _check_tools_listed(renderer: Renderer) -> None:
    if not renderer.tools:
        return
    user = [{"role": "user", "content": "x"}]
    without = Renderer(renderer.tokenizer, None, renderer.template)
    if renderer.render(user, True) == without.render(user, True):
        raise TemplateError(
            f"the chat template of {renderer.name} ignores tools= (it renders the same text with and without them), so the model would never see its tools; set environment.chat_template to a template that lists them (e.g. chatml-hermes)"
        )
