"""The hf engine on mixtures of experts (routing replay): each token's route record is the
routing of the forward that sampled it (single-turn with n samples, left padding and rows
leaving the batch; multi-turn turns over kept and evicted KV caches), equal in float32 to
a plain forward's routing at the token's predicting position; routes made to differ on
purpose (a perturbed router, a bf16 engine against the float32 trainer) flip without
replay and never with it, and the importance ratios' spread falls; weight sync of LoRA
on experts (peft's nested ParamWrappers) reaches the engine's copy."""

from __future__ import annotations

import contextlib

import pytest
import torch
from support.models import MOE_ARCHS
from support.moe import (
    SAMPLING,
    as_sets,
    experts_received,
    generate,
    moe_config,
    moe_policy,
    used_routes,
)

from leangrpo.contracts import SamplingParams, TurnRequest
from leangrpo.model.scoring import score
from leangrpo.rollout.hf import decode as decode_module
from leangrpo.rollout.hf.engine import HFEngine
from leangrpo.train.packing import pack_samples


def free_routes(model, ids: list[int]) -> torch.Tensor:
    """(len(ids), layers, k) routing of one unpadded forward, sorted within a row."""
    with torch.no_grad(), experts_received(model) as calls:
        model(input_ids=torch.tensor([ids]))
    return used_routes(calls)


def assert_records_are_the_sampling_forwards(model, prompt_ids, completion) -> None:
    ids = prompt_ids + completion.ids
    reference = free_routes(model, ids)
    p = len(prompt_ids)
    predicting = reference[p - 1 : p - 1 + len(completion.ids)]  # position t - 1 predicts t
    assert completion.routes.dtype == torch.uint8
    assert torch.equal(as_sets(completion.routes), predicting)


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("compact", [0.25, 1.1])
def test_single_turn_records_are_the_routing_of_the_sampling_forward(arch, compact, monkeypatch):
    """n samples per prompt, prompts of different lengths (left padding), rows that finish
    early riding along or leaving the batch (COMPACT_FRACTION)."""
    monkeypatch.setattr(decode_module, "COMPACT_FRACTION", compact)
    policy = moe_policy(arch)
    samples = generate(policy, n=3, count=5)
    assert {len(s.completion.ids) for s in samples} != {SAMPLING.max_new_tokens}  # some stop early
    for s in samples:
        assert s.completion.routes.shape == (len(s.completion.ids), 2, 2)
        assert_records_are_the_sampling_forwards(policy.model, s.prompt.ids, s.completion)


def test_greedy_copies_and_an_engine_without_replay():
    policy = moe_policy()
    engine = HFEngine(policy.model, policy.tokenizer, share_weights=False)
    prompt = [3, 4, 5, 6]
    from leangrpo.contracts import Prompt

    greedy = engine.generate(
        [Prompt(0, "", prompt)], SamplingParams(temperature=0, max_new_tokens=5), 2, 0
    )
    first, second = greedy[0]
    assert torch.equal(first.routes, second.routes)
    assert_records_are_the_sampling_forwards(policy.model, prompt, first)
    plain = moe_policy(cfg=moe_config(rollout={"routing_replay": False}))
    other = HFEngine(plain.model, plain.tokenizer, share_weights=False)
    assert other.generate([Prompt(0, "", prompt)], SAMPLING, 1, 0)[0][0].routes is None


@pytest.mark.parametrize("budget", [None, 40])
def test_multi_turn_records_over_kept_and_evicted_caches(budget):
    """Three turns per trajectory, an environment segment between them: a turn that
    prefills only its new tokens on a kept cache (or all of them after an eviction)
    records the routing of the forwards that sampled it."""
    policy = moe_policy()
    engine = HFEngine(policy.model, policy.tokenizer, share_weights=False, kv_cache_tokens=budget)
    starts = {0: [5, 6, 12, 13], 1: [20, 21], 2: [30, 31, 2, 3, 4, 25]}
    ids = {k: list(v) for k, v in starts.items()}
    turns: dict[int, list] = {k: [] for k in starts}
    env = [7, 8, 9]
    with engine.open_turns(SamplingParams(temperature=1.0), 0) as stream:
        for k in starts:
            stream.submit(TurnRequest(list(ids[k]), 100 + k, 6, key=k))
        while stream.pending():
            for request, completion in stream.advance():
                k = request.key
                turns[k].append((list(request.ids), completion))
                if len(turns[k]) < 3:
                    ids[k] = request.ids + completion.ids + env
                    stream.submit(TurnRequest(list(ids[k]), 200 + k, 6, key=k))
        stats = stream.metrics()
    assert stats.get("prefill_tokens_saved", 0) > 0 or budget is not None
    if budget is not None:
        assert stats.get("cache_evictions", 0) > 0
    for k in starts:
        for prompt_ids, completion in turns[k]:
            assert_records_are_the_sampling_forwards(policy.model, prompt_ids, completion)


# -- routes that differ on purpose ---------------------------------------------------------


def applied_mismatches(policy, mb, *, replay: bool) -> tuple[int, torch.Tensor]:
    """Tokens whose experts (any layer) differ from the record, and the log-ratio against
    the engine's log-probs, for a forward with or without replay."""
    unforced = contextlib.nullcontext() if replay else policy.routing.unforced()
    with torch.no_grad(), unforced, experts_received(policy.model) as calls:
        logprobs, _ = score(
            policy.model, mb, SamplingParams(temperature=1.0), moe_config().logprobs
        )
    used = used_routes(calls)[mb.completion_index]
    differ = (used != as_sets(mb.routes)).flatten(1).any(dim=1)
    return int(differ.sum()), logprobs - mb.behaviour_logprobs


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize(
    "engine", [{"perturb": 0.01}, {"engine_dtype": torch.bfloat16}], ids=["perturbed", "bf16"]
)
def test_routes_differing_on_purpose_flip_without_replay_and_never_with_it(arch, engine):
    """The engine routes with a perturbed router, or in bf16 (near-tied routers: a router
    scaled down); the float32 trainer without replay routes some completion tokens to
    other experts and with replay none; the importance ratios' spread falls with replay;
    moe/routing_flips counts what would have flipped."""
    policy = moe_policy(arch, router_scale=0.1)
    mb = pack_samples(generate(policy, n=4, count=8, **engine))
    flips_free, free = applied_mismatches(policy, mb, replay=False)
    flips_replayed, replayed = applied_mismatches(policy, mb, replay=True)
    assert flips_free > 0 and flips_replayed == 0
    assert policy.routing.last["flipped"] > 0  # would have differed without replay
    assert replayed.std() < 0.6 * free.std()
    assert replayed.abs().max() < free.abs().max()


def test_the_float32_control_routes_agree_without_replay():
    """Engine and trainer in float32, same weights: the trainer's own routing equals the
    record for every token and layer (nothing to replay)."""
    for arch in MOE_ARCHS:
        policy = moe_policy(arch, router_scale=0.1)
        mb = pack_samples(generate(policy, n=4, count=8))
        flips, log_ratio = applied_mismatches(policy, mb, replay=False)
        assert flips == 0 and policy.routing.last["flipped"] == 0
        assert log_ratio.abs().max() < 1e-4


def test_weight_sync_of_lora_on_experts_reaches_the_engines_copy():
    """peft wraps each targeted parameter of an experts module in a ParamWrapper of its
    own (`experts.base_layer.lora_A` inside `experts.lora_A`): update_weights copies each
    adapter into its own tensor (it used to fold the two names into one)."""
    cfg = moe_config(lora={"enabled": True, "r": 4, "alpha": 8, "target_modules": "all-linear"})
    policy = moe_policy(cfg=cfg)
    engine = HFEngine(policy.model, policy.tokenizer, share_weights=False)
    with torch.no_grad():
        for p in policy.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p))
    engine.update_weights(policy.named_trainable_tensors(), 1)
    theirs = dict(engine.model.named_parameters())
    for name, p in policy.model.named_parameters():
        assert torch.equal(p, theirs[name]), name


def test_multi_turn_trajectories_carry_their_turns_records_in_order():
    """The multi-turn rollout (environments/driver.py) on a tiny Qwen3-MoE: a trajectory's
    record is its model turns' records end to end, one row per model token, each the
    routing of the forward that sampled the token in the whole conversation."""
    from support.configs import ROOT
    from transformers import AutoTokenizer

    from leangrpo.config.environment import EnvironmentConfig
    from leangrpo.environments.driver import MultiTurnRollout, TurnLimits
    from leangrpo.environments.pool import EnvironmentPool
    from leangrpo.environments.rendering import Renderer

    tools = ROOT / "examples" / "tools_demo" / "model"
    tokenizer = AutoTokenizer.from_pretrained(tools)
    policy = moe_policy(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    head = policy.model.get_output_embeddings()
    with torch.no_grad():  # turns end on EOS early: the environment answers, a next turn comes
        head.weight[tokenizer.eos_token_id] += 2.0 * head.weight.abs().mean() * 30
    engine = HFEngine(policy.model, tokenizer, share_weights=False)
    pool = EnvironmentPool(
        EnvironmentConfig(name="support.environments:Puzzle", num_workers=1, kwargs={"turns": 2})
    )
    try:
        rollout = MultiTurnRollout(
            engine, pool, Renderer(tokenizer, pool.tools), TurnLimits(3, 96),
            {tokenizer.eos_token_id}, "per_trajectory",
        )  # fmt: skip
        from leangrpo.contracts import Prompt

        asked = [Prompt(i, "", [0], {"answer": str(i)}, [{"role": "user", "content": "hi"}])
                 for i in range(2)]  # fmt: skip
        groups = rollout.generate(
            asked, SamplingParams(temperature=1.0, max_new_tokens=12, seed=1), 2, 0
        )
    finally:
        pool.close()
    turns = 0
    for c in (c for g in groups for c in g):
        t = c.trajectory
        assert c.routes.shape == (t.num_model_tokens, 2, 2) == (len(c.logprobs), 2, 2)
        reference = free_routes(policy.model, t.start.ids + c.ids)
        offsets = torch.tensor(t.model_offsets()) + len(t.start.ids) - 1  # predicting positions
        assert torch.equal(as_sets(c.routes), reference[offsets])
        turns += sum(1 for _, is_model in t.segments if is_model)
    assert turns > len(groups) * 2  # some trajectories had more than one turn
