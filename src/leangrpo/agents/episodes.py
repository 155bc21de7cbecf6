"""Agent episodes, trainer side: workers that run each episode in a box, and the rollout
that makes a generation call's groups of episodes through the endpoint.

`AgentWorkers(cfg.agent, unix_socket)` starts `agent.num_workers` worker processes
(worker.py, in the sandbox `agent.sandbox` asks for) and waits until each is ready
(`agent.startup_timeout_s`; a failure there is one `AgentError` line). `run(episodes)`
hands each episode (`{"id", "key", "task"}`) to a free worker, as many at once as there
are workers, and returns every episode's reply by id. A worker that sends nothing within
agent.timeout_s plus a grace period (its supervisor is stuck), dies, or sends anything
off the protocol is killed with its tree and replaced; its episode fails. An episode's
failure is a reply with an `error`, never an exception.

`AgentRollout(endpoint, workers, engine).generate(prompts, params, n, version,
prompt_offset)` has an engine's call shape (as environments' `MultiTurnRollout`): inside
`endpoint.generating(engine, params, version)`, one session per episode (turn k of
episode `index` seeded as the native rollout seeds it), the n episodes of a prompt its
group; each episode's completion is its session's last segment, its earlier segments in
`trajectory.earlier` (each trained as a sample of its own with the episode's advantage,
pipeline/batch.py), its reward terms the agent's (a number is the term `agent`; None:
rewards.functions alone score it), its error the episode's (unscored). The reward is
checked here, outside the box (`checked_reward`): one that is not a finite number or a dict
of metric-named finite numbers is the episode's error (agent/errors/bad_reward), as is an
episode with no answered request (agent/errors/no_request).
"""

from __future__ import annotations

import json
import logging
import math
import re
import secrets
import sys
import time
from collections import Counter, deque
from multiprocessing.connection import wait
from typing import Any

from leangrpo.agents.endpoint import AgentEndpoint
from leangrpo.contracts import Completion, Prompt, SamplingParams, Trajectory
from leangrpo.sandbox.frames import ProtocolError
from leangrpo.sandbox.levels import plan_for
from leangrpo.sandbox.process import OutputBudget, WorkerGone, WorkerProcess
from leangrpo.seeding import SEED_BITS

log = logging.getLogger("leangrpo.agents")
GRACE_S = 5.0  # beyond agent.timeout_s, how long a worker may take to answer an episode
MAX_REWARD_TERMS = 32  # an agent's reward dict: at most this many terms,
REWARD_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,64}")  # each named like a metric


class AgentError(RuntimeError):
    """The agent cannot run (its entry does not import, its workers do not start)."""


class AgentWorkers:
    def __init__(self, agent_cfg: Any, unix_socket: str, mode: str = "serve"):
        self.cfg = agent_cfg
        self.plan = plan_for(agent_cfg, "agent")
        self.timeout_s = float(agent_cfg.timeout_s)
        self._init = {
            "entry": "leangrpo.agents.worker",  # the worker's module (sandbox/launch.py)
            "mode": mode,
            "sys_path": list(sys.path),
            "agent_entry": agent_cfg.entry,
            "command": agent_cfg.command,
            "forward": unix_socket,
            "timeout_s": self.timeout_s,
        }
        self._budget = OutputBudget()
        self.stats: Counter[str] = Counter()
        self.workers: list[WorkerProcess] = []
        try:
            for slot in range(int(agent_cfg.num_workers)):
                self.workers.append(self._spawn(slot))
            for worker in self.workers:
                self._wait_ready(worker)
        except BaseException:
            self.close()
            raise

    def _spawn(self, slot: int) -> WorkerProcess:
        return WorkerProcess(self._init, f"agent worker {slot}", self._budget, parse=json.loads, plan=self.plan)

    def _wait_ready(self, worker: WorkerProcess) -> None:
        deadline = time.monotonic() + float(self.cfg.startup_timeout_s)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AgentError(f"an agent worker did not start within agent.startup_timeout_s = {self.cfg.startup_timeout_s}")
            for handle in wait(worker.handles(), timeout=left):
                if handle is worker.sock:
                    try:
                        replies = worker.receive()
                    except (WorkerGone, ProtocolError) as e:
                        raise AgentError(f"an agent worker failed at start-up: {e}") from None
                    for reply in replies:
                        if reply.get("t") == "init_error":
                            raise AgentError(reply.get("msg", "the agent worker failed at start-up"))
                        if reply.get("t") == "ready":
                            worker.ready = True
                            return
                else:
                    worker.relay_output()

    def run(self, episodes: list[dict]) -> dict[int, dict]:
        """Every episode's reply (`reward` or `error`), by id."""
        if not self.workers:
            raise AgentError("the agent workers were closed (the run is ending)")
        queued, out = deque(episodes), {}
        busy: dict[int, tuple[dict, float]] = {}  # slot -> (episode, deadline)
        while queued or busy:
            for slot in range(len(self.workers)):
                if slot not in busy and queued:
                    episode = queued.popleft()
                    try:
                        self.workers[slot].send(episode)
                    except WorkerGone as e:
                        out[episode["id"]] = self._replace(slot, f"the agent worker was gone: {e}", "worker died")
                        continue
                    busy[slot] = (episode, time.monotonic() + self.timeout_s + GRACE_S)
            if not busy:
                continue
            handles = {}
            for slot in busy:
                for h in self.workers[slot].handles():
                    handles[h if isinstance(h, int) else h.fileno()] = (slot, h)
            first = min(d for _, d in busy.values())
            ready = wait([h for _, h in handles.values()], timeout=max(0.0, first - time.monotonic()))
            for h in ready:
                slot, _ = handles[h if isinstance(h, int) else h.fileno()]
                if slot not in busy:
                    continue
                worker, (episode, _) = self.workers[slot], busy[slot]
                if h is not worker.sock:
                    worker.relay_output()
                    continue
                try:
                    replies = worker.receive()
                except (WorkerGone, ProtocolError) as e:
                    out[episode["id"]] = self._replace(slot, f"the agent worker failed: {e}", "worker died")
                    del busy[slot]
                    continue
                for reply in replies:
                    if reply.get("t") == "episode" and reply.get("id") == episode["id"]:
                        out[episode["id"]] = reply
                        del busy[slot]
            now = time.monotonic()
            for slot, (episode, deadline) in list(busy.items()):
                if now > deadline:
                    out[episode["id"]] = self._replace(slot, "the agent worker stopped answering", "hung")
                    del busy[slot]
        return out

    def _replace(self, slot: int, why: str, kind: str) -> dict:
        self.stats[f"worker_{kind.replace(' ', '_')}"] += 1
        self.workers[slot].kill()
        self.workers[slot] = self._spawn(slot)
        self._wait_ready(self.workers[slot])
        return {"t": "episode", "error": why, "kind": kind}

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        self.workers = []


class AgentRollout:
    """An engine's `generate` made of agent episodes: see the module docstring."""

    def __init__(self, endpoint: AgentEndpoint, workers: AgentWorkers, engine: Any, functions: bool = True):
        self.endpoint, self.workers, self.engine = endpoint, workers, engine
        self.functions = functions  # rewards.functions score an episode whose agent returns None
        self.last_metrics: dict[str, float] = {}

    @property
    def version(self) -> int:
        return self.engine.version

    def generate(self, prompts: list[Prompt], params: SamplingParams, n: int, version: int,
                 prompt_offset: int = 0) -> list[list[Completion]]:  # fmt: skip
        seed = params.seed if params.seed is not None else secrets.randbits(SEED_BITS)
        counts: Counter[str] = Counter()
        with self.endpoint.generating(self.engine, params, version):
            sessions, episodes = [], []
            for p, prompt in enumerate(prompts):
                for g in range(n):
                    index = (prompt_offset + p) * n + g
                    session = self.endpoint.open_session(prompt, seed, index)
                    sessions.append(session)
                    episodes.append({"id": len(episodes), "key": session.key, "task": task_of(prompt)})
            replies = self.workers.run(episodes)
            ended = [self.endpoint.end_session(s.key) for s in sessions]
        completions = []
        for episode, session in zip(episodes, ended):
            reply = checked_reply(replies.get(episode["id"], {"error": "no reply", "kind": "lost"}))
            if "error" not in reply and not session.segments:  # nothing to train: an error, counted
                reply = {"error": "the agent made no request that was answered (no model turn to train)", "kind": "no request"}
            if "error" not in reply and reply.get("reward") is None and not self.functions:
                reply = {"error": "the agent returned no reward and rewards.functions is empty", "kind": "no reward"}
            if "error" in reply:
                counts["errors"] += 1
                counts[f"errors/{reply.get('kind', 'raised').replace(' ', '_')}"] += 1
            completions.append(episode_completion(session, reply, version))
        self.last_metrics = {**self.endpoint.metrics(), **{f"agent/{k}": float(v) for k, v in counts.items()}}
        self.last_metrics.setdefault("agent/errors", 0.0)
        return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]


def checked_reply(reply: dict) -> dict:
    """The reply with its reward checked here, on the trusted side (the box's own check runs
    beside the agent's code, which can replace it): a bad reward is the episode's error."""
    if "error" in reply:
        return reply
    try:
        return {**reply, "reward": checked_reward(reply.get("reward"))}
    except ValueError as e:
        return {"error": str(e), "kind": "bad reward"}


def checked_reward(value: Any) -> float | dict[str, float] | None:
    """None, a finite number, or a dict of at most MAX_REWARD_TERMS metric-like names to
    finite numbers; anything else a ValueError naming what came."""
    if value is None or _finite(value):
        return None if value is None else float(value)
    if isinstance(value, dict) and len(value) <= MAX_REWARD_TERMS and all(
        isinstance(k, str) and REWARD_NAME.fullmatch(k) and _finite(v) for k, v in value.items()
    ):
        return {k: float(v) for k, v in value.items()}
    shown = repr(value)[:60] if isinstance(value, (str, int, float, bool, type(None))) else f"{len(value) if hasattr(value, '__len__') else '?'} items"
    raise ValueError(f"the agent's reward ({type(value).__name__} {shown}) is not a finite number or a dict of "
                     f"at most {MAX_REWARD_TERMS} names [A-Za-z0-9_.:/-] to finite numbers; return one of those or None")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def task_of(prompt: Prompt) -> dict:
    """What an agent is given: the prompt's messages and its data columns."""
    return {"messages": prompt.messages, **{k: v for k, v in prompt.columns.items() if _json_safe(v)}}


def _json_safe(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def episode_completion(session, reply: dict, version: int) -> Completion:
    """The episode's sample: its last segment, the earlier ones in `trajectory.earlier`,
    with the agent's reward terms or error."""
    segments = session.completions()
    reply = checked_reply(reply)  # generate checked it; a direct caller too
    error = reply.get("error")
    if not segments:
        p = session.prompt
        trajectory = Trajectory([], [], list(p.messages or []) if p else [],
                                error=error or "the agent made no request")  # fmt: skip
        return Completion([], "", [], "error", version, trajectory)
    completion = segments[-1]
    trajectory = completion.trajectory
    trajectory.earlier = segments[:-1]
    completion.version = min(c.version for c in segments)  # the episode's oldest turn
    trajectory.stats["segments"] = float(len(segments))
    calls = [call for c in segments for call in c.trajectory.tool_calls]  # the episode's
    trajectory.stats["tool_calls"] = float(len(calls))
    for name, count in Counter(str(call["name"]) for call in calls).items():
        trajectory.stats[f"tool_calls/{name}"] = float(count)
    trajectory.stats["requests"] = float(session.stats["requests"])
    if error is not None:
        trajectory.error = error
        completion.finish_reason = "error"
    reward = reply.get("reward")
    if isinstance(reward, dict):
        trajectory.rewards = dict(reward)
    elif reward is not None:
        trajectory.rewards = {"agent": reward}
    return completion
