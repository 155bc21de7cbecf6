"""FSDP2 for the policy: sharding, gathered weights for sync, the sharded gradient norm.

Units (`fully_shard` calls, bottom-up, all on one data-parallel mesh):
- every decoder layer (the classes in the model's `_no_split_modules`); LoRA layers inside
  are sharded with it, frozen and trainable parameters mixed in one unit;
- untied models: the input embeddings, and the lm_head, replaced by a `ChunkedLMHead` so
  that the chunked log-probs run inside its forward, where FSDP has gathered the weight;
- the root: a `PackedScorer` around the model (final norm; embeddings and head when tied,
  since one parameter cannot live in two units). Its forward is the packed scoring pass,
  so nothing reads a sharded (DTensor) weight outside a unit's forward.

Strategies: full_shard = reshard after forward; shard_grad_op = keep gathered parameters
from forward to backward; no_shard = a 2-D (replicate=W, shard=1) mesh, i.e. replicated
parameters and all-reduced gradients through the same code path. Gradients are averaged
over ranks (FSDP's default), so losses use per-rank normalisers (global count / W).

Activation checkpointing composes as it is: transformers checkpoints a decoder layer's
`forward`, not its `__call__`, so FSDP's hooks stay outside the checkpointed region and the
recompute in backward does not gather twice; the order of enabling checkpointing and
sharding does not matter. The offload hooks (offload.py) see the same layer inputs.

Weight sync (`gather_for_sync`): every rank gathers every tensor (`full_tensor()`) in the
same fixed order, rank 0 keeps them, and only then does rank 0 send anything, so no
all-gather is ever interleaved with a send (the deadlock of TRL #7103). See
docs/distributed.md ("Units", "Weight sync").
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from leangrpo.contracts import RowSplit
from leangrpo.distributed.context import DistContext
from leangrpo.model.policy import DTYPES, meta_copy
from leangrpo.model.scoring import PackedScorer, causal_lm, install_chunked_head
from leangrpo.ops.context_parallel.shards import WHOLE_ROW

# Prefixes wrappers add to parameter names: checkpoint_wrapper, FSDP1, torch.compile.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """A parameter name as the unwrapped model (and the inference engine) spells it."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def shard_model(
    model: nn.Module,
    dist_cfg,
    ctx: DistContext,
    split: RowSplit = WHOLE_ROW,
    reshard_after_forward: bool | None = None,
) -> PackedScorer:
    """Shard `model` (a transformers causal LM, or a peft model around one) in place.

    Returns the root: call it (or `leangrpo.model.scoring.score(root, ...)`) for log-probs. Build the
    optimizer after this, over the model's (now DTensor) parameters. Needs the process
    group of `init_distributed` (world size >= 2); a single process is never sharded.
    `split`: how the root's scoring pass splits a row over a context-parallel group
    (distributed/mesh.py; the whole row without one). Parameters are sharded over every
    process (the data x context mesh flattened) either way. `reshard_after_forward`:
    whether the units free their gathered parameters after their forward (None: as
    distributed.sharding says, full_shard).
    """
    if not ctx.distributed:
        raise ValueError(
            "shard_model needs several ranks (torchrun); a single process is not sharded"
        )
    head = install_chunked_head(model)
    embed = causal_lm(model).get_input_embeddings()
    units = dict(
        mesh=_mesh(ctx, dist_cfg.sharding),
        mp_policy=_mixed_precision(dist_cfg),
        offload_policy=_offload_policy(dist_cfg, ctx),
    )
    reshard = reshard_after_forward
    if reshard is None:
        reshard = dist_cfg.sharding == "full_shard"
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard, **units)
    if embed.weight is not head.weight:  # untied: each big matrix is its own unit
        fully_shard(embed, reshard_after_forward=reshard, **units)
        fully_shard(head, reshard_after_forward=reshard, **units)
    scorer = PackedScorer(model, split)
    fully_shard(scorer, **units)  # root: stays gathered from forward to backward
    return scorer


def reshard(module: nn.Module) -> None:
    """Free every gathered parameter of `module`'s FSDP units (no collective).

    FSDP2 reshards a unit after its backward, and after its forward only when
    `reshard_after_forward` holds, which it never does for the root: after a no-grad pass
    (old and reference log-probs) the root, with the embeddings, a tied lm_head and the
    final norm, and under shard_grad_op every unit, would stay gathered until the next
    backward, which a frozen reference never has.
    """
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks, named by transformers' `_no_split_modules`."""
    lm = causal_lm(model)
    names = set(getattr(lm, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not layers:
        raise TypeError(
            f"{type(lm).__name__} names no decoder-layer class in _no_split_modules; "
            "leangrpo cannot tell which blocks to shard"
        )
    return layers


def _mesh(ctx: DistContext, sharding: str):
    """The data-parallel mesh, built on the default group so that it has its timeout.

    (init_device_mesh may create new groups, which get torch's default timeout.) no_shard is
    a (W, 1) mesh: replicate over every rank, shard over a group of one.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    kind = ctx.device.type
    if sharding != "no_shard":
        return DeviceMesh.from_group(dist.group.WORLD, kind, mesh_dim_names=("shard",))
    timeout = timedelta(seconds=ctx.timeout_s)
    alone = [dist.new_group([r], timeout=timeout) for r in range(ctx.world_size)]  # collective
    return DeviceMesh.from_group(
        [dist.group.WORLD, alone[ctx.rank]],
        kind,
        mesh=torch.arange(ctx.world_size).view(ctx.world_size, 1),
        mesh_dim_names=("replicate", "shard"),
    )


def _mixed_precision(dist_cfg) -> MixedPrecisionPolicy:
    if dist_cfg.param_dtype == "off":
        return MixedPrecisionPolicy()
    param = DTYPES[dist_cfg.param_dtype]
    reduce = torch.float32 if dist_cfg.reduce_dtype == "float32" else param
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)


def _offload_policy(dist_cfg, ctx: DistContext) -> OffloadPolicy:
    if not dist_cfg.cpu_offload:
        return OffloadPolicy()
    if ctx.device.type != "cuda":
        raise ValueError(
            "distributed.cpu_offload moves sharded state from the GPU to host memory, but "
            "these ranks already run on the CPU; set distributed.cpu_offload: false"
        )
    return CPUOffloadPolicy(pin_memory=True)


# ------------------------------------------------------------------------ weights for sync


def gather_for_sync(
    model: nn.Module,
    ctx: DistContext,
    *,
    adapters_only: bool,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    to_all: bool = False,
) -> list[tuple[str, torch.Tensor]]:
    """Full tensors to send to the engine: on rank 0 a list, on the other ranks [] (or,
    with `to_all`, the same list on every rank: per-rank engines each need them).

    Every rank must call it (each DTensor is all-gathered). Names and order are those of
    `Policy.named_trainable_tensors` on the unsharded model: the trainable parameters for
    LoRA (the adapter), the whole state dict otherwise; wrapper prefixes are stripped.
    Tensors are cast to `dtype` (the engine's) and moved to `device` (default: where they
    were gathered). Tied weights are gathered once and listed under each of their names.
    """
    named = iter_gathered(
        model, ctx, adapters_only=adapters_only, dtype=dtype, device=device, to_all=to_all
    )
    return list(named)


def iter_gathered(
    model: nn.Module,
    ctx: DistContext,
    *,
    adapters_only: bool,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    to_all: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`gather_for_sync` one tensor at a time: each is gathered when the caller asks for
    it, and a tied one is kept only until its last name, so a consumer that copies each
    into its own model (a per-rank engine) never holds a second full copy. Every rank must
    consume it to the end (one all-gather per tensor); ranks other than 0 yield nothing
    unless `to_all`."""
    if adapters_only:
        entries = [(n, p.detach()) for n, p in model.named_parameters() if p.requires_grad]
    else:
        entries = list(model.state_dict().items())
    keep = ctx.is_main or to_all
    keys = [_storage_key(tensor) for _, tensor in entries]  # the same on every rank
    uses_left = {key: keys.count(key) for key in keys}
    gathered: dict[tuple, torch.Tensor | None] = {}
    for (name, tensor), key in zip(entries, keys):
        if key not in gathered:
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            gathered[key] = full.to(dtype=dtype or full.dtype, device=device or full.device)
            if not keep:
                gathered[key] = None  # gathered only to take part; dropped at once
        uses_left[key] -= 1
        value = gathered[key] if uses_left[key] else gathered.pop(key)
        if keep:
            yield clean_name(name), value


def _storage_key(t: torch.Tensor) -> tuple:
    local = t.to_local() if isinstance(t, DTensor) else t
    return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(t.shape))


# ------------------------------------------------------------------------- optimizer step


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float | None) -> float:
    """Clip to `max_norm` (None: measure only); returns the global norm on every rank.

    Sharded gradients are DTensors: their norm is reduced over ranks before clipping.
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


def local_param_bytes(model: nn.Module) -> int:
    """Bytes of this rank's parameter shards (full sharding divides the total by W)."""
    total = 0
    for p in model.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        total += t.numel() * t.element_size()
    return total


def shard_policy(policy, dist_cfg, ctx: DistContext, split: RowSplit = WHOLE_ROW) -> None:
    """Shard a loaded policy in place: `policy.root` becomes its FSDP root, and a full
    fine-tuning reference (beta > 0) and a distillation teacher are sharded the same way
    (no full copy per rank; the teacher, loaded whole, keeps only its shards, and
    frees each unit's gathered parameters after its forward under shard_grad_op too: a
    frozen teacher has no backward to keep them for). A
    reference still on the meta device (`model.meta_copy`) is sharded there and its shards
    are then copied from the policy's: the same values, never a second full copy. Build
    the optimizer afterwards. `split`: the scoring passes' row split (`shard_model`)."""
    policy.root = shard_model(policy.model, dist_cfg, ctx, split)
    if policy.teacher is not None:  # a distillation teacher: sharded like the reference,
        # each unit resharded after its forward whatever the sharding (it has no backward)
        resharded = dist_cfg.sharding != "no_shard"
        policy.teacher = shard_model(policy.teacher, dist_cfg, ctx, split, resharded)
    if policy.reference is not None:
        on_meta = any(p.is_meta for p in policy.reference.parameters())
        reference = shard_model(policy.reference, dist_cfg, ctx, split)
        if on_meta:
            _copy_shards(reference, policy.root)
        policy.reference = reference


def shard_for_training(
    policy, dist_cfg, ctx: DistContext, engine_copy: bool, split: RowSplit = WHOLE_ROW
) -> nn.Module | None:
    """Shard `policy` (and its reference) in place; with `engine_copy` (the per-rank hf
    engine) return the rank's own unsharded copy for it (`unsharded_copy`), else None.

    The copy's structure is taken before sharding (`model.meta_copy`: the policy as built,
    with its plain lm_head), its tensors after, from the shards: a rank holds at most one
    full copy of the weights at any moment of the set-up."""
    structure = meta_copy(policy.model) if engine_copy else None
    shard_policy(policy, dist_cfg, ctx, split)
    if structure is None:
        return None
    return unsharded_copy(structure, policy.model, policy.device)


def _copy_shards(target: nn.Module, source: nn.Module) -> None:
    """Give `target` (sharded on the meta device) storage for its shards where `source`'s
    live, and copy `source`'s shards (the same model, sharded alike) into them; buffers
    (real already) are kept."""
    buffers = [(m, n, b) for m in target.modules() for n, b in m._buffers.items() if b is not None]
    shards = {clean_name(n): p for n, p in source.named_parameters()}
    target.to_empty(device=_local(next(iter(shards.values()))).device)
    for module, name, buffer in buffers:
        module._buffers[name] = buffer
    with torch.no_grad():
        for name, param in target.named_parameters():
            _local(param).copy_(_local(shards[clean_name(name)]))


def unsharded_copy(meta_model: nn.Module, sharded: nn.Module, device) -> nn.Module:
    """Fill `meta_model`, a `model.meta_copy` of `sharded` taken before it was sharded,
    with whole tensors gathered from its shards, one tensor at a time (each gathered
    tensor becomes the copy's parameter: no second full copy exists meanwhile). The per-
    rank hf engine's own copy. Every rank must call it (one all-gather per tensor, in the
    same order)."""
    sources = {clean_name(n): p for n, p in sharded.named_parameters()}
    whole: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for name, param in meta_model.named_parameters():
            source = sources[clean_name(name)]
            full = source.full_tensor() if isinstance(source, DTensor) else source.clone()
            whole[id(param)] = nn.Parameter(full.to(device), requires_grad=param.requires_grad)
    for module in meta_model.modules():  # tied parameters: every module holding one
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in whole:
                module._parameters[name] = whole[id(param)]
    return meta_model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def tensor_bytes_alive() -> dict[str, int]:
    """Bytes of the distinct tensor storages alive in this process (a walk over the
    garbage collector's objects, slow: for tests and benchmarks, never in a run), split
    into FSDP shards (DTensor local tensors) and whole tensors; meta tensors hold none."""
    import gc

    shards: dict[int, int] = {}
    whole: dict[int, int] = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.is_meta:
            continue
        into, tensor = (shards, obj.to_local()) if isinstance(obj, DTensor) else (whole, obj)
        if tensor.is_meta:
            continue
        storage = tensor.untyped_storage()
        into[storage.data_ptr()] = storage.nbytes()
    for ptr in shards:
        whole.pop(ptr, None)  # a shard's local tensor is also seen as a plain tensor
    return {"shards": sum(shards.values()), "whole": sum(whole.values())}
