"""The config section of agents trained through the OpenAI-compatible endpoint: `agent`.

An agent (agents/) is any program written against the OpenAI client; the endpoint serves
it from the run's rollout engine on loopback and records each of its sessions token for
token. This section holds what the endpoint needs: how conversations are rendered
(template, tool-call parser) and the limits of one session.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from leangrpo.config.base import ONE_DAY_S, Section
from leangrpo.config.io import rule_error
from leangrpo.config.sandbox import SandboxConfig


class AgentConfig(Section):
    """Agents written against the OpenAI client, trained through the endpoint."""

    entry: str | None = Field(
        None,
        description="The agent: 'path/to/file.py:run' or 'pkg.module:run', a function run(client, task) (sync, or async: then client is an openai.AsyncOpenAI) called once per episode in a box of its own, with `client` pointed at the episode's session and `task` the prompt's messages and data columns; it returns the reward (a number), reward terms (a dict of numbers) or None.",
    )
    command: str | None = Field(
        None,
        description="The agent as any program: a shell command run once per episode in a box of its own, with OPENAI_BASE_URL and OPENAI_API_KEY set to the episode's session and the task as JSON on stdin; its last printed line is its reward (a number, a JSON object of numbers, or null).",
    )
    num_workers: int = Field(2, ge=1, le=256, description="Worker processes running episodes (the episodes that run at once).")
    timeout_s: float = Field(
        300.0,
        gt=0,
        le=ONE_DAY_S,
        description="Wall-clock seconds one episode may take; an agent still running then is killed with its processes, its episode unscored and counted in agent/errors/timeout.",
    )
    startup_timeout_s: float = Field(60.0, gt=0, le=3600, description="Seconds a worker may take to import the agent.")
    memory_limit_mb: int | None = Field(
        8192,
        ge=256,
        description="Memory of each episode's box (a memory cgroup where the trainer has one, else the address-space limit of each process). null = none.",
    )
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig,
        description="How the agent workers are confined; an episode reaches the endpoint (forwarded into its box) and nothing else unless sandbox.allow_network.",
    )

    chat_template: str | None = Field(
        None,
        description="Chat template agents' conversations are rendered with: null = data.chat_template's when it names one, else the tokenizer's; 'chatml-hermes' (bundled); or a path to a .jinja file. It must render turn by turn (checked at start-up, as environment.chat_template).",
    )
    tool_parser: Literal["hermes"] = Field(
        "hermes",
        description="How tool calls are read from the model's turn for `choices[0].message.tool_calls`: 'hermes' (JSON in <tool_call></tool_call> tags). The token ids trained on never depend on it.",
    )
    model_name: str = Field(
        "policy",
        min_length=1,
        description="The model name GET /v1/models lists; requests may name any model (the policy answers every one).",
    )
    max_total_tokens: int = Field(
        1024,
        ge=2,
        description="Most tokens of one segment of an episode (the conversation the model sees, its turns included); a request that would leave no room for a turn is refused with 400 (code context_length_exceeded).",
    )
    max_requests: int = Field(
        32,
        ge=1,
        description="Requests one episode (session) may make; later ones are refused with 400 (code session_limit) and counted in agent/refused.",
    )
    max_episode_tokens: int = Field(
        16384,
        ge=1,
        description="Model tokens one episode may generate over all its requests; a request once they are spent is refused with 400 (code session_limit).",
    )

    @model_validator(mode="after")
    def _one_agent(self) -> AgentConfig:
        if self.entry is not None and self.command is not None:
            raise rule_error(
                "agent.entry and agent.command both name the agent; keep one (entry: a Python function run(client, task); command: any program)."
            )
        return self
