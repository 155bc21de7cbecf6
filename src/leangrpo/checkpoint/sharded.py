"""Sharded checkpoints with torch.distributed.checkpoint (DCP), and the final model.

A sharded checkpoint is `output_dir/checkpoints/step-N/`:

    dcp/                model + optimizer state: one file per rank and DCP's metadata
    rng-<rank>.pt       each rank's generator states (ranks draw different numbers)
    scheduler.pt        rank 0
    trainer_state.json  rank 0: {"step": N, "world_size": W, ...the trainer's state}
    trainer_state.pt    rank 0 (optional): bulky state, as local.py's
    config.yaml, ...    rank 0: `extra_files`
    COMPLETE            written last, by rank 0: the step and every other file's size and
                        checksum (manifest.py), verified before a resume (rundir.py)

Atomic as local.py: rank 0 creates `checkpoints/.tmp-step-N-<random>/` and broadcasts
its name, every rank writes its part there (DCP and the rng file are fsynced by the rank
that wrote them) and sends rank 0 the record of its own files (sizes and checksums: no
rank reads another's shards), then rank 0 checks that every rank's files are there (each
`rng-<rank>.pt`, every file DCP's metadata names, at least as long as it says, and every
recorded file at its recorded size) and broadcasts the verdict: a file missing (ranks that
do not share one filesystem) stops every rank with one CheckpointError and no COMPLETE
marker. Otherwise rank 0 records the files it wrote, fsyncs the tree, writes COMPLETE
(every rank's record) and renames the directory to `step-N`, and a last barrier keeps
every rank from reading `latest_checkpoint` before the rename. `output_dir` must be one filesystem every rank sees (DCP's
FileSystemWriter needs that too). State dicts come from `get_state_dict` (FQNs of the
unwrapped model, sharded DTensors), so a resume at the same world size is exact; resuming
at another world size is refused, since per-rank RNG streams cannot be split or merged.

The final model is written once, by rank 0, as a plain Hugging Face directory: the full
state dict gathered to rank 0 in host memory (`full_state_dict=True, cpu_offload=True`), or
for LoRA the adapter tensors only, passed to `save_pretrained(state_dict=...)`.

`ShardedCheckpointer` is the trainer's `contracts.Checkpointer` under torchrun. The batch
in progress has the same samples on every rank but per-rank old/reference log-probs (each
rank's micro-batches): they are gathered to rank 0 as `attached_by_rank`, and each rank
takes its own back on resume. See docs/distributed.md ("Checkpoints",
"Sharded checkpoints").
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from leangrpo.checkpoint.local import (
    BULKY_STATE,
    CheckpointError,
    _atomic_directory,
    _prune,
    _remove_stale_tmp,
    _to_json,
    capture_rng_state,
    is_peft_model,
    load_bulky_state,
    restore_rng_state,
    restored,
)
from leangrpo.checkpoint.manifest import (
    COMPLETE,
    Record,
    files_under,
    record_files,
    write_complete,
)
from leangrpo.checkpoint.rundir import write_final_state
from leangrpo.contracts import RestoredCheckpoint
from leangrpo.distributed.context import DistContext
from leangrpo.distributed.fsdp import gather_for_sync
from leangrpo.errors import RunError
from leangrpo.model.final import write_adapter_notes
from leangrpo.model.policy import quiet_transformers_progress


def save_sharded_checkpoint(
    output_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    trainer_state: dict[str, Any],
    keep_last: int,
    ctx: DistContext,
    extra_files: dict[str, str] | None = None,
    bulky_state: dict[str, Any] | None = None,
) -> Path:
    """Every rank calls this; returns `output_dir/checkpoints/step-{step}`.

    `trainer_state`, `extra_files` and `bulky_state` are rank 0's (the other ranks' are
    ignored): pass what is the same on every rank, or gathered to rank 0.
    """
    if keep_last < 1:
        raise CheckpointError(
            f"keep_last must be >= 1 (got {keep_last}); set checkpoint.keep_last."
        )
    state_json = _to_json({**trainer_state, "step": step, "world_size": ctx.world_size})
    root = Path(output_dir) / "checkpoints"
    final = root / f"step-{step}"
    if not ctx.is_main:
        tmp = Path(ctx.broadcast_object(None))
        ctx.gather_to_main(_write_rank_files(tmp, model, optimizer, ctx))  # rank 0 checks ...
        missing = ctx.broadcast_object(None)
        if missing:
            raise CheckpointError(missing)
        ctx.barrier()  # ... renames before this one
        return final
    _remove_stale_tmp(root)
    with _atomic_directory(final) as tmp:
        ctx.broadcast_object(str(tmp))
        own = _write_rank_files(tmp, model, optimizer, ctx)
        if scheduler is not None:
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / "trainer_state.json").write_text(state_json)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
        if bulky_state is not None:
            torch.save(bulky_state, tmp / BULKY_STATE)
        records = ctx.gather_to_main(own)  # every rank has written its files ...
        others = {name: entry for record in records[1:] for name, entry in record.items()}
        missing = _missing_rank_files(tmp, ctx.world_size, others)  # ... where rank 0 sees it
        ctx.broadcast_object(missing)
        if missing:
            raise CheckpointError(missing)
        rest = [name for name in files_under(tmp) if name not in others and name not in own]
        shared = record_files(tmp, rest)
        write_complete(tmp, step, {**others, **own, **shared})
    _prune(root, step, keep_last)
    ctx.barrier()
    return final


def _missing_rank_files(tmp: Path, world_size: int, others: Record | None = None) -> str | None:
    """None when every rank's part of the checkpoint in `tmp` is there (as rank 0 sees
    it: as long as DCP's metadata and the writing rank's record say), else the sentence
    to raise: which files are missing or short."""
    missing = [f"rng-{r}.pt" for r in range(world_size) if not (tmp / f"rng-{r}.pt").is_file()]
    shards = tmp / "dcp"
    if (shards / ".metadata").is_file():
        ends: dict[str, int] = {}  # every file DCP's metadata names -> the bytes it must hold
        for info in dcp.FileSystemReader(shards).read_metadata().storage_data.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
        for name, end in sorted(ends.items()):
            path = shards / name
            if not path.is_file() or path.stat().st_size < end:
                missing.append(f"dcp/{name}")
    else:
        missing.append("dcp/.metadata")
    for name, (size, _) in sorted((others or {}).items()):
        path = tmp / name
        if (not path.is_file() or path.stat().st_size != size) and name not in missing:
            missing.append(name)
    if not missing:
        return None
    listed = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    return (
        f"checkpoint {tmp.name} is incomplete after every rank wrote its part: {listed} "
        f"missing in {tmp}, so it was not marked {COMPLETE}; run.output_dir must be one "
        "filesystem that every rank sees (a shared disk)"
    )


def _write_rank_files(tmp: Path, model: nn.Module, optimizer, ctx: DistContext) -> Record:
    """This rank's DCP shard and RNG file (fsynced); returns their record, read back where
    this rank wrote them (rank 0's DCP metadata is recorded with the files only rank 0
    writes)."""
    state = _sharded_state(model, optimizer)
    dcp.save(state, checkpoint_id=tmp / "dcp")
    rng_file = tmp / f"rng-{ctx.rank}.pt"
    torch.save(capture_rng_state(), rng_file)
    with open(rng_file, "rb") as f:
        os.fsync(f.fileno())
    shards = sorted((tmp / "dcp").glob(f"__{ctx.rank}_*.distcp"))  # DCP's per-rank prefix
    return record_files(tmp, [rng_file.name, *(f"dcp/{shard.name}" for shard in shards)])


def _sharded_state(model: nn.Module, optimizer) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def load_sharded_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    ctx: DistContext,
) -> dict[str, Any]:
    """Every rank calls this on the same path; restores in place, returns the trainer state."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no {COMPLETE} marker); pass a checkpoints/step-N directory written by leangrpo."
        )
    state = json.loads((path / "trainer_state.json").read_text())
    if not (path / "dcp").is_dir():
        raise CheckpointError(
            f"{path} was saved by a single process (no dcp/ directory); resume it without torchrun, or start a fresh distributed run."
        )
    if state.get("world_size") != ctx.world_size:
        raise CheckpointError(
            f"{path} was saved by {state.get('world_size')} ranks but this run has {ctx.world_size}; resume with the same number of processes (torchrun --nproc_per_node/--nnodes)."
        )
    sharded = _sharded_state(model, optimizer)
    dcp.load(sharded, checkpoint_id=path / "dcp")
    set_state_dict(
        model,
        optimizer if optimizer is not None else [],
        model_state_dict=sharded["model"],
        optim_state_dict=sharded.get("optimizer", {}),
    )
    if scheduler is not None:
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    restore_rng_state(torch.load(path / f"rng-{ctx.rank}.pt", weights_only=True))
    return state


def full_model_state(model: nn.Module, ctx: DistContext) -> dict[str, torch.Tensor]:
    """The full state dict on rank 0, in host memory; {} on the other ranks (all call it)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    return state if ctx.is_main else {}


def save_final_sharded(
    output_dir: str | Path,
    model: nn.Module,
    tokenizer: Any | None,
    ctx: DistContext,
    step: int | None = None,
    version: int = 0,
) -> Path:
    """Write `output_dir/final/` once (rank 0), loadable by from_pretrained / PeftModel;
    with `step`, its FINAL_STATE records the step and policy version it holds (rundir.py)."""
    final = Path(output_dir) / "final"
    if is_peft_model(model):  # the adapter only: no need to gather the frozen base
        pairs = gather_for_sync(model, ctx, adapters_only=True, device="cpu")
        state = dict(pairs)
    else:
        state = full_model_state(model, ctx)
    if ctx.is_main:
        _remove_stale_tmp(final.parent, prefix=".tmp-final-")
        with _atomic_directory(final) as tmp, quiet_transformers_progress():
            model.save_pretrained(tmp, state_dict=state)
            write_adapter_notes(model, tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            if step is not None:
                write_final_state(tmp, step, version)
    ctx.barrier()
    return final


class ShardedCheckpointer:
    """`contracts.Checkpointer` under torchrun: every rank calls every method."""

    def __init__(self, output_dir: str | Path, keep_last: int, ctx: DistContext):
        self.output_dir = Path(output_dir)
        self.keep_last = keep_last
        self.ctx = ctx

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any | None,
        trainer_state: dict[str, Any],
        *,
        extra_files: dict[str, str],
        bulky_state: dict[str, Any],
        inflight: dict[str, Any] | None,
    ) -> Path:
        if inflight is not None:  # every rank holds the same batch: all gather, or none
            bulky_state = {**bulky_state, "inflight": inflight_to_save(self.ctx, inflight)}
        return save_sharded_checkpoint(
            self.output_dir, step, model, optimizer, scheduler, trainer_state, self.keep_last,
            self.ctx, extra_files=extra_files, bulky_state=bulky_state,
        )  # fmt: skip

    def load(
        self, path: str | Path, model: nn.Module, optimizer: Any, scheduler: Any
    ) -> RestoredCheckpoint:
        state = load_sharded_checkpoint(path, model, optimizer, scheduler, self.ctx)
        loaded = restored(state, load_bulky_state(path))
        if loaded.inflight is not None:
            loaded.inflight = inflight_to_load(self.ctx, loaded.inflight)
        return loaded

    def save_final(self, model: nn.Module, tokenizer: Any | None, step: int, version: int) -> Path:
        return save_final_sharded(self.output_dir, model, tokenizer, self.ctx, step, version)


def inflight_to_save(ctx: DistContext, state: dict) -> dict:
    """A BatchInProgress state with every rank's attached log-probs (on rank 0)."""
    state = dict(state)
    state["attached_by_rank"] = ctx.gather_to_main(state.pop("attached"))
    return state


def inflight_to_load(ctx: DistContext, state: dict) -> dict:
    """This rank's view of a saved batch in progress."""
    by_rank = state.get("attached_by_rank")
    if by_rank is None or len(by_rank) != ctx.world_size:
        raise RunError(
            "the checkpoint's batch in progress was saved by another number of ranks; "
            "resume with the world size it was written with"
        )
    return {**{k: v for k, v in state.items() if k != "attached_by_rank"},
            "attached": by_rank[ctx.rank]}  # fmt: skip
