"""Mixtures of experts (model/moe/): routers and their gate recipes, route records refused
when they do not fit, routing replay in the packed scoring forward (the experts really
used equal the record for every token and layer, on plain and shared-prefix rows, across
micro-batches; replaying a router's own choice changes nothing, bit for bit), gate weights
recomputed from the current router logits, the router's auxiliary loss against
transformers' own on a padded batch, gradient checkpointing and offload, LoRA on
attention and on experts, and the control's deep copies."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from support.models import MOE_ARCHS, make_tiny_model
from support.moe import (
    as_sets,
    experts_received,
    generate,
    moe_config,
    moe_model,
    moe_policy,
    random_routes,
    routers,
    tokenizer,
    used_routes,
    with_routes,
)
from support.samples import make_samples

from leangrpo.contracts import SamplingParams
from leangrpo.model.moe.control import NO_ROUTING, install_routing, routing_of
from leangrpo.model.moe.routers import (
    RoutingError,
    softmax_over_chosen,
    softmax_then_chosen,
)
from leangrpo.model.moe.routes import check_routes, route_dtype
from leangrpo.model.policy import build_policy
from leangrpo.model.scoring import reference_logprobs, score
from leangrpo.train.inputs import normalisers
from leangrpo.train.packing import pack_samples, plan_micro_batches
from leangrpo.train.planning import plan_steps

UNFILTERED = SamplingParams(temperature=1.0)


def scored(policy, mb, *, replay=True, grad=False):
    unforced = policy.routing.unforced() if not replay else contextlib.nullcontext()
    with torch.set_grad_enabled(grad), unforced:
        return score(policy.model, mb, UNFILTERED, moe_config().logprobs, with_entropy=grad)[0]


# -- routers, recipes, records ------------------------------------------------------------


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_routers_their_spec_and_recipe(arch):
    policy = moe_policy(arch)
    spec = policy.routing.spec
    assert (spec.layers, spec.top_k, spec.experts) == (2, 2, 4)
    assert policy.routing.recipe is softmax_then_chosen
    assert routing_of(policy.model) is policy.routing


def test_gpt_oss_router_recipe_is_a_softmax_over_the_chosen():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    torch.manual_seed(0)
    router = GptOssTopKRouter(
        GptOssConfig(hidden_size=16, num_local_experts=4, num_experts_per_tok=2)
    )
    torch.nn.init.normal_(router.weight)
    from leangrpo.model.moe.routers import gate_recipe

    assert gate_recipe(router) is softmax_over_chosen


def test_dense_models_get_no_control_and_are_refused_when_replay_is_asked():
    dense = make_tiny_model("qwen2")
    assert install_routing(dense, replay=False, aux_coef=0.0) is None
    assert routing_of(dense) is NO_ROUTING
    with pytest.raises(RoutingError, match="rollout.routing_replay needs a mixture-of-experts"):
        install_routing(dense, replay=True, aux_coef=0.0)
    with pytest.raises(RoutingError, match="train.router_aux_loss_coef needs"):
        install_routing(dense, replay=False, aux_coef=0.01)


def test_an_unknown_gate_recipe_is_refused():
    model = moe_model()
    for router in routers(model):  # a router whose weights are not its softmax's
        router.forward = _doubled(router.forward)
    with pytest.raises(
        RoutingError, match="weighs its experts in a way routing replay does not know"
    ):
        install_routing(model, replay=True, aux_coef=0.0)


def _doubled(forward):
    def run(x):
        logits, weights, indices = forward(x)
        return logits, weights * 2, indices

    return run


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r[:, :1], r"shape \(\d+, 1, 2\) instead of"),  # one layer short
        (lambda r: r[:, :, :1], r"instead of \(tokens, layers, k\)"),  # k = 1
        (lambda r: r[:-1], r"shape \(\d+, 2, 2\) instead of"),  # a token short
        (lambda r: torch.where(r == r.flatten()[0], 4, r), "names expert 4, outside"),
        (lambda r: r.to(torch.int16) - 5, "names expert -"),
        (lambda r: torch.stack([r[..., 0], r[..., 0]], -1), "names one expert twice"),
        (lambda r: r.float(), "not integers"),
        (lambda r: r.tolist(), "is a list, not a tensor"),
    ],
)
def test_hostile_route_records_are_refused_before_use(edit, message):
    policy = moe_policy()
    samples = generate(policy, n=2, count=2)
    bad = with_routes(samples, [edit(s.completion.routes) for s in samples])
    with pytest.raises(RoutingError, match=message):
        plan_steps(bad, moe_config(), policy)


def test_a_replay_run_refuses_samples_without_records_and_a_mixed_micro_batch():
    policy = moe_policy()
    samples = generate(policy, n=2, count=2)
    bare = with_routes(samples, [None] * len(samples))
    with pytest.raises(RoutingError, match="has no route record"):
        plan_steps(bare, moe_config(), policy)
    mixed = bare[:1] + samples[1:]
    with pytest.raises(RoutingError, match="has no route record while others"):
        pack_samples(mixed)
    with pytest.raises(RoutingError, match="without route records"):
        score(policy.model, pack_samples(bare), UNFILTERED, moe_config().logprobs)


def test_records_on_a_policy_without_replay_are_refused():
    policy = moe_policy(cfg=moe_config(rollout={"routing_replay": False}))
    assert policy.routing is NO_ROUTING
    samples = generate(moe_policy(), n=2, count=2)
    with pytest.raises(RoutingError, match="no routing replay installed"):
        plan_steps(samples, moe_config(rollout={"routing_replay": False}), policy)


def test_record_dtype_and_the_check_itself():
    assert route_dtype(256) is torch.uint8 and route_dtype(257) is torch.int16
    spec = moe_policy().routing.spec
    check_routes(torch.tensor([[[0, 1], [2, 3]]], dtype=torch.uint8), 1, spec, "x")
    with pytest.raises(RoutingError, match="x: its route record"):
        check_routes(torch.zeros(1, 2, 2, dtype=torch.uint8), 1, spec, "x")


# -- replay in the scoring forward -------------------------------------------------------


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("shared", [False, True])
def test_replay_routes_every_completion_token_to_its_record(arch, shared):
    """Records unlike the model's own choice: with replay each layer's experts receive
    the record at every predicting position; every other position routes as the forward
    decides (the first layer's inputs, and a prompt's before any replayed position, are
    the free forward's, so their routes are too)."""
    policy = moe_policy(arch)
    samples = generate(policy, n=3, count=4)
    forced = with_routes(samples, random_routes(samples))
    mb = pack_samples(forced, shared_prefix=shared)
    with experts_received(policy.model) as free_calls:
        scored(policy, mb, replay=False)
    with experts_received(policy.model) as calls:
        scored(policy, mb)
    used, free = used_routes(calls), used_routes(free_calls)
    at = mb.completion_index
    assert torch.equal(used[at], as_sets(mb.routes))  # every token, every layer
    assert policy.routing.last["conflicts"] == 0
    others = torch.ones(mb.num_tokens, dtype=torch.bool)
    others[at] = False
    assert torch.equal(used[others][:, 0], free[others][:, 0])
    before = int(at.min())  # the first prompt's tokens before its last
    assert before > 0 and torch.equal(used[:before], free[:before])
    assert not torch.equal(free[at], as_sets(mb.routes))  # the record is not the free choice


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_replaying_the_models_own_choice_changes_nothing_bitwise(arch):
    """Records the engine made in float32: a replayed forward equals the free forward,
    log-probs and gradients, bit for bit (the recipe reproduces the router's weights)."""
    policy = moe_policy(arch)
    mb = pack_samples(generate(policy, n=3, count=4))
    grads = {}
    for replay in (True, False):
        policy.model.zero_grad()
        lp = scored(policy, mb, replay=replay, grad=True)
        lp.sum().backward()
        grads[replay] = (lp.detach(), [p.grad.clone() for p in policy.model.parameters()])
        assert policy.routing.last["flipped"] == 0  # the float32 control: routes agree
    assert torch.equal(grads[True][0], grads[False][0])
    assert all(torch.equal(a, b) for a, b in zip(grads[True][1], grads[False][1]))


def test_disagreeing_records_of_a_shared_position_are_counted():
    """Shared prefix: a group's first tokens are all predicted by its prompt's last
    position; when their records disagree the first one is replayed and the others count
    in moe/replay_conflicts."""
    policy = moe_policy()
    samples = generate(policy, n=3, count=2)
    records = random_routes(samples)
    records[1][0] = (
        torch.tensor([[0, 1], [2, 3]])
        if records[0][0][0, 0] > 1
        else torch.tensor([[2, 3], [0, 1]])
    )
    mb = pack_samples(with_routes(samples, records), shared_prefix=True)
    with experts_received(policy.model) as calls:
        scored(policy, mb)
    assert policy.routing.last["conflicts"] == 1
    shared = int(mb.completion_index[0])
    assert torch.equal(used_routes(calls)[shared], as_sets(records[0][0]))


def test_replay_across_micro_batch_boundaries():
    """Every micro-batch of a plan replays its own samples' records."""
    policy = moe_policy()
    samples = generate(policy, n=3, count=6)
    forced = with_routes(samples, random_routes(samples))
    plan = plan_micro_batches([s.num_tokens for s in forced], 40)
    assert len(plan) > 2
    for idx in plan:
        mb = pack_samples([forced[i] for i in idx], sample_indices=idx)
        with experts_received(policy.model) as calls:
            scored(policy, mb)
        assert torch.equal(used_routes(calls)[mb.completion_index], as_sets(mb.routes))


def test_gate_weights_are_recomputed_from_the_current_router_logits():
    """The experts get the recipe's weights over the recorded experts, from this
    forward's router logits; the router's weight gets a gradient through them."""
    policy = moe_policy()
    samples = generate(policy, n=2, count=3)
    mb = pack_samples(with_routes(samples, random_routes(samples)))
    inputs = []
    hooks = [
        r.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach()))
        for r in routers(policy.model)
    ]
    with experts_received(policy.model) as calls:
        lp = scored(policy, mb, grad=True)
    for h in hooks:
        h.remove()
    for layer, router in enumerate(routers(policy.model)):
        indices, weights = calls[layer][0]
        logits = inputs[layer].reshape(-1, router.weight.shape[1]) @ router.weight.detach().T
        probs = torch.softmax(logits.float(), -1).gather(1, indices)
        expected = probs / probs.sum(-1, keepdim=True)  # Qwen3-MoE: norm_topk_prob
        torch.testing.assert_close(weights, expected, rtol=0, atol=1e-6)
    lp.sum().backward()
    for router in routers(policy.model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_the_reference_and_old_passes_replay_too():
    """LoRA's reference (adapters off) and a full fine-tuning reference copy route each
    completion token to its record."""
    for cfg in (
        moe_config(lora={"enabled": True, "r": 4, "alpha": 8}, loss={"beta": 0.1}),
        moe_config(loss={"beta": 0.1}),
    ):
        policy = moe_policy(cfg=cfg)
        samples = generate(policy, n=2, count=3)
        mb = pack_samples(with_routes(samples, random_routes(samples)))
        model = policy.reference if policy.reference is not None else policy.model
        with experts_received(model) as calls:
            reference_logprobs(policy, mb, UNFILTERED, cfg.logprobs)
        assert torch.equal(used_routes(calls)[mb.completion_index], as_sets(mb.routes))


def test_a_forward_nobody_announced_routes_freely():
    """After a replayed scoring forward, any other forward of the model (generation, a
    user's call) is not given the last micro-batch's plan."""
    policy = moe_policy()
    samples = generate(policy, n=2, count=2)
    scored(policy, pack_samples(with_routes(samples, random_routes(samples))))
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9]])
    with torch.no_grad(), experts_received(policy.model) as calls:
        policy.model(input_ids=ids)  # a 7-row forward would not fit the plan: it must be free
    assert len(calls[0]) == 1 and calls[0][0][0].shape == (7, 2)


def test_a_router_that_bypasses_its_hook_is_refused_not_silently_free():
    """A MoE block that calls its router's forward directly (a fused kernel, another
    transformers release) would route freely: the replayed forward refuses it."""
    policy = moe_policy()
    samples = generate(policy, n=2, count=2)
    block = [m for m in policy.model.modules() if type(m).__name__.endswith("SparseMoeBlock")][1]

    def bypassing(hidden):
        flat = hidden.view(-1, hidden.shape[-1])
        _, weights, indices = block.gate.forward(flat)  # no hooks
        return block.experts(flat, indices, weights).view(hidden.shape)

    block.forward = bypassing
    with pytest.raises(RoutingError, match="MoE layer 1's Qwen3MoeTopKRouter was not called"):
        scored(policy, pack_samples(samples))


def test_deep_copies_get_a_control_of_their_own():
    policy = moe_policy()
    clone = copy.deepcopy(policy.model)
    original, copied = routing_of(policy.model), routing_of(clone)
    assert copied is not original and copied.spec == original.spec and copied.replay
    with copied.recording(), torch.no_grad():
        clone(input_ids=torch.tensor([[3, 4, 5]]))
        assert copied.last_routes(1, 3).shape == (1, 2, 2)
    assert all(r is None for r in original._recorded)


# -- checkpointing, offload, LoRA -------------------------------------------------------


@pytest.mark.parametrize(
    "sections",
    [
        {"model": {"gradient_checkpointing": True}},
        {"offload": {"activations": "hidden_states", "keep_last_layers": 0, "min_tensor_bytes": 0}},
    ],
)
def test_replay_under_checkpointing_and_offload_keeps_gradients(sections):
    """A recomputed layer replays the same plan: gradients (policy loss + aux loss) equal
    those without checkpointing, and the statistics are taken once."""
    train = {"router_aux_loss_coef": 0.05}
    model = moe_model()
    samples = generate(moe_policy(), n=2, count=3)
    forced = with_routes(samples, random_routes(samples))
    grads = []
    for cfg in (moe_config(train=train), moe_config(train=train, **sections)):
        policy = build_policy(copy.deepcopy(model), cfg, tokenizer(), torch.device("cpu"))
        mb = pack_samples(forced)
        with experts_received(policy.model) as calls:
            loss = _loss(policy, mb, cfg)
        loss.backward()
        assert torch.equal(used_routes(calls)[mb.completion_index], as_sets(mb.routes))
        grads.append({n: p.grad for n, p in policy.model.named_parameters()})
        assert (
            policy.routing.step_metrics(_OneRank())["moe/route_tokens"] == mb.num_completion_tokens
        )
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


class _OneRank:
    def all_gather_object(self, obj):
        return [obj]


def _loss(policy, mb, cfg):
    from leangrpo.train.inputs import loss_inputs
    from leangrpo.train.loss import compute_loss

    logprobs, entropy = score(policy.model, mb, UNFILTERED, cfg.logprobs, with_entropy=True)
    inputs, _ = loss_inputs(mb, logprobs, entropy, cfg.loss)
    norm = normalisers([mb], cfg.loss, 8)
    out = compute_loss(inputs, norm, cfg.loss)
    return policy.routing.loss_with_aux(out.loss, inputs, norm)


@pytest.mark.parametrize(
    ("targets", "expert_adapters"),
    [(["q_proj", "k_proj", "v_proj", "o_proj"], False), ("all-linear", True)],
)
def test_lora_on_attention_and_on_experts_under_replay(targets, expert_adapters):
    """peft 0.21 puts LoRA on the attention linears, and with 'all-linear' on the
    experts' 3-D weights and the router (ParamWrapper, target_parameters): replay routes
    through its wrappers, and the adapters get gradients."""
    cfg = moe_config(lora={"enabled": True, "r": 4, "alpha": 8, "target_modules": targets})
    policy = moe_policy(cfg=cfg)
    names = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert any("experts" in n for n in names) == expert_adapters
    samples = generate(policy, n=2, count=3)
    mb = pack_samples(with_routes(samples, random_routes(samples)))
    with experts_received(policy.model) as calls:
        lp = scored(policy, mb, grad=True)
    assert torch.equal(used_routes(calls)[mb.completion_index], as_sets(mb.routes))
    (lp * torch.linspace(-1, 1, lp.numel())).sum().backward()
    for name, p in policy.model.named_parameters():
        if p.requires_grad and "lora_B" in name:  # B starts at 0: A's gradient is 0 at first
            assert p.grad is not None and p.grad.abs().sum() > 0, name


# -- the router's auxiliary loss ---------------------------------------------------------


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_aux_loss_equals_transformers_over_real_tokens_and_its_gradient(arch):
    """The packed row's aux loss and its router gradient equal transformers'
    load_balancing_loss_func on the same sequences right-padded, with the attention mask
    (padding never routes)."""
    cfg = moe_config(rollout={"routing_replay": False}, train={"router_aux_loss_coef": 1.0})
    policy = moe_policy(arch, cfg=cfg)
    samples = make_samples([(4, [3, 6]), (6, [2])], vocab=32, seed=1)
    mb = pack_samples(samples)
    lp, _ = score(policy.model, mb, UNFILTERED, cfg.logprobs)
    ours = policy.routing.last["aux_term"]
    ours.backward()
    ours_grad = [r.weight.grad.clone() for r in routers(policy.model)]
    policy.model.zero_grad()

    rows = [s.prompt.ids + s.completion.ids for s in samples]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    model = policy.model
    model.config._attn_implementation = "sdpa"  # transformers' own padded forward
    try:
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    finally:
        model.config._attn_implementation = "leangrpo_packed"
    torch.testing.assert_close(ours.detach(), out.aux_loss.detach(), rtol=1e-5, atol=1e-6)
    out.aux_loss.backward()
    for got, want in zip(ours_grad, (r.weight.grad for r in routers(model))):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_aux_loss_of_a_shared_prefix_row_equals_the_plain_rows(arch):
    """moe_aux_shared_prefix.sh: packing.shared_prefix changed the aux loss, the shared
    row counting a group's prompt once where the plain row holds it G times. Its prompt
    positions now count once per completion: the same loss and router gradient."""
    cfg = moe_config(rollout={"routing_replay": False}, train={"router_aux_loss_coef": 1.0})
    policy = moe_policy(arch, cfg=cfg)
    samples = make_samples([(7, [3, 1, 5]), (2, [4, 2]), (5, [1])], vocab=32, seed=3)
    figures = []
    for shared in (False, True):
        mb = pack_samples(samples, shared_prefix=shared)
        score(policy.model, mb, UNFILTERED, cfg.logprobs)
        term, loss = policy.routing.last["aux_term"], policy.routing.last["aux_loss"]
        term.backward()
        grads = [r.weight.grad.clone() for r in routers(policy.model)]
        figures.append((term.detach(), loss, grads))
        policy.model.zero_grad()
    (plain_term, plain_loss, plain_grads), (term, loss, grads) = figures
    torch.testing.assert_close(term, plain_term, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, plain_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)


def test_aux_loss_is_off_by_default_and_joins_the_step_when_on():
    policy = moe_policy()
    assert policy.routing.aux_coef == 0.0
    mb = pack_samples(generate(policy, n=2, count=2))
    scored(policy, mb, grad=True)
    assert "aux_term" not in policy.routing.last


def test_gpt_oss_is_refused_for_its_attention_sinks():
    """gpt-oss adds learned attention sinks (s_aux) that the packed kernels do not compute:
    its log-probs came out wrong by several nats, silently; now the set-up refuses it."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    from leangrpo.ops.attention.kernels import PackedAttentionError

    config = GptOssConfig(
        vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=16, num_local_experts=4,
        num_experts_per_tok=2, layer_types=["full_attention"] * 2, max_position_embeddings=128,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(PackedAttentionError, match="attention sinks"):
        build_policy(model, moe_config(), None, torch.device("cpu"))
