"""`leangrpo serve-agent CONFIG`: the policy behind the OpenAI-compatible endpoint, for an
outside agent (evaluation, a look at what the model does), without training.

`serve_agent(cfg, model, port)` loads the model (`model`: a run's final/ or any model
directory; default model.name_or_path), an hf engine with the run's rollout settings, and
serves the endpoint on 127.0.0.1:`port` with the run's sampling settings (a request asking
for others is refused, as in training) and the `agent` section's limits (its defaults
without one). Any API key opens a session of its own on its first request (at most
`OPEN_SESSIONS` kept, the least recently used ended first): an agent that keeps its key for
an episode gets the token-exact continuation a trained agent gets. It serves until SIGINT
or SIGTERM. The hf engine only (vLLM servers serve themselves: `leangrpo serve`).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

log = logging.getLogger("leangrpo.agents")
OPEN_SESSIONS = 1024


def serve_agent(cfg: Any, model: str | None = None, port: int = 8000,
                ready=None) -> None:  # fmt: skip
    """See the module docstring; `ready(base_url)` is called once it serves."""
    import torch
    from transformers import AutoTokenizer

    from leangrpo.agents.endpoint import AgentEndpoint
    from leangrpo.config.agent import AgentConfig
    from leangrpo.data.templates import conversation_template, data_template
    from leangrpo.environments.setup import generation_eos_ids
    from leangrpo.model import load_final
    from leangrpo.rollout.hf.engine import HFEngine

    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    path = model or cfg.model.name_or_path
    tokenizer = AutoTokenizer.from_pretrained(path)  # a run's final/ holds its tokenizer
    policy = load_final(path, device=cfg.run.device)
    engine = HFEngine(policy, tokenizer, device=torch.device(cfg.run.device),
                      max_batch_size=cfg.rollout.max_batch_size, kv_cache_tokens=cfg.rollout.kv_cache_tokens)  # fmt: skip
    agent_cfg = cfg.agent if cfg.agent is not None else AgentConfig()
    template = conversation_template(cfg) if cfg.agent is not None else data_template(cfg.data)
    endpoint = AgentEndpoint(tokenizer, agent_cfg, template, generation_eos_ids(cfg, tokenizer),
                             open_keys=OPEN_SESSIONS)  # fmt: skip
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    base_url = endpoint.start(port)
    try:
        with endpoint.generating(engine, cfg.rollout.sampling_params(), 0):
            log.info("serving %s at %s (any API key: a session of its own)", path, base_url)
            if ready is not None:
                ready(base_url)
            stop.wait()
    finally:
        endpoint.close()
