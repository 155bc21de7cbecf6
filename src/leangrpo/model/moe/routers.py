"""The routers of a transformers mixture-of-experts model, and how each weighs its experts.

transformers says itself which module produces router logits: a model class's
`_can_record_outputs["router_logits"]` is an `OutputRecorder` naming the router class
(what `output_router_logits=True` records). Every router of the families tested
(Qwen3-MoE, OLMoE; gpt-oss's too) takes the (rows, hidden) tokens of its MoE block and
returns `(router_logits (rows, E), gate weights (rows, k), expert indices (rows, k))`;
the block hands the indices and weights to its experts.

Replaying a route means choosing the experts and recomputing the gate weights over them
from the current router logits, so the router still gets its gradient. The weighting is a
`GateRecipe`, matched per router class at set-up by a probe: the recipe given the
router's own indices must give back its own weights bit for bit (so replaying the route a
router would have taken changes nothing). Known recipes:

- softmax over all experts, then the chosen ones' probabilities (renormalised when the
  router's `norm_topk_prob` is set): Qwen3-MoE, OLMoE, Mixtral-style routers;
- softmax over the chosen experts' logits: gpt-oss.

A router none of them reproduces is refused for replay in one sentence, naming its class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from leangrpo.errors import UserError

GateRecipe = Callable[[nn.Module, Tensor, Tensor], Tensor]  # (router, logits, indices) -> weights


class RoutingError(UserError):
    """A model, router or route record that routing replay cannot use (one sentence)."""


@dataclass(frozen=True)
class RouterSpec:
    """What a route record must fit: one (k,) row of expert indices per MoE layer."""

    layers: int  # MoE layers (routers), in forward order
    top_k: int  # experts per token
    experts: int  # experts per layer
    router_class: str  # the router's class name (messages)


def softmax_then_chosen(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    chosen = probs.gather(-1, indices)
    if getattr(router, "norm_topk_prob", False):
        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
    return chosen.to(logits.dtype)


def softmax_over_chosen(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    return torch.softmax(logits.gather(-1, indices), dim=-1, dtype=logits.dtype)


RECIPES: tuple[GateRecipe, ...] = (softmax_then_chosen, softmax_over_chosen)


def router_class(model: nn.Module) -> type[nn.Module] | None:
    """The class transformers records router logits from (None: not a mixture of experts)."""
    recorders = getattr(type(model), "_can_record_outputs", None) or {}
    recorder = recorders.get("router_logits")
    target = getattr(recorder, "target_class", None)
    return target if isinstance(target, type) else None


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The model's routers in forward order (module order: layer by layer); [] if dense."""
    cls = router_class(model)
    if cls is None:
        return []
    return [m for m in model.modules() if isinstance(m, cls)]


def router_spec(model: nn.Module, routers: list[nn.Module]) -> RouterSpec:
    """Layers, k and experts of `routers`, which must agree (one record shape per token)."""
    shapes = {(_top_k(r), _experts(r)) for r in routers}
    if len(shapes) != 1:
        raise RoutingError(
            f"the model's routers choose different numbers of experts ({sorted(shapes)} as "
            "(k, experts)); routing replay needs one k and one expert count for every MoE layer"
        )
    ((top_k, experts),) = shapes
    return RouterSpec(len(routers), top_k, experts, type(routers[0]).__name__)


def _top_k(router: nn.Module) -> int:
    return int(router.top_k)


def _experts(router: nn.Module) -> int:
    return int(getattr(router, "num_experts", None) or router.weight.shape[0])


def gate_recipe(router: nn.Module) -> GateRecipe:
    """The recipe that gives back `router`'s own gate weights from its own indices, bit
    for bit, on a probe of random tokens; refused (RoutingError) when none does."""
    weight = router.weight
    if weight.device.type == "meta":
        raise RoutingError(
            f"{type(router).__name__} has no weights yet (meta device); install routing on a loaded model"
        )
    generator = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(16, weight.shape[1], generator=generator).to(weight.device, weight.dtype)
    with torch.no_grad():
        out = router(probe)
    if not (isinstance(out, tuple) and len(out) == 3):
        raise RoutingError(
            f"{type(router).__name__} does not return (router_logits, weights, indices); "
            "routing replay cannot force its experts"
        )
    logits, weights, indices = out
    for recipe in RECIPES:
        with torch.no_grad():
            again = recipe(router, logits, indices)
        if again.shape == weights.shape and torch.equal(again, weights):
            return recipe
    raise RoutingError(
        f"{type(router).__name__} weighs its experts in a way routing replay does not know "
        "(neither a softmax over all experts nor one over the chosen ones); turn "
        "rollout.routing_replay off for this model"
    )
