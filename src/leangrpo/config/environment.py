"""The config section of multi-turn rollouts: `environment` (absent: single-turn).

An environment (environments/) answers each model turn until it is done or a limit ends
the trajectory; tools are the common case (the built-in `tools` environment). Its rules
across sections (chat templates on, the token budget within the micro-batch and the
context) live on `Config` in root.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from leangrpo.config.base import BY_VALUE, ONE_DAY_S, Section
from leangrpo.config.io import rule_error
from leangrpo.config.sandbox import SandboxConfig


class ToolByValue(Section):
    """A tool passed by value (leangrpo.GRPO's tools=[...] for a function no module can import)."""

    name: str = Field(..., min_length=1, description="The function's name (the tool's name).")
    value: str = Field(..., min_length=1, description=BY_VALUE)


class EnvironmentConfig(Section):
    """Multi-turn rollouts: the environment that answers the model, its tools and limits."""

    name: str = Field(
        "tools",
        min_length=1,
        description="The environment: 'tools' (the built-in one: offers environment.tools and ends at a turn without a call; it gives no reward terms, so rewards.functions must hold one with a weight), 'verifiers' (a classic verifiers MultiTurnEnv / ToolEnv, see kwargs), 'pkg.module:Class' or 'path/to/file.py:Class' (a leangrpo.environments.protocol.Environment subclass, one instance per trajectory); with `value`, the class's own name.",
    )
    value: str | None = Field(None, description=BY_VALUE.replace("function", "class"))
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments the environment is built with (each trajectory's).",
    )
    tools: list[str | ToolByValue] = Field(
        default_factory=list,
        description="Python functions offered to the model as tools, 'pkg.module:function' or 'path/to/file.py:function' (or {name, value}: one passed by value); each needs type hints and a docstring with its arguments (the schema the chat template lists: transformers.utils.get_json_schema's, made by leangrpo.environments.schema), and no two tools (these and the environment class's own) may share a name.",
    )
    tool_parser: str = Field(
        "hermes",
        min_length=1,
        description="How tool calls are read from the model's turn: 'hermes' (JSON in <tool_call></tool_call> tags, Qwen2.5 / Hermes templates), or 'pkg.module:function' / 'path/to/file.py:function' returning (content, calls, errors) for a turn's text.",
    )
    chat_template: str | None = Field(
        None,
        description="Chat template for multi-turn conversations: null = data.chat_template's when it names one, else the tokenizer's; 'chatml-hermes' (bundled: ChatML with Hermes tool calls, for ChatML models such as SmolLM2 whose own template ignores tools); or a path to a .jinja file.",
    )
    scheduling: Literal["per_trajectory", "rounds"] = Field(
        "per_trajectory",
        description="'per_trajectory': a trajectory's next turn is generated as soon as its environment answers, while the others keep decoding (a slow environment step delays only its own trajectory). 'rounds': every live trajectory's turn, then every environment step, in lockstep (batches independent of environment timing; reproducible bit for bit with any batch size).",
    )
    max_turns: int = Field(
        4,
        ge=1,
        description="Model turns per trajectory; a trajectory still going after them ends with finish reason 'max_turns' (masked with loss.mask_truncated_completions, like 'length').",
    )
    max_total_tokens: int = Field(
        1024,
        ge=2,
        description="Most tokens of a trajectory, prompt and every turn included (each turn is at most rollout.max_new_tokens); a trajectory that reaches it ends with finish reason 'length'.",
    )
    num_workers: int = Field(
        2, ge=1, le=256, description="Worker processes running environments and tools."
    )
    timeout_s: float = Field(
        30.0,
        gt=0,
        le=ONE_DAY_S,
        description="Seconds one reset, step or end of an environment may take; one that fails or times out ends its trajectory (finish reason 'error', unscored, counted in multiturn/env_errors).",
    )
    tool_timeout_s: float = Field(
        10.0,
        gt=0,
        le=ONE_DAY_S,
        description="Seconds one tool call may take; a tool that raises or times out becomes an 'error: ...' tool message to the model (counted in multiturn/tool_errors), and the trajectory goes on.",
    )
    startup_timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="Seconds a worker may take to import the environment, its tools and parser.",
    )
    max_tool_result_chars: int = Field(
        8000,
        ge=100,
        le=1 << 22,
        description="Characters of one tool result the model gets (about 2000 tokens by default); a longer result is cut and ends with a line saying so, counted in multiturn/tool_truncated.",
    )
    memory_limit_mb: int | None = Field(
        8192,
        ge=256,
        description="Memory of each trajectory (its box), processes, memfd and tmpfs together: a memory cgroup per box where the trainer (root) has one, else only per process; and the address-space limit (RLIMIT_AS, MiB) of each environment worker and every process it starts; a tool that exceeds it fails with an error message (multiturn/tool_limit/memory). null = none.",
    )
    cpu_time_limit_s: float | None = Field(
        None,
        gt=0,
        le=ONE_DAY_S,
        description="CPU seconds one call may use (RLIMIT_CPU); null = only the time limits.",
    )
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig,
        description="How the environment and tool workers are confined.",
    )

    @field_validator("tools")
    @classmethod
    def _function_names(cls, value: list[str | ToolByValue]) -> list[str | ToolByValue]:
        for name in value:
            if isinstance(name, ToolByValue):
                continue
            target, sep, attr = name.rpartition(":")
            if not sep or not target or not attr.isidentifier():
                raise ValueError(
                    f"{name!r} is not a tool; write 'pkg.module:function' or 'path/to/file.py:function'"
                )
        return value

    @model_validator(mode="after")
    def _tools_for_the_tools_environment(self) -> EnvironmentConfig:
        if self.name == "tools" and self.value is None and not self.tools:
            raise rule_error(
                "environment.name 'tools' offers environment.tools to the model, but none are listed; add at least one, e.g. environment.tools: ['my_tools.py:add']."
            )
        return self
