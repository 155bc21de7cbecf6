"""The multi-turn rollout: model turns from the engine, replies from the environments.

`MultiTurnRollout.generate(prompts, params, n, version, prompt_offset)` has an engine's
call shape (the producer and the evaluator call it as they call `engine.generate`) and
returns one `Completion` per trajectory, n per prompt, each with its `Trajectory`.

One call = P prompts x n trajectories, all made together through one turn stream of the
engine (`engine.open_turns`) and the environment pool (held for the call), by the event
loop of scheduler.py (`environment.scheduling`: per trajectory, or in rounds):
1. reset: a session per trajectory in the environment workers, seeded per prompt
   (`derive_seed(batch seed, prompt index)`: the n trajectories of a prompt start alike);
   its messages (or the prompt's own) rendered with the tools: the trajectory's prompt ids;
2. turn k: one `TurnRequest`: its ids so far, its own seed (`derive_seed(batch seed,
   version, trajectory index, k)`: its draws depend on nothing else), its own budget,
   min(rollout.max_new_tokens, max_total_tokens - its length), and its key (the
   trajectory's index: the engine keeps its KV cache, a server router its server);
3. a turn that ended on EOS (or a stop string) goes to its environment; the reply
   becomes an environment segment (rendering.py);
4. a trajectory ends when its environment says done ('stop'), a turn is cut at its budget
   or the reply would leave no room ('length'), after max_turns turns ('max_turns'), or when
   its environment or the rendering fails ('error': unscored, counted);
5. finish: its environment's closing reward terms; the session ends.
Reward terms add up over a trajectory (steps and finish); each metric is the mean of the
values its steps and finish reported (a per-turn fraction stays a fraction).
Weights change only between batches, so every turn of a trajectory has the same version
(recorded per turn anyway; the completion's version is the oldest). `last_metrics` holds
what the call's loop and stream measured (`multiturn/*`, `rollout/server*`).
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from leangrpo.contracts import (
    Completion,
    FinishReason,
    Prompt,
    SamplingParams,
    Trajectory,
    TurnEngine,
    TurnRequest,
)
from leangrpo.environments.pool import EnvironmentPool, Outcome
from leangrpo.environments.rendering import Conversation, NotIncremental, Renderer
from leangrpo.environments.scheduler import Mode, Scheduler
from leangrpo.seeding import SEED_BITS, derive_seed

if TYPE_CHECKING:
    from torch import Tensor

log = logging.getLogger("leangrpo.environments")


@dataclass(frozen=True)
class TurnLimits:
    max_turns: int
    max_total_tokens: int


@dataclass
class _Live:
    """One trajectory being made."""

    index: int  # in the generation batch: (prompt index) x n + sample
    prompt: Prompt
    session: int
    conversation: Conversation | None = None
    logprobs: list[float] = field(default_factory=list)
    routes: list[Tensor] = field(default_factory=list)  # each model turn's route record (MoE)
    versions: list[int] = field(default_factory=list)
    text: str = ""  # the last model turn's text, as the engine decoded it
    calls: list[dict] = field(default_factory=list)
    rewards: Counter = field(default_factory=Counter)
    metric_sums: Counter = field(default_factory=Counter)  # the environment's metrics, over
    metric_reports: Counter = field(default_factory=Counter)  # its reports: a mean each
    stats: Counter = field(default_factory=Counter)
    finish: FinishReason | None = None
    error: str | None = None
    session_open: bool = True

    def end(self, finish: FinishReason, error: str | None = None) -> None:
        self.finish, self.error = finish, error

    def report(self, metrics: dict[str, float]) -> None:
        """One step's (or the finish's) metrics: each is the mean of its reports."""
        self.metric_sums.update(metrics)
        self.metric_reports.update(metrics.keys())

    def metrics(self) -> dict[str, float]:
        return {k: self.metric_sums[k] / self.metric_reports[k] for k in self.metric_reports}


class MultiTurnRollout:
    """An engine's `generate`, made of turns: see the module docstring."""

    def __init__(
        self,
        engine: TurnEngine,
        pool: EnvironmentPool,
        renderer: Renderer,
        limits: TurnLimits,
        eos_ids: set[int],
        scheduling: Mode = "per_trajectory",
    ):
        self.engine = engine
        self.pool = pool
        self.renderer = renderer
        self.limits = limits
        self.eos_ids = set(eos_ids)
        self.scheduling = scheduling
        self.last_metrics: dict[str, float] = {}  # the last call's loop and engine figures
        self._logged: set[str] = set()  # kinds of failure logged once already

    @property
    def version(self) -> int:
        return self.engine.version

    def generate(
        self,
        prompts: list[Prompt],
        params: SamplingParams,
        n: int,
        version: int,
        prompt_offset: int = 0,
    ) -> list[list[Completion]]:
        seed = params.seed if params.seed is not None else secrets.randbits(SEED_BITS)
        for prompt in prompts:
            if prompt.messages is None:
                raise ValueError(
                    f"prompt uid={prompt.uid} has no chat messages; multi-turn needs data.chat_template: true"
                )
        sessions = self.pool.new_sessions(len(prompts) * n)
        live = [
            _Live((prompt_offset + p) * n + g, prompt, sessions[p * n + g])
            for p, prompt in enumerate(prompts)
            for g in range(n)
        ]
        call = _Call(self, live, params, version, seed, n)
        with self.pool.exclusive(), self.engine.open_turns(params, version) as stream:
            stats = Scheduler(stream, self.pool, self.scheduling, call).run()
            self.last_metrics = _call_metrics(stats.metrics(), stream.metrics())
        self._log_failures(live)
        completions = [self._completion(t, version) for t in live]
        return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]

    # -- one trajectory's steps (scheduler.py calls them through _Call) --------------------
    def _start(self, t: _Live, outcome: Outcome) -> None:
        if outcome.error is not None:
            t.session_open = False
            t.end("error", f"reset failed: {outcome.error}")
            return
        messages = outcome.ok["messages"]
        if messages is None:  # the prompt's own (the data's): rendered as they are
            start = t.prompt.messages
        else:  # the environment's: its control tokens neutralised, as in replies
            start, stripped = self.renderer.sanitised(messages)
            t.stats["control_tokens_stripped"] += stripped
        try:
            t.conversation = self.renderer.start(start)
        except Exception as e:  # the template cannot render the environment's start
            t.end("error", f"rendering failed: the chat template cannot render the reset messages: {e}")
            return
        if t.conversation.num_tokens >= self.limits.max_total_tokens:
            t.end("error", f"prompt too long: it has {t.conversation.num_tokens} tokens, no room for a turn within environment.max_total_tokens = {self.limits.max_total_tokens}")  # fmt: skip

    def _request(self, t: _Live, params: SamplingParams, version: int, seed: int) -> TurnRequest:
        total = self.limits.max_total_tokens
        return TurnRequest(
            t.conversation.prompt_ids + t.conversation.ids,
            derive_seed(seed, version, t.index, len(t.versions)),
            min(params.max_new_tokens, total - t.conversation.num_tokens),
        )

    def _model_turn(self, t: _Live, c: Completion) -> str | None:
        """The turn's content when it goes to the environment; None when the trajectory ended."""
        t.versions.append(c.version)
        t.logprobs.extend(c.logprobs)
        if c.routes is not None:  # routing replay: aligned with the log-probs, turn by turn
            t.routes.append(c.routes)
        t.text = c.text
        t.stats["turns"] += 1
        stopped_on_eos = c.finish_reason == "stop" and c.ids[-1] in self.eos_ids
        content = t.conversation.add_model_turn(c.ids, stopped_on_eos)
        if c.finish_reason == "stop":
            return content
        if c.finish_reason == "length":  # cut at its budget: nothing to answer
            t.end("length")
        else:
            t.end("error", f"generation failed: the engine ended the turn with finish reason {c.finish_reason!r}")  # fmt: skip
        return None

    def _environment_turn(self, t: _Live, outcome: Outcome) -> None:
        if outcome.error is not None:
            t.session_open = False
            t.end("error", f"step failed: {outcome.error}")
            return
        ok = outcome.ok
        t.rewards.update(ok["rewards"])
        t.report(ok["metrics"])
        t.stats.update(ok["counts"])
        t.stats["env_s"] += ok["seconds"]
        t.calls.extend(ok["calls"])
        if ok["done"]:
            t.end("stop")
        elif len(t.versions) == self.limits.max_turns:
            t.end("max_turns")
        else:
            self._reply(t, ok["reply"])

    def _reply(self, t: _Live, reply: list[dict]) -> None:
        reply, stripped = self.renderer.sanitised(reply)
        t.stats["control_tokens_stripped"] += stripped
        room = self.limits.max_total_tokens - t.conversation.num_tokens
        try:
            added = t.conversation.add_reply(reply, room)
        except NotIncremental as e:
            t.end("error", f"rendering failed: the chat template cannot be rendered turn by turn: {e}")
            return
        except Exception as e:  # the template itself refused the reply (a role it lacks)
            t.end("error", f"rendering failed: the chat template cannot render the reply: {type(e).__name__}: {e}")
            return
        if added is None:  # the reply leaves no room for another turn
            t.conversation.messages.extend(reply)  # the conversation as the environment saw it
            t.end("length")

    def _finished(self, t: _Live, outcome: Outcome) -> None:
        if t.finish is None:
            t.end("max_turns")
        if outcome.error is not None:
            t.end("error", f"finish failed: {outcome.error}")
            return
        t.rewards.update(outcome.ok["rewards"])
        t.report(outcome.ok["metrics"])
        t.stats["env_s"] += outcome.ok["seconds"]

    def _log_failures(self, live: list[_Live]) -> None:
        """The first failure of each kind (reset, step, finish, rendering) is logged with its
        message; the rest are counted (multiturn/env_errors)."""
        for t in live:
            if t.error is None:
                continue
            kind = t.error.split(":", 1)[0]
            if kind not in self._logged:
                self._logged.add(kind)
                log.warning(
                    "a trajectory ended with an error: %s (later ones of this kind are only counted in multiturn/env_errors)",
                    t.error,
                )

    def _completion(self, t: _Live, version: int) -> Completion:
        conversation = t.conversation
        messages = conversation.messages if conversation else list(t.prompt.messages or [])
        segments = conversation.segments if conversation else []
        model_tokens = sum(n for n, is_model in segments if is_model)
        t.stats["model_tokens"] = model_tokens
        t.stats["env_tokens"] = sum(n for n, _ in segments) - model_tokens
        trajectory = Trajectory(
            segments=list(segments),
            turn_versions=list(t.versions),
            messages=messages,
            tool_calls=t.calls,
            rewards=dict(t.rewards),
            metrics=t.metrics(),
            stats={k: float(v) for k, v in t.stats.items()},
            error=t.error,
        )
        if conversation is not None:  # the sample's prompt: what the trajectory starts from
            p = t.prompt
            start = conversation.messages[: conversation.start_messages]
            trajectory.start = Prompt(p.uid, conversation.start_text, list(conversation.prompt_ids), p.columns, start)
        return Completion(
            ids=list(conversation.ids) if conversation else [],
            text=t.text,
            logprobs=t.logprobs,
            finish_reason=t.finish or "error",
            version=min(t.versions, default=version),
            trajectory=trajectory,
            routes=_joined_routes(t.routes, len(t.versions)),
        )


def _joined_routes(records: list[Tensor], turns: int) -> Tensor | None:
    """A trajectory's route record: its model turns' records in order (None when its engine
    reports none; a trajectory without a turn has no model token to route)."""
    if not records or len(records) != turns:
        return None
    import torch

    return torch.cat(records)


class _Call:
    """The trajectories of one generation call, as scheduler.py's `Trajectories`."""

    def __init__(self, rollout: MultiTurnRollout, live: list[_Live], params, version, seed, n):
        self.rollout, self.live = rollout, live
        self.params, self.version, self.seed, self.n = params, version, seed, n
        self.content: dict[int, str] = {}  # the last turn's text, for its environment step

    def count(self) -> int:
        return len(self.live)

    def reset_item(self, t: int) -> tuple:
        trajectory = self.live[t]
        prompt_index = trajectory.index // self.n
        messages, row = trajectory.prompt.messages, dict(trajectory.prompt.columns)
        return (trajectory.session, messages, row, derive_seed(self.seed, prompt_index))

    def on_reset(self, t: int, outcome: Outcome) -> str:
        self.rollout._start(self.live[t], outcome)
        return self._then(t, "turn")

    def turn_request(self, t: int) -> TurnRequest:
        request = self.rollout._request(self.live[t], self.params, self.version, self.seed)
        return replace(request, key=t)

    def on_turn(self, t: int, completion: Completion) -> str:
        content = self.rollout._model_turn(self.live[t], completion)
        if content is not None:
            self.content[t] = content
        return self._then(t, "step")

    def step_item(self, t: int) -> tuple:
        trajectory = self.live[t]
        return (trajectory.session, self.content.pop(t), len(trajectory.versions) - 1)

    def on_step(self, t: int, outcome: Outcome) -> str:
        self.rollout._environment_turn(self.live[t], outcome)
        return self._then(t, "turn")

    def finish_item(self, t: int) -> tuple | None:
        trajectory = self.live[t]
        if not trajectory.session_open:
            return None
        return (trajectory.session, trajectory.finish or "max_turns")

    def on_finish(self, t: int, outcome: Outcome) -> None:
        self.rollout._finished(self.live[t], outcome)

    def _then(self, t: int, going_on: str) -> str:
        """`going_on` while the trajectory goes on, else its finish (or nothing to end)."""
        trajectory = self.live[t]
        if trajectory.finish is None:
            return going_on
        return "finish" if trajectory.session_open else "done"


def _call_metrics(loop: dict[str, float], stream: dict[str, float]) -> dict[str, float]:
    """The call's figures under their metric names: the loop's and the engine's under
    multiturn/, the servers' under rollout/."""
    out = {f"multiturn/{k}": v for k, v in loop.items()}
    for key, value in stream.items():
        out[f"rollout/{key}" if key.startswith("server") else f"multiturn/{key}"] = value
    return out
