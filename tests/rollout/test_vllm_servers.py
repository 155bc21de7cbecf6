"""Several real `leangrpo serve` processes (vLLM CPU build; `.venv-vllm`, like test_vllm.py)
behind one engine: single-turn groups spread evenly; a trajectory's turns stay on its
server and new trajectories go to the least loaded; one server SIGKILLed while turns are
in flight: its requests are served by the other, counted, the batch complete and every
completion the run's weights' (log-probs against the trainer's model); the weight sync
that follows reaches the survivor and marks the dead one down, which is never asked again.
The rules themselves, on fake servers: test_vllm_router.py.

    .venv-vllm/bin/pytest -m vllm tests/rollout/test_vllm_servers.py
"""

from __future__ import annotations

import copy
import secrets
import threading
import time

import pytest
from support.processes import kill_tree
from support.vllm_models import CHARS, build_char_model, mean_abs_logprob_gap, perturb

from leangrpo.contracts import Prompt, SamplingParams, TurnRequest
from leangrpo.rollout.vllm.client import ServerPool, start_local_server
from leangrpo.rollout.vllm.engine import VLLMEngine
from leangrpo.rollout.vllm.settings import VLLMSettings

TEXTS = ["12+3=", "abc", "x", "7*8=", "hello", "q?", "99-1=", "zz", "a b", "0.5"]
PROMPTS = [Prompt(uid=i, text=t, ids=[CHARS.index(ch) + 1 for ch in t]) for i, t in enumerate(TEXTS)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two `leangrpo serve` processes on one model (started together), and the model."""
    path = tmp_path_factory.mktemp("char_model")
    model, _ = build_char_model(path)
    token = secrets.token_urlsafe(32)
    settings = VLLMSettings(
        mode="server",
        dtype="float32",
        max_model_len=128,
        enforce_eager=True,
        engine_kwargs={"distributed_executor_backend": "uni", "kv_cache_memory_bytes": 64 << 20},
    )
    started: list = [None, None]

    def start(i: int) -> None:
        started[i] = start_local_server(str(path), settings, token=token, startup_timeout_s=900)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert all(started), "a server did not start (see its log above)"
        yield model, [url for _, url in started], [p for p, _ in started], token
    finally:
        for entry in started:
            if entry is not None:
                kill_tree(entry[0].pid)


def turns(engine, keys, params, rounds=1, budget=40, during=None):
    """`rounds` turns of each trajectory key (its ids: a prompt, then the turn appended); the
    server each turn went to; the stream's metrics. `during(stream)` runs once every key's
    first turn is submitted."""
    ids = {k: list(PROMPTS[k % len(PROMPTS)].ids) for k in keys}
    served, completions = {k: [] for k in keys}, {k: [] for k in keys}
    with engine.open_turns(params, engine.version) as stream:
        for r in range(rounds):
            for k in keys:
                stream.submit(TurnRequest(list(ids[k]), 1000 * r + k, budget, key=k))
            if during is not None and r == 0:
                during(stream)
            while stream.pending():
                for request, c in stream.advance(0.05):
                    k = request.key
                    served[k].append(engine.backend.router.server_of(stream.stream.route(k)))
                    completions[k].append((list(request.ids), c))
                    ids[k] = request.ids + c.ids[:-1] + [CHARS.index("=") + 1]
        metrics = stream.metrics()
    return served, completions, metrics


def gap(model, completions, params) -> float:
    pairs = [pair for turns_of in completions.values() for pair in turns_of]
    prompts = [Prompt(0, "", ids) for ids, _ in pairs]
    return mean_abs_logprob_gap(model, prompts, [[c] for _, c in pairs], params)


@pytest.mark.vllm
def test_two_servers_spread_stick_survive_a_kill_and_sync(servers):
    model, urls, processes, token = servers
    engine = VLLMEngine(
        ServerPool(urls, token=token, timeout_s=120, max_retries=1), VLLMSettings(mode="server")
    )
    router = engine.backend.router
    params = SamplingParams(temperature=1.0, max_new_tokens=40)
    engine.update_weights(model.state_dict().items(), version=0)  # as the trainer at start
    assert [s.held for s in router.servers] == [(engine.run_id, 0)] * 2

    # single-turn: prompt groups spread evenly, each server's completions the model's
    groups = engine.generate(PROMPTS[:6], SamplingParams(max_new_tokens=16, seed=5), n=2, version=0)
    assert [s.served for s in router.servers] == [3, 3]
    assert mean_abs_logprob_gap(model, PROMPTS[:6], groups, SamplingParams()) < 1e-3

    # turns: the least loaded takes a new trajectory, later turns stay on its server
    served, completions, metrics = turns(engine, range(8), params, rounds=3)
    assert all(len(set(s)) == 1 and len(s) == 3 for s in served.values())
    assert sorted(s[0] for s in served.values()) == [0] * 4 + [1] * 4
    assert metrics["server/0/requests"] == metrics["server/1/requests"] == 12.0
    assert metrics["server_retries"] == 0 and gap(model, completions, params) < 1e-3

    # server 1 is killed while turns are in flight on it: they are served by server 0
    def kill_server_1(stream):
        deadline = time.monotonic() + 300  # a hang guard
        while engine.backend.request(urls[1], "GET", "/health")["in_flight"] < 1:
            assert time.monotonic() < deadline, "no request reached server 1"
            time.sleep(0.005)
        kill_tree(processes[1].pid)

    served, completions, metrics = turns(engine, range(100, 116), params, rounds=2, budget=64, during=kill_server_1)
    assert all(len(c) == 2 for c in completions.values())  # the batch is complete
    assert metrics["server_retries"] >= 1 and metrics["servers_down"] == 1
    assert all(s[-1] == 0 for s in served.values()) and not router.servers[1].healthy
    assert gap(model, completions, params) < 1e-3  # the run's weights served every turn

    # the sync that follows reaches the survivor; the dead server is never asked again
    trainer = copy.deepcopy(model)
    perturb(trainer, scale=0.05, seed=3)
    engine.update_weights(trainer.state_dict().items(), version=1)
    assert router.servers[0].held == (engine.run_id, 1) and not router.servers[1].healthy
    served, completions, _ = turns(engine, range(200, 206), params, rounds=2)
    assert all(s == [0, 0] for s in served.values())
    assert gap(trainer, completions, params) < 1e-3 and gap(model, completions, params) > 1e-2
    engine.close()
