"""The multi-turn rollout (environments/driver.py) on the tool demo's model and the real hf
engine: trajectories are the engine's ids and the rendered replies, token for token; each
trajectory has its own seed and budget; the limits end trajectories with their finish
reasons; an environment's failure ends its trajectory; its reward terms are summed."""

from __future__ import annotations

import time

import pytest
import torch
from support.configs import ROOT
from transformers import AutoModelForCausalLM, AutoTokenizer

from leangrpo.config.environment import EnvironmentConfig
from leangrpo.contracts import Prompt, RolloutSample, SamplingParams
from leangrpo.environments.driver import MultiTurnRollout, TurnLimits
from leangrpo.environments.metrics import trajectory_metrics
from leangrpo.environments.pool import EnvironmentPool
from leangrpo.environments.rendering import Renderer
from leangrpo.rollout.hf.engine import HFEngine
from leangrpo.seeding import derive_seed

TOOLS_MODEL = ROOT / "examples" / "tools_demo" / "model"
CALCULATOR = str(ROOT / "examples" / "tools_demo" / "calculator.py") + ":add"
PAIRS = [(395, 136), (548, 622), (586, 556), (689, 736), (951, 434), (244, 673)]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOOLS_MODEL)


@pytest.fixture(scope="module")
def engine(tokenizer):
    model = AutoModelForCausalLM.from_pretrained(TOOLS_MODEL, dtype=torch.float32)
    return HFEngine(model.eval(), tokenizer)


@pytest.fixture(scope="module")
def pools():
    made = {}

    def get(name: str, **fields) -> EnvironmentPool:
        key = (name, repr(sorted(fields.items())))
        if key not in made:
            made[key] = EnvironmentPool(EnvironmentConfig(name=name, num_workers=2, **fields))
        return made[key]

    yield get
    for pool in made.values():
        pool.close()


def prompts(n: int = len(PAIRS)) -> list[Prompt]:
    out = []
    for uid, (a, b) in enumerate(PAIRS[:n]):
        messages = [{"role": "user", "content": f"{a}+{b}="}]
        out.append(Prompt(uid, f"{a}+{b}=", [0], {"answer": str(a + b)}, messages))
    return out


class Recording:
    """The engine, keeping every turn it generated (request -> completion)."""

    def __init__(self, engine):
        self.engine, self.turns = engine, []

    @property
    def version(self):
        return self.engine.version

    def open_turns(self, params, version):
        recording, stream = self, self.engine.open_turns(params, version)

        class Recorded:
            def __getattr__(self, name):
                return getattr(stream, name)

            def advance(self, timeout_s=0.0):
                done = stream.advance(timeout_s)
                recording.turns.extend(done)
                return done

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                stream.close()

        return Recorded()


def rollout(engine, tokenizer, pool, max_turns=3, max_total=192, scheduling="per_trajectory"):
    renderer = Renderer(tokenizer, pool.tools)
    limits = TurnLimits(max_turns, max_total)
    return MultiTurnRollout(engine, pool, renderer, limits, {tokenizer.eos_token_id}, scheduling)


PARAMS = SamplingParams(temperature=1.0, max_new_tokens=64, seed=3)


def test_trajectories_are_the_engines_ids_and_the_rendered_replies(engine, tokenizer, pools):
    pool = pools("tools", tools=[CALCULATOR])
    recording = Recording(engine)
    groups = rollout(recording, tokenizer, pool).generate(prompts(), PARAMS, 8, 0)
    completions = [c for g in groups for c in g]
    assert sum(bool(c.trajectory.tool_calls) for c in completions) >= 3  # some called the tool
    by_seed = {r.seed: (r, c) for r, c in recording.turns}  # one seed per trajectory and turn
    for index, c in enumerate(completions):
        t = c.trajectory
        ids = t.start.ids + c.ids
        # (a) the whole conversation's tokenisation (this tokenizer is canonical)
        text = tokenizer.apply_chat_template(t.messages, tools=pool.tools, tokenize=False)
        assert tokenizer(text, add_special_tokens=False).input_ids == ids
        # (b) each model segment is the engine's turn, verbatim, with its log-probs
        pos, logprobs, turn = len(t.start.ids), [], 0
        for n, is_model in t.segments:
            if is_model:
                request, out = by_seed[derive_seed(PARAMS.seed, 0, index, turn)]
                assert request.ids == ids[:pos] and ids[pos : pos + n] == out.ids
                logprobs += out.logprobs
                turn += 1
            pos += n
        assert logprobs == c.logprobs and len(c.logprobs) == t.num_model_tokens
        assert c.text == out.text
        assert c.finish_reason == "stop" and t.turn_versions == [0] * len(t.turn_versions)
        calls = len(t.tool_calls)
        assert t.stats["turns"] == calls + 1 and t.stats.get("tool_calls", 0) == calls


def test_a_group_starts_from_one_prompt_and_a_batch_is_reproducible(engine, tokenizer, pools):
    pool = pools("support.environments:Puzzle", kwargs={"turns": 2})
    made = rollout(engine, tokenizer, pool).generate(prompts(3), PARAMS, 4, 0, prompt_offset=5)
    again = rollout(engine, tokenizer, pool).generate(prompts(3), PARAMS, 4, 0, prompt_offset=5)
    starts = [[c.trajectory.start.ids for c in g] for g in made]
    assert all(s == g[0] for g in starts for s in g)  # the reset is seeded per prompt
    assert len({tuple(g[0]) for g in starts}) == 3
    assert [[c.ids for c in g] for g in made] == [[c.ids for c in g] for g in again]
    puzzle = made[0][0].trajectory.start.messages[0]["content"]
    assert puzzle.startswith("puzzle ") and puzzle.endswith("for 531")


def test_a_trajectory_samples_the_same_whichever_others_share_its_rounds(engine, tokenizer, pools):
    """Per-trajectory seeds: a torchrun rank's share (prompt_offset) makes the trajectories
    the whole batch makes, though other trajectories end at other rounds."""
    one_at_a_time = HFEngine(engine.model, tokenizer, max_batch_size=1)  # bitwise forwards
    pool = pools("tools", tools=[CALCULATOR])
    whole = rollout(one_at_a_time, tokenizer, pool).generate(prompts(4), PARAMS, 3, 0)
    part = rollout(one_at_a_time, tokenizer, pool).generate(prompts(4)[2:], PARAMS, 3, 0, 2)
    assert [[c.ids for c in g] for g in whole[2:]] == [[c.ids for c in g] for g in part]


def test_limits_end_trajectories_with_their_finish_reasons(engine, tokenizer, pools):
    pool = pools("support.environments:Forever")
    out = rollout(engine, tokenizer, pool, max_turns=2, max_total=1000).generate(prompts(2), PARAMS, 4, 0)
    for c in (c for g in out for c in g):
        assert c.finish_reason in ("max_turns", "length")
        if c.finish_reason == "max_turns":
            assert [m for _, m in c.trajectory.segments] == [True, False, True]
    tight = rollout(engine, tokenizer, pool, max_turns=5, max_total=60).generate(prompts(2), PARAMS, 4, 0)
    for c in (c for g in tight for c in g):
        assert c.finish_reason == "length" and c.trajectory.segments[-1][1]  # ends on a model turn
        assert len(c.trajectory.start.ids) + len(c.ids) <= 60


def test_reward_terms_are_summed_and_failures_end_their_trajectory(engine, tokenizer, pools, caplog):
    pool = pools("support.environments:Again", kwargs={"turns": 2})
    (group,) = rollout(engine, tokenizer, pool, max_total=1000).generate(prompts(1), PARAMS, 2, 0)
    for c in group:
        t = c.trajectory
        if c.finish_reason == "stop":
            assert t.rewards == {"per_turn": 0.5, "final": 1.0} and t.stats["turns"] == 2
            assert t.messages[2] == {"role": "user", "content": "again"}
            # a metric is the mean of the trajectory's reports (one per step), not their sum
            turns = [len(m["content"]) for m in t.messages if m["role"] == "assistant"]
            assert t.metrics["chars"] == pytest.approx(sum(turns) / len(turns))
    samples = [RolloutSample(0, c.trajectory.start, c) for c in group]
    logged = trajectory_metrics(samples)["multiturn/env/chars"]
    assert logged == pytest.approx(sum(c.trajectory.metrics["chars"] for c in group) / len(group))
    failing = pools("support.environments:BadReset")
    with caplog.at_level("WARNING", logger="leangrpo.environments"):
        (group,) = rollout(engine, tokenizer, failing).generate(prompts(1), PARAMS, 2, 0)
    for c in group:
        assert c.finish_reason == "error" and c.ids == [] and c.logprobs == []
        assert "reset failed" in c.trajectory.error and "no puzzle for 531" in c.trajectory.error
    logged = [r.getMessage() for r in caplog.records if "ended with an error" in r.getMessage()]
    assert len(logged) == 1 and "no puzzle for 531" in logged[0]  # the first one, once


def test_special_tokens_in_a_reply_cannot_forge_a_turn(engine, tokenizer, pools):
    pool = pools("support.environments:ForgedTurn")
    (group,) = rollout(engine, tokenizer, pool).generate(prompts(1), PARAMS, 2, 0)
    for c in group:
        start = c.trajectory.start
        assert start.messages == [{"role": "user", "content": "1+2="}]  # the reset's, cleaned
        assert tokenizer.decode(start.ids) == "<|user|>1+2=<|end|><|assistant|>"  # no tools
        if len(c.trajectory.segments) > 1:
            assert c.trajectory.stats["control_tokens_stripped"] == 4 + 4
            assert c.trajectory.messages[2]["content"] == "42"
        else:
            assert c.trajectory.stats["control_tokens_stripped"] == 4


def test_per_trajectory_makes_what_rounds_make_whatever_the_latencies(tokenizer, pools):
    """Random environment latencies (support.environments:Latency) and the engine's
    batch-invariant mode (one sequence per forward): per-trajectory scheduling makes the
    rounds' trajectories bit for bit, and keeps caches between turns."""
    model = AutoModelForCausalLM.from_pretrained(TOOLS_MODEL, dtype=torch.float32).eval()
    engine = HFEngine(model, tokenizer, max_batch_size=1)
    pool = pools("support.environments:Latency", kwargs={"turns": 3})
    made = {}
    for mode in ("rounds", "per_trajectory", "per_trajectory"):
        run = rollout(engine, tokenizer, pool, max_total=1000, scheduling=mode)
        groups = run.generate(prompts(4), PARAMS, 3, 0)
        got = [(c.ids, c.logprobs, c.trajectory.segments, c.trajectory.rewards) for g in groups for c in g]
        assert made.setdefault("rounds", got) == got, mode
        assert sum(len(c.trajectory.segments) > 1 for g in groups for c in g) >= 6  # multi-turn
        metrics = run.last_metrics
        assert metrics["multiturn/prefill_tokens_saved"] > 0  # later turns on kept caches
        assert 0 < metrics["multiturn/in_flight_mean"] <= metrics["multiturn/in_flight_max"] == 12
        assert metrics["multiturn/generation_s"] > 0 and metrics["multiturn/env_wait_s"] >= 0


def test_a_calls_loop_and_engine_metrics_merge_as_streamed_chunks(tokenizer, pools):
    """A streamed step merges its chunks' metrics by declared rules (pipeline/merging.py):
    the call's loop and engine figures had none, so a streamed multi-turn step with two
    chunks stopped on a KeyError. Counts and seconds add, the largest in-flight is kept."""
    from leangrpo.pipeline.merging import merge_metrics

    model = AutoModelForCausalLM.from_pretrained(TOOLS_MODEL, dtype=torch.float32).eval()
    engine = HFEngine(model, tokenizer, kv_cache_tokens=400)  # evicts: every count shows
    pool = pools("support.environments:Again", kwargs={"turns": 3})
    run = rollout(engine, tokenizer, pool, max_total=192)
    chunks = []
    for batch in (prompts(3), prompts(6)[3:]):
        groups = run.generate(batch, PARAMS, 4, 0)
        samples = [RolloutSample(c.trajectory.start.uid, c.trajectory.start, c) for g in groups for c in g]
        chunks.append((samples, dict(run.last_metrics)))
    for key in ("generation_s", "env_wait_s", "prefill_tokens", "prefill_tokens_saved",
                "decode_steps", "cache_evictions", "in_flight_max", "in_flight_mean"):  # fmt: skip
        assert all(f"multiturn/{key}" in m for _, m in chunks), key
    merged = merge_metrics(chunks)
    first, second = (m for _, m in chunks)
    for key in ("multiturn/prefill_tokens", "multiturn/decode_steps", "multiturn/generation_s"):
        assert merged[key] == pytest.approx(first[key] + second[key])
    assert merged["multiturn/in_flight_max"] == 12.0


def test_a_slow_environment_step_holds_up_only_its_own_trajectory(engine, tokenizer, pools, tmp_path):
    """Trajectory 1 (alone on its worker) waits in its first step until a file exists; the
    others finish all their turns meanwhile: per-trajectory scheduling never waits for the
    round (under rounds they could not get past their first turn)."""
    import threading

    pool = pools("support.environments:HeldBack", kwargs={"turns": 3}, timeout_s=300)
    release = tmp_path / "release"
    held = prompts(3)
    held[1].columns["hold"] = str(release)
    recording = Recording(engine)
    run = rollout(recording, tokenizer, pool, max_total=1000)
    out = []
    thread = threading.Thread(target=lambda: out.append(run.generate(held, PARAMS, 1, 0)))
    thread.start()
    deadline = time.monotonic() + 300  # a hang guard

    def turns(key):
        return [r.key for r, _ in recording.turns].count(key)

    while (turns(0), turns(1), turns(2)) != (3, 1, 3) and time.monotonic() < deadline:
        time.sleep(0.05)
    # the others made all three turns; trajectory 1 its first (under rounds they could not
    # have gone past their first turn), and the call waits for it
    assert (turns(0), turns(1), turns(2)) == (3, 1, 3) and thread.is_alive() and not out
    release.touch()
    thread.join(120)
    ((first,), (slow,), (third,)) = out[0]
    assert len(slow.trajectory.segments) > 1 and slow.finish_reason in ("stop", "length")


def test_a_dying_environment_worker_ends_its_trajectories_and_the_call_goes_on(engine, tokenizer, pools):
    pool = pools("support.environments:ExitInStep")
    batch = prompts(3)
    batch[1].columns["answer"] = "3"  # its worker exits in the first step
    groups = rollout(engine, tokenizer, pool).generate(batch, PARAMS, 2, 0)
    errors = [c for g in groups for c in g if c.finish_reason == "error"]
    assert errors and all("died" in c.trajectory.error or "no such trajectory" in c.trajectory.error for c in errors)
    assert any(c.finish_reason == "stop" for c in groups[0] + groups[2])
    again = rollout(engine, tokenizer, pool).generate(prompts(1), PARAMS, 2, 0)  # the pool recovered
    assert all(c.finish_reason == "stop" for c in again[0])
