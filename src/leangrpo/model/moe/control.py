"""Hooks on a mixture-of-experts model's routers: record routes, replay them, measure
flips, and gather the router's auxiliary load-balancing loss over real tokens.

`install_routing(model, replay=, aux_coef=)` registers, with torch's public hooks on the
loaded model (nothing patched at import), a forward hook on every router (routers.py) and
a forward pre-hook on the decoder, and hangs a `RoutingControl` on the model
(`routing_of`). A deep copy of the model (the hf engine's own copy, a full fine-tuning
reference, torchrun's unsharded engine copy) gets a fresh control of its own. What the
hooks do is set by whoever runs the forward:

- Engine forwards (`recording()`): each router's experts are kept; `last_routes(rows,
  width)` gives (rows, layers, k) at each row's last position, the one whose hidden state
  predicts the token sampled next (routes.py).
- Scoring forwards (`prepare(row, padding)` right before the decoder runs on a packed
  row): the row's recorded routes are laid at their predicting positions; prompt and
  environment tokens (every other position) route as the forward decides. With replay,
  such a position's router output is replaced by the recorded experts and gate weights
  recomputed over them from its current logits (the recipe routers.py matched), so the
  router keeps its gradient; without replay, routing is only compared with the record.
  The plan stays set after the forward, because gradient checkpointing runs each layer's
  forward again during backward; the next decoder forward not announced by `prepare`
  (a generation step, any other call) clears it and routes freely.
- Statistics are taken at a router's first call after `prepare`; a checkpointing
  recompute repeats the same tensor operations (checkpointing matches saved tensors by
  order) and records nothing. `finish(row, split)` sums them over a context-parallel
  group (one collective of a few hundred numbers) into `last`: flipped tokens (a token
  flips when the experts its position's router would choose differ, as a set, from the
  record in any layer), flipped (token, layer) pairs, shared positions whose records
  disagree (shared prefix: the first record is used), and the auxiliary loss.

Auxiliary loss (`train.router_aux_loss_coef`; off by default): transformers'
`load_balancing_loss_func` over the micro-batch's real tokens only (context-parallel
padding never counts): E x sum_e f_e P_e, f_e the share of (token, layer, slot)
assignments to expert e (the experts used: the replayed ones where routes are replayed),
P_e the mean router probability of e over tokens and layers. Every token of every
sequence counts, prompt tokens included, as transformers counts them in a padded batch;
in a shared-prefix row (packing.shared_prefix) a group's prompt is laid once for its G
completions, so its positions count G times (`LocalRow.sequences_per_position`): the
loss is the plain layout's, whichever layout packs the micro-batch (a position shared by
G sequences routes as each of their copies would: the same tokens, the same causal
context). Under context parallelism
each rank holds its tokens' probabilities: its term is E x sum_e f_e(group) P_e(own)
with the group's counts, so the ranks' terms add up to the loss and each rank's gradient
is its own tokens' share (as the log-probs' gather does). The trainer adds
coef x (the micro-batch's share of the step's loss tokens) x that term to each
micro-batch's loss (`loss_with_aux`), so the step's aux loss is the token-weighted mean
of its micro-batches'. It is not linear in a micro-batch's tokens: it depends on how a
step is cut into micro-batches (as in every framework that computes it per forward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from leangrpo.model.moe.routers import (
    GateRecipe,
    RouterSpec,
    RoutingError,
    find_routers,
    gate_recipe,
    router_spec,
)
from leangrpo.model.moe.routes import check_routes, route_dtype

ATTRIBUTE = "leangrpo_routing"  # the control's attribute on the transformers model
# per forward, summed over a context-parallel group: flipped tokens, route tokens,
# flipped (token, layer) pairs, disagreeing shared records
FLIP_FIELDS = 4


class RoutingControl:
    """See the module docstring. One per model object; one thread drives its forwards."""

    def __init__(self, spec: RouterSpec, recipe: GateRecipe | None, aux_coef: float):
        self.spec = spec
        self.recipe = recipe  # None: replay off (routes are only compared)
        self.replay = recipe is not None
        self.aux_coef = aux_coef
        self.recording_routes = False
        self._recorded: list[Tensor | None] = [None] * spec.layers
        self._announced = False
        self._clear_plan()
        self.last: dict[str, Tensor] = {}
        self._step: dict[str, Tensor] = {}

    def __deepcopy__(self, memo: dict) -> RoutingControl:
        return RoutingControl(self.spec, self.recipe, self.aux_coef)

    # -- engines ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Keep every router's experts of each forward inside (generation)."""
        self.recording_routes = True
        try:
            yield
        finally:
            self.recording_routes = False
            self._recorded = [None] * self.spec.layers

    def last_routes(self, rows: int, width: int) -> Tensor:
        """(rows, layers, k) experts of the last forward at each row's last position."""
        if any(r is None for r in self._recorded):
            raise RuntimeError("last_routes: the last forward did not pass every router")
        k = self.spec.top_k
        last = [r.view(rows, width, k)[:, -1] for r in self._recorded]  # type: ignore[union-attr]
        return torch.stack(last, dim=1).to(route_dtype(self.spec.experts))

    # -- scoring ---------------------------------------------------------------------------
    def check_samples(self, samples: list) -> None:
        """Refuse, before anything is packed, a sample whose route record does not fit this
        model, or (replay on) a sample without one."""
        for i, sample in enumerate(samples):
            completion, where = sample.completion, f"sample {i} (group {sample.group_id})"
            if completion.routes is not None:
                check_routes(completion.routes, completion.num_model_tokens, self.spec, where)
            elif self.replay:
                raise RoutingError(
                    f"{where} has no route record; with rollout.routing_replay every sample "
                    "must come from an engine that reports routes"
                )

    def prepare(self, row: Any, padding: bool = False) -> None:
        """Announce the scoring forward of a (local) packed row: its routes' plan, its
        real tokens, fresh statistics. A replay run refuses a row without routes (unless
        it is torchrun's padding micro-batch)."""
        self._clear_plan()
        self.last = {}
        self._announced = True
        self._real = row.real_tokens
        self._shared = row.sequences_per_position
        routes = row.routes
        if routes is None:
            if self.replay and not padding and row.num_targets > 0:
                raise RoutingError(
                    "a scoring forward of a routing-replay run got samples without route "
                    "records; every sample must come from an engine that reports routes"
                )
            return
        if tuple(routes.shape[1:]) != (self.spec.layers, self.spec.top_k):
            check_routes(routes, routes.shape[0], self.spec, "a packed micro-batch")
        self._plan, self._mask, self._conflicts = _plan(routes, row.completion_index,
                                                         row.input_ids.shape[1])  # fmt: skip
        n = row.input_ids.shape[1]
        self._flipped = torch.zeros(n, dtype=torch.bool, device=routes.device)
        self._layer_flips = torch.zeros(n, dtype=torch.int64, device=routes.device)

    def finish(self, row: Any, split: Any) -> None:
        """After the forward: this row's statistics, summed over the split's group, in
        `last` (see the module docstring)."""
        if self._plan is not None and not all(self._calls):
            layer = self._calls.index(0)
            raise RoutingError(
                f"MoE layer {layer}'s {self.spec.router_class} was not called through its module "
                "in a replayed forward, so its routes could not be replayed; this model's MoE "
                "blocks bypass their routers' hooks: turn rollout.routing_replay off"
            )
        parts, aux = [], self.aux_coef > 0 and all(c is not None for c in self._aux_counts)
        if self._plan is not None:
            index = row.completion_index
            parts.append(
                torch.stack(
                    [
                        self._flipped[index].sum(),
                        torch.tensor(index.numel(), device=index.device),
                        self._layer_flips[index].sum(),
                        self._conflicts,
                    ]
                ).float()
            )
        if aux:
            counts = torch.stack(self._aux_counts)  # type: ignore[arg-type]
            probs = torch.stack(self._aux_probs)  # type: ignore[arg-type]
            parts += [counts.flatten(), probs.detach().flatten()]
        if not parts:
            return
        summed = split.sum_over_group(torch.cat(parts))
        if self._plan is not None:
            names = ("flipped", "route_tokens", "layer_flips", "conflicts")
            self.last.update(dict(zip(names, summed[:FLIP_FIELDS])))
            summed = summed[FLIP_FIELDS:]
        if aux:
            self._finish_aux(summed, probs)

    def _finish_aux(self, summed: Tensor, probs: Tensor) -> None:
        layers, experts = self.spec.layers, self.spec.experts
        counts, probs_all = summed.view(2, layers, experts)
        tokens = counts.sum() / self.spec.top_k  # the row's real tokens x layers (the group's)
        f = counts.sum(0) / tokens
        self.last["aux_term"] = experts * (f * probs.sum(0) / tokens).sum()  # with grad
        self.last["aux_loss"] = experts * (f * probs_all.sum(0) / tokens).sum()

    @contextlib.contextmanager
    def unforced(self) -> Iterator[None]:
        """Scoring forwards inside compare routes with their records, never replay them."""
        replay, self.replay = self.replay, False
        try:
            yield
        finally:
            self.replay = replay

    # -- the optimizer step ----------------------------------------------------------------
    def loss_with_aux(self, loss: Tensor, inputs: Any, norm: Any) -> Tensor:
        """The micro-batch's loss for backward: the policy loss plus its share of the aux
        loss (when on); the micro-batch's routing figures join the step's."""
        last, tokens = self.last, inputs.mask.sum()
        for name in ("flipped", "route_tokens", "layer_flips", "conflicts"):
            if name in last:
                self._add(name, last[name])
        if "aux_term" not in last:
            return loss
        self._add("aux_weighted", last["aux_loss"].detach() * tokens)
        self._add("aux_tokens", tokens.float())
        return loss + self.aux_coef * (tokens / norm.tokens) * last["aux_term"]

    def _add(self, name: str, value: Tensor) -> None:
        self._step[name] = self._step[name] + value if name in self._step else value.detach()

    def step_metrics(self, ranks: Any) -> dict[str, float]:
        """The step's `moe/*` figures over every share (one all-gather), then reset."""
        names = sorted(self._step)
        local = torch.stack([self._step[n].float() for n in names]).tolist() if names else []
        self._step = {}
        totals: dict[str, float] = {}
        for share in ranks.all_gather_object(dict(zip(names, local))):
            for name, value in share.items():
                totals[name] = totals.get(name, 0.0) + value
        return moe_metrics(totals, self.spec.layers)

    # -- the hooks -------------------------------------------------------------------------
    def forward_starts(self) -> None:
        """The decoder's pre-hook: a forward `prepare` did not announce routes freely."""
        if self._announced:
            self._announced = False
        elif self._plan is not None or self._real is not None:
            self._clear_plan()

    def routed(self, layer: int, router: nn.Module, output: tuple) -> tuple | None:
        """A router's forward hook: record, replay or compare; gather statistics."""
        logits, weights, indices = output
        if self.recording_routes:
            self._recorded[layer] = indices.detach()
            return None
        first = self._calls[layer] == 0
        self._calls[layer] += 1
        used_indices, used_weights = indices, weights
        if self._plan is not None:
            if logits.shape[0] != self._plan.shape[1]:
                raise RoutingError(
                    f"a packed forward of {self._plan.shape[1]} tokens reached "
                    f"{self.spec.router_class} with {logits.shape[0]} rows; routes replay on "
                    "leangrpo's packed attention path only (this model runs a padded view)"
                )
            forced = self._plan[layer]
            if first:
                self._compare(indices, forced)
            if self.replay:  # a free row's recipe gives back its own weights, bit for bit
                used_indices = torch.where(self._mask[:, None], forced, indices)
                used_weights = self.recipe(router, logits, used_indices)  # type: ignore[misc]
        if self.aux_coef > 0 and torch.is_grad_enabled():
            self._aux_statistics(layer, logits, used_indices, first)
        if used_indices is indices:
            return None
        return logits, used_weights, used_indices

    def _compare(self, indices: Tensor, forced: Tensor) -> None:
        """Rows whose own k experts are not the record's k (both distinct: a set test)."""
        with torch.no_grad():
            kept = (forced[:, :, None] == indices[:, None, :]).any(dim=-1).all(dim=-1)
            differs = ~kept & self._mask  # type: ignore[operator]
            self._flipped |= differs
            self._layer_flips += differs

    def _aux_statistics(self, layer: int, logits: Tensor, indices: Tensor, first: bool) -> None:
        """(E,) assignments and summed probabilities over the real positions, each weighted
        by the sequences it belongs to (a shared prompt's: its group's completions)."""
        real = logits.shape[0] if self._real is None else self._real
        probs = torch.softmax(logits[:real].float(), dim=-1)  # (real, E), with grad
        shared = self._shared
        probs = (probs if shared is None else probs * shared[:, None]).sum(dim=0)
        with torch.no_grad():
            chosen = indices[:real]
            per = torch.ones(real, device=logits.device) if shared is None else shared
            counts = torch.zeros(self.spec.experts, device=logits.device)
            counts.index_add_(0, chosen.reshape(-1), per[:, None].expand_as(chosen).reshape(-1))
        if first:
            self._aux_counts[layer], self._aux_probs[layer] = counts, probs

    def _clear_plan(self) -> None:
        layers = self.spec.layers
        self._plan: Tensor | None = None  # (layers, n, k) int64, -1 where free
        self._mask: Tensor | None = None  # (n,) positions with a route
        self._conflicts: Tensor | None = None
        self._real: int | None = None
        self._shared: Tensor | None = None  # (real,) sequences per position (shared prefix)
        self._calls = [0] * layers
        self._aux_counts: list[Tensor | None] = [None] * layers
        self._aux_probs: list[Tensor | None] = [None] * layers


def _plan(routes: Tensor, index: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """(layers, n, k) experts per position (-1: free), the positions with a route, and how
    many tokens' records disagree with the one laid at their (shared) position: with a
    shared prefix every completion's first token is predicted by the prompt's last
    position, where the first record is used."""
    routes = routes.to(index.device, torch.int64)
    layers, k = routes.shape[1], routes.shape[2]
    plan = torch.full((n, layers, k), -1, dtype=torch.int64, device=index.device)
    ordered, order = torch.sort(index, stable=True)
    later = torch.zeros_like(index, dtype=torch.bool)
    later[order[1:]] = ordered[1:] == ordered[:-1]
    plan[index[~later]] = routes[~later]
    conflicts = (plan[index] != routes).flatten(1).any(dim=1).sum()
    mask = plan[:, 0, 0] >= 0
    return plan.permute(1, 0, 2).contiguous(), mask, conflicts


def moe_metrics(totals: dict[str, float], layers: int) -> dict[str, float]:
    """`moe/*` figures from the step's totals over shares."""
    out = {}
    tokens = totals.get("route_tokens", 0.0)
    if "route_tokens" in totals:
        out["moe/route_tokens"] = tokens
        out["moe/routing_flips"] = totals["flipped"] / tokens if tokens else 0.0
        out["moe/routing_flips_layer"] = (
            totals["layer_flips"] / (tokens * layers) if tokens else 0.0
        )
        out["moe/replay_conflicts"] = totals["conflicts"]
    if totals.get("aux_tokens"):
        out["moe/aux_loss"] = totals["aux_weighted"] / totals["aux_tokens"]
    return out


class _RouterHook:
    """A router's forward hook: the control and the router's layer index (deep-copied
    with the model, so a copy's hooks drive the copy's control)."""

    def __init__(self, control: RoutingControl, layer: int):
        self.control, self.layer = control, layer

    def __call__(self, module: nn.Module, args: tuple, output: tuple) -> tuple | None:
        return self.control.routed(self.layer, module, output)


class _DecoderHook:
    def __init__(self, control: RoutingControl):
        self.control = control

    def __call__(self, module: nn.Module, args: tuple) -> None:
        self.control.forward_starts()


def _transformers_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def install_routing(model: nn.Module, *, replay: bool, aux_coef: float) -> RoutingControl | None:
    """Hooks for routing replay (`replay`) and the aux loss (`aux_coef` > 0) on a loaded
    model (before LoRA and before any copy is made); None when neither is asked. A model
    without routers is refused when one is."""
    if not replay and aux_coef <= 0:
        return None
    lm = _transformers_model(model)
    if isinstance(getattr(lm, ATTRIBUTE, None), RoutingControl):
        raise RoutingError("this model has routing hooks installed already (one policy per model)")
    routers = find_routers(lm)
    if not routers:
        asked = "rollout.routing_replay" if replay else "train.router_aux_loss_coef"
        raise RoutingError(
            f"{asked} needs a mixture-of-experts model; {type(lm).__name__} has no router"
        )
    spec = router_spec(lm, routers)
    classes = {type(r) for r in routers}
    recipe = gate_recipe(routers[0]) if replay else None
    if replay and len(classes) > 1:
        for router in routers[1:]:
            if gate_recipe(router) is not recipe:
                raise RoutingError("the model's routers weigh their experts in different ways")
    control = RoutingControl(spec, recipe, aux_coef)
    for layer, router in enumerate(routers):
        router.register_forward_hook(_RouterHook(control, layer))
    lm.get_decoder().register_forward_pre_hook(_DecoderHook(control))
    setattr(lm, ATTRIBUTE, control)
    return control


class NoRouting:
    """A dense model's (or a run without replay and aux loss): nothing to do."""

    replay = False
    spec = None
    last: dict = {}  # no figures (never written)

    def check_samples(self, samples: list) -> None:
        if any(s.completion.routes is not None for s in samples):
            raise RoutingError(NOT_INSTALLED)

    def prepare(self, row: Any, padding: bool = False) -> None:
        if row.routes is not None:
            raise RoutingError(NOT_INSTALLED)

    def finish(self, row: Any, split: Any) -> None:
        return None

    def loss_with_aux(self, loss: Tensor, inputs: Any, norm: Any) -> Tensor:
        return loss

    def step_metrics(self, ranks: Any) -> dict[str, float]:
        return {}

    @contextlib.contextmanager
    def unforced(self) -> Iterator[None]:
        yield


NOT_INSTALLED = (
    "samples carry route records but this policy has no routing replay installed; set "
    "rollout.routing_replay: true (a mixture-of-experts model)"
)
NO_ROUTING = NoRouting()


def routing_of(model: nn.Module) -> RoutingControl | NoRouting:
    """The control installed on `model` (a transformers model or its peft wrapper), else
    NO_ROUTING."""
    control = getattr(_transformers_model(model), ATTRIBUTE, None)
    return control if isinstance(control, RoutingControl) else NO_ROUTING
