"""The config section of agents trained through the OpenAI-compatible endpoint: `agent`.

An agent (agents/) is any program written against the OpenAI client; the endpoint serves
it from the run's rollout engine on loopback and records each of its sessions token for
token. This section holds what the endpoint needs: how conversations are rendered
(template, tool-call parser) and the limits of one session.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from leangrpo.config.base import Section


class AgentConfig(Section):
    """Agents written against the OpenAI client, trained through the endpoint."""

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
