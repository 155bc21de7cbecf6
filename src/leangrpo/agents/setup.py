"""What a run with an agent builds at its set-up, before the model loads.

`start_agents(cfg, tokenizer)` (None without an `agent` section) starts the endpoint on
loopback and on a unix socket in a private temporary folder (what each episode's box
reaches, forwarded), checks the chat template (it must render turn by turn), and starts
the agent workers (each imports the agent: a failure there is one `AgentError` line).
The result is a `contracts.MultiTurn`, as environments' `Environments`: the trainer loads
the prompts as their first turn renders them, and `rollout(engine)` is an `AgentRollout`
over an engine (the producer's, the evaluator's: their calls take turns on the endpoint).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leangrpo.agents.endpoint import AgentEndpoint
from leangrpo.agents.episodes import AgentRollout, AgentWorkers
from leangrpo.contracts import Prompt, TurnEngine
from leangrpo.data.templates import conversation_template
from leangrpo.environments.setup import generation_eos_ids

log = logging.getLogger("leangrpo.agents")


@dataclass
class Agents:
    endpoint: AgentEndpoint
    workers: AgentWorkers
    folder: Path  # holds the endpoint's unix socket
    functions: bool = True  # rewards.functions configured (they score what agents leave unscored)

    def first_turn(self, messages: list[dict]) -> str:
        return self.endpoint.renderer(None).first_turn(messages)

    def probe(self, prompt: Prompt) -> None:
        """Nothing to probe before the model loads: the workers imported the agent."""

    def rollout(self, engine: Any) -> AgentRollout:
        if not isinstance(engine, TurnEngine):
            raise TypeError(f"{type(engine).__name__} cannot generate turns: agents need the hf or vllm engine")
        return AgentRollout(self.endpoint, self.workers, engine, self.functions)

    def close(self) -> None:
        self.workers.close()
        self.endpoint.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def start_agents(cfg: Any, tokenizer: Any, port: int = 0) -> Agents | None:
    """See the module docstring; `port`: the endpoint's loopback port (0: a free one)."""
    agent_cfg = cfg.agent
    if agent_cfg is None:
        return None
    folder = Path(tempfile.mkdtemp(prefix="leangrpo-agent-"))
    endpoint = AgentEndpoint(tokenizer, agent_cfg, conversation_template(cfg), generation_eos_ids(cfg, tokenizer))
    try:
        endpoint.start(port, unix_socket=str(folder / "endpoint.sock"))
        workers = AgentWorkers(agent_cfg, endpoint.unix_socket)
    except BaseException:
        endpoint.close()
        shutil.rmtree(folder, ignore_errors=True)
        raise
    log.info("agent %s: %d workers, the endpoint at %s", agent_cfg.entry or agent_cfg.command,
             agent_cfg.num_workers, endpoint.base_url)  # fmt: skip
    return Agents(endpoint, workers, folder, bool(cfg.rewards.functions))
