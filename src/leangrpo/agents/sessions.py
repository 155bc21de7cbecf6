"""Sessions: one agent episode's requests, recorded token for token as trajectory segments.

A session (one episode, named by its key) holds segments; each segment is one
`rendering.Conversation`, the same record environments' trajectories are made of. A chat
request is planned against the session's last segment (`Session.plan_chat`):

- it *extends* the segment when its messages start with the messages the segment has seen
  (the start messages, each assistant message as the endpoint returned it, the client's
  messages in between), compared by `openai_api.view_key` (a tool call re-sent with other
  spacing or key order is the same call), with the same tools, and it has new messages
  after them: the assistant turns stay the engine's ids (never re-rendered from what the
  client sent), and only the new messages are rendered, as an environment's reply (the
  difference of two renderings, control tokens removed);
- otherwise it starts a new segment from all its messages (the agent edited, summarised or
  dropped history, changed its tools, or the template cannot add the messages turn by
  turn), counted as a prefix break. Every segment is trained as a sample of its own.

Turn k of a session is sampled with `derive_seed(seed, version, index, k)`, the seed the
native multi-turn rollout gives turn k of trajectory `index` (driver.py), so an agent that
holds the same conversation as an environment gets the same trajectory, token for token.
Planning changes nothing: `Session.commit` records the engine's turn once it is back (a
refused or failed request leaves the session as it was). `Session.completions()` gives one
`Completion` (with its `Trajectory`) per segment that has a model turn.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from leangrpo.agents.openai_api import (
    Refused,
    RequestLimits,
    template_messages,
    tools_key,
    view_key,
)
from leangrpo.contracts import Completion, Prompt, Trajectory, TurnRequest
from leangrpo.environments.rendering import Conversation, NotIncremental, Renderer
from leangrpo.seeding import derive_seed

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class SessionLimits:
    max_total_tokens: int  # of one segment: its prompt and every turn
    max_requests: int
    max_episode_tokens: int  # model tokens over the whole session


@dataclass
class Segment:
    """One trajectory of an episode: a conversation and the model turns in it."""

    key: int  # the turn stream's key (its kept KV cache, its server)
    tools: str  # the request's tools, as compared
    conversation: Conversation
    view: list[str]  # view_key of every message the client has seen, in order
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routes: list[Tensor] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)
    finish: str = "stop"
    text: str = ""  # the last turn's text

    def copy_conversation(self) -> Conversation:
        """The conversation to plan on (the segment's own stays as it is until a commit)."""
        c = self.conversation
        return Conversation(
            c.renderer, [dict(m) for m in c.messages], c.text, list(c.prompt_ids),
            c.start_messages, c.start_text, list(c.ids), list(c.segments), c._closing,
        )  # fmt: skip


@dataclass
class Plan:
    """A planned turn: the conversation it is generated from (not yet the session's)."""

    segment: Segment | None  # the segment it extends; None: a new one
    conversation: Conversation
    tools: str
    view: list[str]
    request: TurnRequest
    limits: RequestLimits
    added: int  # tokens rendered for the request (the prompt, or the new messages)


class Session:
    """See the module docstring. One request at a time (the endpoint holds its lock)."""

    def __init__(self, key: str, prompt: Prompt | None, seed: int, version: int, index: int,
                 limits: SessionLimits, new_key):  # fmt: skip
        self.key, self.prompt = key, prompt
        self.seed, self.version, self.index = seed, version, index
        self.limits = limits
        self._new_key = new_key  # () -> a fresh turn-stream key
        self.segments: list[Segment] = []
        self.stats: Counter[str] = Counter()
        self.turns = 0  # model turns so far (the next turn's seed index)
        self.model_tokens = 0
        self.closed = False

    # -- planning ---------------------------------------------------------------------------
    def check_budget(self) -> None:
        if self.closed:
            raise Refused("this session has ended", code="session_ended", status=404)
        if self.stats["requests"] > self.limits.max_requests:  # this request counted already
            raise Refused(f"this episode made its {self.limits.max_requests} requests (agent.max_requests)", code="session_limit")
        if self.model_tokens >= self.limits.max_episode_tokens:
            raise Refused(f"this episode generated its {self.limits.max_episode_tokens} tokens (agent.max_episode_tokens)", code="session_limit")

    def plan_chat(self, messages: list[dict], tools: Any, renderer: Renderer, limits: RequestLimits) -> Plan:
        """The turn a chat request asks for (messages as template_messages made them)."""
        self.check_budget()
        key = tools_key(tools)
        view = [view_key(m) for m in messages]
        last = self.segments[-1] if self.segments else None
        if last is not None and _extends(last, key, view):
            conversation = last.copy_conversation()
            clean, stripped = renderer.sanitised(messages[len(last.view) :])
            room = self.limits.max_total_tokens - conversation.num_tokens
            try:
                added = conversation.add_reply(clean, room)
            except NotIncremental:  # the template cannot add them turn by turn: a new segment
                self.stats["render_breaks"] += 1
            except Exception as e:  # the template refuses them (a role it lacks)
                raise Refused(f"the chat template cannot render the new messages: {type(e).__name__}: {e}", "messages") from None
            else:
                if added is None:
                    raise _too_long(conversation.num_tokens, self.limits.max_total_tokens)
                self.stats["control_tokens_stripped"] += stripped
                return self._plan(last, conversation, key, view, limits, len(added))
        clean, stripped = renderer.sanitised(messages)
        try:
            conversation = renderer.start(clean)
        except Exception as e:  # the template refuses these messages (a role it lacks)
            raise Refused(f"the chat template cannot render these messages: {type(e).__name__}: {e}", "messages") from None
        if conversation.num_tokens >= self.limits.max_total_tokens:
            raise _too_long(conversation.num_tokens, self.limits.max_total_tokens)
        self.stats["control_tokens_stripped"] += stripped
        return self._plan(None, conversation, key, view, limits, conversation.num_tokens)

    def plan_tokens(self, prompt: str | list[int], renderer: Renderer, limits: RequestLimits) -> Plan:
        """The turn a completions request asks for: a prompt (text or token ids) that
        starts with the last raw segment's tokens (ids), or its text (text), extends it
        with the rest as context; any other starts a new segment from the prompt."""
        self.check_budget()
        last = self.segments[-1] if self.segments else None
        if last is not None and last.tools == RAW:
            conversation = last.copy_conversation()
            so_far = conversation.prompt_ids + conversation.ids
            rest: list[int] | None = None
            if isinstance(prompt, list) and len(prompt) > len(so_far) and prompt[: len(so_far)] == so_far:
                rest = prompt[len(so_far) :]
            elif isinstance(prompt, str):
                text = renderer.tokenizer.decode(so_far, skip_special_tokens=False)
                if len(prompt) > len(text) and prompt.startswith(text):
                    rest = renderer.encode(prompt[len(text) :])
            if rest:
                if conversation.num_tokens + len(rest) >= self.limits.max_total_tokens:
                    raise _too_long(conversation.num_tokens + len(rest), self.limits.max_total_tokens)
                conversation.ids.extend(rest)
                conversation.segments.append((len(rest), False))
                return self._plan(last, conversation, RAW, [], limits, len(rest))
        ids = prompt if isinstance(prompt, list) else renderer.encode(prompt)
        text = renderer.tokenizer.decode(ids, skip_special_tokens=False)
        conversation = Conversation(renderer, [], text, list(ids), 0, text)
        if len(ids) >= self.limits.max_total_tokens:
            raise _too_long(len(ids), self.limits.max_total_tokens)
        return self._plan(None, conversation, RAW, [], limits, len(ids))

    def _plan(self, segment, conversation, key, view, limits: RequestLimits, added: int) -> Plan:
        room = self.limits.max_total_tokens - conversation.num_tokens
        budget = min(limits.max_new_tokens, room, self.limits.max_episode_tokens - self.model_tokens)
        stream_key = segment.key if segment is not None else self._new_key()
        seed = derive_seed(self.seed, self.version, self.index, self.turns)
        request = TurnRequest(conversation.prompt_ids + conversation.ids, seed, budget, stream_key)
        return Plan(segment, conversation, key, view, request, limits, added)

    # -- recording --------------------------------------------------------------------------
    def commit(self, plan: Plan, completion: Completion, eos_ids: set[int]) -> tuple[Segment, str, str]:
        """Record the engine's turn; (its segment, its text for the client, finish reason).
        A session ended meanwhile (its episode's reply came back) records nothing: refused."""
        if self.closed:
            raise Refused("this session ended while its turn was generated; the turn is not recorded",
                          code="session_ended", status=404)  # fmt: skip
        ids, logprobs, finish, shown = _cut(completion, plan.limits.stop, plan.conversation.renderer)
        stopped_on_eos = finish == "stop" and ids[-1] in eos_ids
        text = plan.conversation.add_model_turn(ids, stopped_on_eos)
        segment = plan.segment
        if segment is None:
            if self.segments:
                self.stats["prefix_breaks"] += 1
            segment = Segment(plan.request.key, plan.tools, plan.conversation, [])
            self.segments.append(segment)
        segment.conversation = plan.conversation
        segment.logprobs.extend(logprobs)
        segment.versions.append(completion.version)
        if completion.routes is not None:
            segment.routes.append(completion.routes[: len(ids)])
        segment.finish, segment.text = finish, text
        self.turns += 1
        self.model_tokens += len(ids)
        self.stats["turns"] += 1
        return segment, text if shown is None else shown, finish

    def record_view(self, segment: Segment, plan: Plan, message: dict) -> None:
        """What the client has seen now: its messages and the assistant message returned."""
        segment.view = [*plan.view, view_key(template_messages([message])[0])]
        if message.get("tool_calls"):
            segment.calls.extend(
                {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                for c in message["tool_calls"]
            )

    # -- the episode's samples --------------------------------------------------------------
    def completions(self) -> list[Completion]:
        """One completion per segment with a model turn, in order (see contracts.Trajectory)."""
        out = []
        for s in self.segments:
            c = s.conversation
            p = self.prompt
            start = Prompt(p.uid if p else 0, c.start_text, list(c.prompt_ids), dict(p.columns) if p else {},
                           c.messages[: c.start_messages])  # fmt: skip
            model = sum(n for n, is_model in c.segments if is_model)
            trajectory = Trajectory(
                segments=list(c.segments),
                turn_versions=list(s.versions),
                messages=[dict(m) for m in c.messages],
                tool_calls=list(s.calls),
                stats={"turns": float(len(s.versions)), "model_tokens": float(model),
                       "env_tokens": float(len(c.ids) - model)},  # fmt: skip
                start=start,
            )
            routes = None
            if s.routes and len(s.routes) == len(s.versions):
                import torch

                routes = torch.cat(s.routes)
            out.append(Completion(list(c.ids), s.text, list(s.logprobs), s.finish, min(s.versions),
                                  trajectory, routes))  # fmt: skip
        return out


RAW = "<token ids>"  # the tools key of a segment made by completions requests


def _extends(segment: Segment, tools: str, view: list[str]) -> bool:
    n = len(segment.view)
    return segment.tools == tools and len(view) > n and view[:n] == segment.view


def _too_long(tokens: int, limit: int) -> Refused:
    return Refused(
        f"the conversation has {tokens} tokens, which leaves no room for a turn within agent.max_total_tokens = {limit}",
        "messages",
        "context_length_exceeded",
    )


def _cut(completion: Completion, stops: tuple[str, ...], renderer: Renderer):
    """The turn up to the request's first stop string (kept in the ids, as the engines keep
    theirs): (ids, log-probs, finish reason, the text the client gets or None for the
    turn's own). The shortest prefix whose text holds a stop is found by bisection (a
    longer prefix's text holds what a shorter one's does): O(log n) decodes, not n."""
    ids, logprobs, finish = list(completion.ids), list(completion.logprobs), completion.finish_reason
    decode = renderer.tokenizer.decode

    def first_stop(n: int) -> tuple[str, int | None]:
        text = decode(ids[:n], skip_special_tokens=True)
        hits = [text.find(s) for s in stops if s in text]
        return text, min(hits) if hits else None

    if not stops or not ids or first_stop(len(ids))[1] is None:
        return ids, logprobs, finish, None
    lo, hi = 1, len(ids)  # the prefix of hi tokens holds a stop; find the fewest that does
    while lo < hi:
        mid = (lo + hi) // 2
        if first_stop(mid)[1] is None:
            lo = mid + 1
        else:
            hi = mid
    text, at = first_stop(hi)
    return ids[:hi], logprobs[:hi], "stop", text[:at]
