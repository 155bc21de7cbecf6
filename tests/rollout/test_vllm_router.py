"""Several vLLM servers (rollout/vllm/router.py, client.py, turns.py) on fake `leangrpo serve`s
(the real HTTP handler and version gate, scripted completions; no vLLM): a trajectory's
turns stay on one server, new ones go to the least loaded, single-turn groups spread
evenly; a server that fails, hangs or vanishes mid-batch has its requests served
elsewhere, counted, nothing lost; weight sync skips (and marks down) a server that fails
it, which then serves nothing until a later sync reaches it; stale weights never serve.
The same on real servers: tests/rollout/test_vllm_servers.py."""

from __future__ import annotations

import time

import pytest
import torch
from support.vllm_fakes import FakeLocal, Served

from leangrpo.contracts import EngineVersionError, Prompt, SamplingParams, TurnRequest
from leangrpo.pipeline.merging import rule_for
from leangrpo.rollout.vllm.client import ServerPool, ServerUnreachable
from leangrpo.rollout.vllm.engine import VLLMEngine
from leangrpo.rollout.vllm.router import Router
from leangrpo.rollout.vllm.settings import VLLMSettings
from leangrpo.rollout.vllm.versions import VersionGate

PARAMS = SamplingParams(max_new_tokens=4)


@pytest.fixture
def servers(tmp_path):
    made = []

    def make(count: int, delay_s: float = 0.05, timeout_s: float = 10.0):
        served = [
            Served(FakeLocal(f"s{i}", delay_s=delay_s), tmp_path / f"s{i}") for i in range(count)
        ]
        made.extend(served)
        pool = ServerPool([s.url for s in served], timeout_s=timeout_s, max_retries=0)
        engine = VLLMEngine(pool, VLLMSettings(mode="server"))
        engine.update_weights({"w": torch.zeros(2)}.items(), version=0)
        return engine, served

    yield make
    for s in made:
        s.local.release.set()
        s.close()


def run_turns(engine, keys, turns=2, version=0, between=None):
    """`turns` turns of each trajectory key through one stream; `between(turn)` runs after
    every turn of that index came back. Returns {key: [completion per turn]}."""
    out = {k: [] for k in keys}
    with engine.open_turns(PARAMS, version) as stream:
        for turn in range(turns):
            for k in keys:
                stream.submit(TurnRequest([100 + k, turn], 7 * k + turn, 4, key=k))
            while stream.pending():
                for request, completion in stream.advance(0.05):
                    out[request.key].append(completion)
            if between:
                between(turn)
        metrics = stream.metrics()
    return out, metrics


def server_of(served, key: int, turn: int) -> list[str]:
    return [
        s.local.name for s in served if any(r[0] == [100 + key, turn] for r in s.local.requests)
    ]


def test_turns_stick_to_their_server_and_new_trajectories_take_the_least_loaded(servers):
    engine, served = servers(3)
    out, metrics = run_turns(engine, range(6), turns=3)
    for k in range(6):
        first = server_of(served, k, 0)
        assert len(first) == 1 and all(server_of(served, k, t) == first for t in (1, 2))
        assert [c.ids for c in out[k]] == [[t, 100 + k, 0] for t in range(3)]  # each served once
    assert [len(s.local.requests) for s in served] == [6, 6, 6]  # 2 trajectories each
    assert [metrics[f"server/{i}/requests"] for i in range(3)] == [6.0, 6.0, 6.0]
    for key in metrics:  # logged as rollout/<key>; a streamed step merges them by rule
        assert rule_for(f"rollout/{key}")[0].kind in ("sum", "max")
    # a loaded server is skipped: s0 holds two long requests, the next two go elsewhere
    pool = engine.backend
    pool.router.servers[0].in_flight += 2
    picked = [pool.router.for_turn(k, engine.run_id, 0).url for k in (10, 11)]
    assert served[0].url not in picked and len(set(picked)) == 2


def test_single_turn_groups_spread_evenly(servers):
    engine, served = servers(3)
    prompts = [Prompt(uid=i, text="", ids=[i, 50]) for i in range(7)]
    groups = engine.generate(prompts, PARAMS, n=2, version=0)
    assert [g[0].ids for g in groups] == [[50, i, 0] for i in range(7)]  # prompt order kept
    assert sorted(len(s.local.served) for s in served) == [2, 2, 3]


@pytest.mark.parametrize("failure", ["error", "hang", "gone"])
def test_a_failed_server_requests_are_served_elsewhere_and_nothing_is_lost(servers, failure):
    """Mid-batch (after the first turns) server s1 answers 500, hangs past the client's
    timeout, or is gone: the second turns of its trajectories go to the others."""
    engine, served = servers(3, timeout_s=1.0)

    def break_s1(turn):
        if turn == 0:
            if failure == "gone":
                served[1].close()
            else:
                served[1].local.behaviour = failure

    out, metrics = run_turns(engine, range(6), turns=2, between=break_s1)
    assert all([c.ids for c in out[k]] == [[t, 100 + k, 0] for t in range(2)] for k in range(6))
    moved = [k for k in range(6) if server_of(served, k, 0) == ["s1"]]
    # its first failure marks it down; a turn submitted after that is routed elsewhere at once
    assert len(moved) == 2 and 1 <= metrics["server_retries"] <= 2 and metrics["servers_down"] == 1
    for k in moved:  # served once, by a healthy server
        assert len(server_of(served, k, 1)) == 1 and server_of(served, k, 1) != ["s1"]
    assert not engine.backend.router.servers[1].healthy
    groups = engine.generate([Prompt(uid=i, text="", ids=[i]) for i in range(4)], PARAMS, 1, 0)
    assert len(groups) == 4 and not any(r[0] == [3] for r in served[1].local.requests)


def test_a_whole_single_turn_share_moves_when_its_server_fails(servers):
    engine, served = servers(2, timeout_s=1.0)
    served[0].local.behaviour = "error"
    prompts = [Prompt(uid=i, text="", ids=[i, 60]) for i in range(5)]
    groups = engine.generate(prompts, PARAMS, n=2, version=0)
    assert [[c.ids for c in g] for g in groups] == [
        [[60, i, k] for k in range(2)] for i in range(5)
    ]
    assert len(served[1].local.served) == 5 and engine.backend.router.retries == 3


def test_a_server_that_misses_a_sync_serves_nothing_until_one_reaches_it(servers):
    engine, served = servers(2)
    served[1].local.behaviour = "error"  # its weight load fails (500)
    engine.update_weights({"w": torch.ones(2)}.items(), version=1)
    assert served[0].local.version == 1 and served[1].local.version == 0
    router = engine.backend.router
    assert not router.servers[1].healthy and "weight sync (commit)" in router.servers[1].last_error
    served[1].local.behaviour = "ok"  # it recovers, but holds version 0: never asked
    out, _ = run_turns(engine, range(4), turns=1, version=1)
    assert all(server_of(served, k, 0) == ["s0"] for k in range(4)) and len(out) == 4
    engine.update_weights({"w": torch.full((2,), 2.0)}.items(), version=2)  # reaches both
    assert router.servers[1].healthy and served[1].local.version == 2
    out, _ = run_turns(engine, range(10, 14), turns=1, version=2)
    assert {server_of(served, k, 0)[0] for k in range(10, 14)} == {"s0", "s1"}


def test_a_server_restarted_between_turns_is_failed_over_and_synced_again(servers):
    """Between two turns s1 restarts (a supervisor brings it back holding its start-up
    weights, no run's): its trajectories' next turns get its gate's 409. The client had
    committed the version there, so s1 lost it: its turns go to s0, which holds it; s1 is
    marked down holding nothing known, and the next weight sync brings it back."""
    engine, served = servers(2)

    def restart_s1(turn):
        if turn == 0:
            served[1].local.gate = VersionGate(0, None)

    out, metrics = run_turns(engine, range(4), turns=2, between=restart_s1)
    assert all([c.ids for c in out[k]] == [[t, 100 + k, 0] for t in range(2)] for k in range(4))
    moved = [k for k in range(4) if server_of(served, k, 0) == ["s1"]]
    assert moved and all(server_of(served, k, 1) == ["s0"] for k in moved)
    assert metrics["servers_down"] == 1 and metrics["server_retries"] >= 1
    s1 = engine.backend.router.servers[1]
    assert not s1.healthy and "restarted, or another run pushed" in s1.last_error
    engine.update_weights({"w": torch.ones(2)}.items(), version=1)  # reaches it again
    assert s1.healthy and s1.held == (engine.run_id, 1) and served[1].local.version == 1
    out, _ = run_turns(engine, range(10, 14), turns=1, version=1)
    assert {server_of(served, k, 0)[0] for k in range(10, 14)} == {"s0", "s1"}


def test_a_restarted_server_with_none_left_is_one_error_saying_so(servers):
    engine, served = servers(1)
    served[0].local.gate = VersionGate(0, None)
    with pytest.raises(EngineVersionError, match=r"restarted, or another run pushed its "
                       r"weights to it, since the last weight sync; it gets the next one, but "
                       r"no other server holds version 0"):  # fmt: skip
        run_turns(engine, [0], turns=1)


def test_stale_weights_never_serve(servers):
    """A server known to hold the old version is chosen only when nothing else can take the
    request, and then its own gate refuses it: an error, never a completion."""
    engine, served = servers(2)
    router = engine.backend.router
    router.servers[1].held = (engine.run_id, -5)  # as if it missed syncs
    picks = {router.for_turn(k, engine.run_id, 0).index for k in range(6)}
    assert picks == {0}
    router.failed(router.servers[0], "gone", 6)
    engine.backend.router.servers[1].held = (engine.run_id, -5)
    served[1].local.gate.version = 3  # it really holds other weights
    with pytest.raises(EngineVersionError):
        run_turns(engine, [0], turns=1)


def test_every_server_gone_is_one_clear_error(servers):
    engine, served = servers(2, timeout_s=1.0)
    for s in served:
        s.close()
    t0 = time.monotonic()
    with pytest.raises(ServerUnreachable, match="every vLLM server failed"):
        run_turns(engine, range(3), turns=1)
    assert time.monotonic() - t0 < 60  # no retry loop without end (a liveness bound)


def test_router_rules_without_servers():
    router = Router(["http://a", "http://b", "http://c"])
    for s in router.servers:
        router.committed(s, ("run", 4))
    first = [router.for_turn(k, "run", 4).index for k in range(3)]
    assert first == [0, 1, 2]  # ties: fewest in flight, then fewest served, then index
    router.done(router.servers[1])
    assert router.for_turn(3, "run", 4).index == 1  # the only one with nothing in flight
    assert router.for_turn(0, "run", 4).index == 0  # sticky, though loaded
    router.failed(router.servers[0], "reset", 2)
    assert router.reroute(0, "run", 4).index in (1, 2) and router.retries == 1
    assert [s.index for s in router.spread(4, "run", 4)] == [1, 2, 1, 2]


def test_single_turn_groups_count_in_flight_until_they_come_back():
    """spread counts its assignments in flight (generate's `done` takes them back): the
    load never goes negative, so a server that served more single-turn groups is not
    taken for the least loaded afterwards."""
    router = Router(["http://a", "http://b"])
    for s in router.servers:
        router.committed(s, ("run", 1))
    assigned = router.spread(3, "run", 1)
    assert [s.in_flight for s in router.servers] == [2, 1]
    for server in assigned:
        router.done(server)
    assert [s.in_flight for s in router.servers] == [0, 0]
    assert router.for_turn(0, "run", 1).index == 1  # fewer served, not "fewer in flight"
