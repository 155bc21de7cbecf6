"""What an environment is: the class a user writes, and the built-in tool environment.

An `Environment` runs one trajectory (one instance per trajectory, built with
`environment.kwargs`) inside an environment worker process, never in the trainer:

    reset(messages, row, seed) -> messages | None   the conversation to start from (None:
                                                    the prompt's own messages)
    step(turn) -> StepResult                        the reply to one model turn
    finish(finish_reason) -> StepResult             at the end (rewards, metrics only)

`row` holds the prompt's data columns; `seed` is the same for the G trajectories of a
prompt (a function of the run seed, the batch and the prompt), so an environment that
draws its start from it gives a group one prompt and a resume the same one again.
`StepResult.rewards` are summed over the trajectory and added to its total reward (logged
per name as `reward/env/<name>/mean`); `StepResult.metrics` are only logged: each is the
mean of the values the trajectory's steps and finish reported for it (a step that leaves
it out does not count), then the mean over trajectories (`multiturn/env/<name>`). `tools`
(Python functions with type hints and docstrings, plus `environment.tools`) are offered
to the model through the chat template; `run_tools(turn)` answers a turn's calls with one
tool message each (an error message for a failed call, counted, never a crash).
`replies` names the roles of the messages `step` replies with, so the start-up check
renders those (a template may render a tool turn incrementally but not a user turn).
`reward_terms` names the reward terms `step` and `finish` may return (None: not said); a
run whose rewards could only ever be 0 (no reward function with a weight, an environment
that gives no reward terms) is refused at start-up, and a term an environment returns
without declaring it fails the call. `ToolEnvironment` gives none (`environment_rewards`).

`ToolEnvironment` (environment.name 'tools') answers every turn that calls a tool with the
tools' results and ends the trajectory at the first turn without a call (the answer).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from leangrpo.environments.tools import ParsedTurn, ToolCall, tool_messages


@dataclass
class ModelTurn:
    """One turn of the model, as the environment sees it."""

    text: str  # the raw text of the turn (tool-call tags included, the EOS left out)
    calls: list[ToolCall]  # the tool calls environment.tool_parser read in it
    parse_errors: list[str]  # blocks that looked like calls but did not parse
    content: str  # the text outside the tool calls
    index: int  # 0 for the first turn


@dataclass
class StepResult:
    reply: list[dict[str, Any]] = field(default_factory=list)  # messages after the turn
    done: bool = False
    rewards: dict[str, float] = field(default_factory=dict)  # summed into the total reward
    metrics: dict[str, float] = field(default_factory=dict)  # logged: a mean per trajectory


class Environment:
    """Base class of environments; see the module docstring. Subclasses implement `step`."""

    tools: ClassVar[list[Callable]] = []
    replies: ClassVar[tuple[str, ...]] = ("user",)
    reward_terms: ClassVar[tuple[str, ...] | None] = None  # the names step/finish may return
    max_tool_calls: ClassVar[int] = 16  # per turn (pool.py budgets an answer's time by it)

    def reset(self, messages: list[dict], row: dict[str, Any], seed: int) -> list[dict] | None:
        return None

    def step(self, turn: ModelTurn) -> StepResult:
        raise NotImplementedError(f"{type(self).__name__} must implement step(turn)")

    def finish(self, finish_reason: str) -> StepResult:
        """The trajectory ended ('stop', 'length', 'max_turns' or 'error')."""
        return StepResult()

    # -- tools --------------------------------------------------------------------------
    def offered_tools(self) -> list[Callable]:
        """The class's tools and the configured ones (the worker adds environment.tools)."""
        return [*type(self).tools, *getattr(self, "configured_tools", [])]

    def run_tools(self, turn: ModelTurn) -> list[dict[str, Any]]:
        """One tool message per call of `turn` (and per parse error), counted."""
        tools = {fn.__name__: fn for fn in self.offered_tools()}
        counts = self.__dict__.setdefault("tool_counts", Counter())
        parsed = ParsedTurn(turn.content, turn.calls, turn.parse_errors)
        max_chars = getattr(self, "max_tool_result_chars", None)  # environment's setting
        return tool_messages(parsed, tools, self.call_tool, counts, self.max_tool_calls, max_chars)

    def call_tool(self, fn: Callable, arguments: dict[str, Any]) -> Any:
        """Run one tool (the worker runs it under environment.tool_timeout_s)."""
        return fn(**arguments)


class ToolEnvironment(Environment):
    """environment.name 'tools': tool results until a turn without a call, the answer."""

    replies = ("tool",)

    def step(self, turn: ModelTurn) -> StepResult:
        if not turn.calls and not turn.parse_errors:
            return StepResult(done=True)
        return StepResult(self.run_tools(turn))


def environment_rewards(cls: type) -> tuple[str, ...] | None:
    """The reward terms an environment class can give: the ones it declares; none when its
    step and finish are leangrpo's own (ToolEnvironment's tool loop gives none); None when
    unknown (it computes its own and does not say which)."""
    if cls.reward_terms is not None:
        return tuple(cls.reward_terms)
    if cls.step is ToolEnvironment.step and cls.finish is Environment.finish:
        return ()
    return None
