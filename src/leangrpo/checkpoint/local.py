"""Atomic checkpoints and exact resume.

A checkpoint is `output_dir/checkpoints/step-N/`:

    model/              peft adapter (save_pretrained) or full weights (safetensors)
    optimizer.pt        optimizer.state_dict()
    scheduler.pt        scheduler.state_dict()
    rng.pt              python, numpy, torch CPU (and CUDA) generator states
    trainer_state.json  {"step": N, ...whatever JSON-able state the trainer passes}
    config.yaml         the run's resolved config (compared with the config of a resume)
    trainer_state.pt    bulky state (optional): the batch being trained on, the replay buffer,
                        ...; tensors, lists, dicts, numbers and strings (`torch.save`)
    COMPLETE            written last: the step and every other file's size and checksum
                        (manifest.py), verified before a resume (rundir.py)

Atomicity: everything is written into `checkpoints/.tmp-step-N-<random>/`, every file and
directory is fsynced, `COMPLETE` is the last file written, then the directory is renamed to
`step-N` and the parent fsynced. A crash at any point leaves either no `step-N` or a
complete one. `latest_checkpoint` only accepts `step-N` directories holding `COMPLETE`.
A save that fails removes its `.tmp-*` directory; one a killed process left is removed by
the next save.

A full disk: before writing, the disk's free space is held to the tensors the save writes
(the weights saved, the optimizer's state: a lower bound), and a save refused there, or one
whose writes filled the disk all the same (torch's writer reports it as a RuntimeError), is
a `DiskFullError` of one sentence (exit 2), nothing of it left behind: the earlier
checkpoints are intact and a rerun resumes from the newest.

Choices:
- Full models are saved with `save_original_format=False` (transformers 5), so the files
  hold exactly `model.state_dict()`'s keys and reload with `load_state_dict`. Tied
  weights, which save_pretrained stores once, are accepted as missing.
- Saving step N deletes complete checkpoints with a step above N. They belong to a history
  abandoned by resuming from an older checkpoint, and `latest_checkpoint` must not pick
  them. Then only the newest `keep_last` are kept.
- Everything is loaded with `torch.load(weights_only=True)`. The RNG states are stored as
  tensors and tuples so that this works, and `sample_state` turns the rollout samples a
  checkpoint holds into such plain data.
  A prompt's extra columns are not kept: they only feed reward functions, and a saved
  sample has been scored already.
- Only one process (rank 0) may call these functions. FSDP-sharded models must be gathered
  first.

`LocalCheckpointer` is the trainer's `contracts.Checkpointer` for a single process
(sharded.py's `ShardedCheckpointer` the torchrun one); the batch in progress goes into
trainer_state.pt as `inflight`. See docs/checkpoints.md ("Exact resume").
"""

from __future__ import annotations

import dataclasses
import errno
import inspect
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from leangrpo.checkpoint.manifest import COMPLETE, record_files, write_complete
from leangrpo.checkpoint.rundir import complete_checkpoints, write_final_state

# Finding checkpoints needs no torch: the CLI does it before the model loads (rundir.py).
from leangrpo.contracts import Completion, Prompt, RestoredCheckpoint, RolloutSample, Trajectory
from leangrpo.errors import UserError
from leangrpo.model.final import write_adapter_notes
from leangrpo.model.policy import quiet_transformers_progress

BULKY_STATE = "trainer_state.pt"

__all__ = [
    "BULKY_STATE",
    "CheckpointError",
    "DiskFullError",
    "LocalCheckpointer",
    "capture_rng_state",
    "is_peft_model",
    "load_bulky_state",
    "load_checkpoint",
    "load_model_weights",
    "restore_rng_state",
    "save_checkpoint",
    "save_final_model",
    "save_model_weights",
]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or does not fit the model being resumed."""


class DiskFullError(UserError, OSError):
    """The disk of run.output_dir cannot hold the checkpoint (or final model) being saved;
    nothing of it is left behind."""


# -- public API -----------------------------------------------------------------------------


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    trainer_state: dict[str, Any],
    keep_last: int,
    extra_files: dict[str, str] | None = None,
    bulky_state: dict[str, Any] | None = None,
) -> Path:
    """Write `output_dir/checkpoints/step-{step}/` atomically; return its path.

    `trainer_state` goes to trainer_state.json (small, readable); `bulky_state`, when
    given, to trainer_state.pt (plain data and tensors, see `sample_state`);
    `extra_files` maps file names to text written alongside (e.g. the run's config.yaml).
    """
    if keep_last < 1:
        raise CheckpointError(
            f"keep_last must be >= 1 (got {keep_last}); set checkpoint.keep_last."
        )
    if trainer_state.get("step", step) != step:
        raise CheckpointError(
            f"trainer_state['step'] = {trainer_state['step']} disagrees with step = {step}."
        )
    state_json = _to_json({**trainer_state, "step": step})
    root = Path(output_dir) / "checkpoints"
    _remove_stale_tmp(root)
    what = f"the checkpoint at step {step}"
    needed = saved_bytes(model) + optimizer_bytes(optimizer)
    with _atomic_directory(root / f"step-{step}", what, needed) as tmp:
        save_model_weights(model, tmp / "model", for_resume=True)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        if scheduler is not None:
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(capture_rng_state(), tmp / "rng.pt")
        (tmp / "trainer_state.json").write_text(state_json)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
        if bulky_state is not None:
            torch.save(bulky_state, tmp / BULKY_STATE)
        write_complete(tmp, step, record_files(tmp))
    _prune(root, step, keep_last)
    return root / f"step-{step}"


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
) -> dict[str, Any]:
    """Restore weights (in place), optimizer, scheduler and RNGs; return the trainer state."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no {COMPLETE} marker); pass a checkpoints/step-N directory written by leangrpo."
        )
    load_model_weights(model, path / "model")
    for obj, name in ((optimizer, "optimizer.pt"), (scheduler, "scheduler.pt")):
        if obj is None:
            continue
        if not (path / name).is_file():
            raise CheckpointError(
                f"{path} has no {name}; it was saved without one, so this run cannot resume it exactly."
            )
        obj.load_state_dict(torch.load(path / name, map_location="cpu", weights_only=True))
    restore_rng_state(torch.load(path / "rng.pt", weights_only=True))
    return json.loads((path / "trainer_state.json").read_text())


def load_bulky_state(path: str | Path) -> dict[str, Any]:
    """The `bulky_state` saved with a checkpoint ({} when it was saved without one)."""
    file = Path(path) / BULKY_STATE
    if not file.is_file():
        return {}
    return torch.load(file, map_location="cpu", weights_only=True)


def save_final_model(
    output_dir: str | Path,
    model: torch.nn.Module,
    tokenizer: Any | None,
    step: int | None = None,
    version: int = 0,
) -> Path:
    """Write `output_dir/final/` atomically, loadable by from_pretrained (full) or PeftModel
    (a quantized base's BitsAndBytesConfig beside the adapter: model/quantization.py);
    with `step`, its FINAL_STATE records the step and policy version it holds (rundir.py)."""
    output_dir = Path(output_dir)
    _remove_stale_tmp(output_dir, prefix=".tmp-final-")
    with _atomic_directory(output_dir / "final", "the final model", saved_bytes(model)) as tmp:
        save_model_weights(model, tmp, for_resume=False)
        write_adapter_notes(model, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if step is not None:
            write_final_state(tmp, step, version)
    return output_dir / "final"


class LocalCheckpointer:
    """`contracts.Checkpointer` for one process: the functions above, on one run directory."""

    def __init__(self, output_dir: str | Path, keep_last: int):
        self.output_dir = Path(output_dir)
        self.keep_last = keep_last

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any | None,
        trainer_state: dict[str, Any],
        *,
        extra_files: dict[str, str],
        bulky_state: dict[str, Any],
        inflight: dict[str, Any] | None,
    ) -> Path:
        if inflight is not None:
            bulky_state = {**bulky_state, "inflight": inflight}
        return save_checkpoint(
            self.output_dir, step, model, optimizer, scheduler, trainer_state, self.keep_last,
            extra_files=extra_files, bulky_state=bulky_state,
        )  # fmt: skip

    def load(
        self, path: str | Path, model: torch.nn.Module, optimizer: Any, scheduler: Any
    ) -> RestoredCheckpoint:
        state = load_checkpoint(path, model, optimizer, scheduler)
        return restored(state, load_bulky_state(path))

    def save_final(
        self, model: torch.nn.Module, tokenizer: Any | None, step: int, version: int
    ) -> Path:
        return save_final_model(self.output_dir, model, tokenizer, step, version)


def restored(trainer_state: dict[str, Any], bulky: dict[str, Any]) -> RestoredCheckpoint:
    """A loaded checkpoint's states, the batch in progress apart (as it was saved)."""
    bulky = dict(bulky)
    return RestoredCheckpoint(trainer_state, bulky, bulky.pop("inflight", None))


# -- model weights --------------------------------------------------------------------------


def is_peft_model(model: torch.nn.Module) -> bool:
    if "peft" not in sys.modules:  # no PeftModel can exist; importing peft costs ~40 MB
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def save_model_weights(model: Any, directory: Path, for_resume: bool) -> None:
    """peft: the adapter only; full model: safetensors (resume: state_dict key names)."""
    params = inspect.signature(model.save_pretrained).parameters
    keep_names = for_resume and not is_peft_model(model) and "save_original_format" in params
    kwargs = {"save_original_format": False} if keep_names else {}
    with quiet_transformers_progress():
        model.save_pretrained(directory, **kwargs)


def load_model_weights(model: Any, directory: Path) -> None:
    adapter_file = directory / "adapter_model.safetensors"
    peft = is_peft_model(model)
    if adapter_file.is_file() != peft:
        held = "a LoRA adapter" if adapter_file.is_file() else "full model weights"
        raise CheckpointError(
            f"{directory} holds {held} but the model is {'a peft' if peft else 'not a peft'} model; resume with the same lora.enabled setting the checkpoint was saved with."
        )
    if peft:
        _load_adapter(model, adapter_file)
    else:
        _load_full(model, directory)


def _load_adapter(model: Any, adapter_file: Path) -> None:
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

    saved = load_file(adapter_file)
    expected = set(get_peft_model_state_dict(model))
    if expected != set(saved):
        diff = sorted(expected.symmetric_difference(saved))[:3]
        raise CheckpointError(
            f"adapter in {adapter_file.parent} does not match the model's LoRA layers (e.g. {diff}); resume with the lora.r and lora.target_modules it was saved with."
        )
    set_peft_model_state_dict(model, saved)


def _load_full(model: torch.nn.Module, directory: Path) -> None:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory} holds no .safetensors weights.")
    saved: dict[str, torch.Tensor] = {}
    for file in files:
        saved.update(load_file(file))
    current = model.state_dict()
    wrong = [k for k, v in saved.items() if k in current and v.shape != current[k].shape]
    if wrong:
        name = wrong[0]
        raise CheckpointError(
            f"weights in {directory} do not fit the model: {name} has shape {tuple(saved[name].shape)} there but {tuple(current[name].shape)} in the model; resume with the model.name_or_path they were saved from."
        )
    result = model.load_state_dict(saved, strict=False)
    untied = _untied_missing(model, result.missing_keys, loaded=set(saved))
    if untied or result.unexpected_keys:
        raise CheckpointError(
            f"weights in {directory} do not match the model (missing {untied[:3]}, unexpected {result.unexpected_keys[:3]}); resume with the model.name_or_path they were saved from."
        )


def _untied_missing(model: torch.nn.Module, missing: list[str], loaded: set[str]) -> list[str]:
    """Missing keys that do not share storage with a loaded tensor (tied weights are fine)."""
    by_name = model.state_dict(keep_vars=True)
    loaded_ptrs = {by_name[name].data_ptr() for name in loaded if name in by_name}
    return [name for name in missing if by_name[name].data_ptr() not in loaded_ptrs]


# -- records as plain data -----------------------------------------------------------------


def sample_state(sample: RolloutSample) -> dict[str, Any]:
    """A scored rollout sample as plain data (its prompt's reward columns left out; a
    multi-turn trajectory's segments, versions, messages and figures kept, an agent
    episode's earlier segments with their own starts; a route record, a tensor, kept as it
    is)."""
    return {
        "group_id": sample.group_id,
        "prompt": _prompt_state(sample.prompt),
        "completion": _completion_state(sample.completion),
        "rewards": dict(sample.rewards),
        "reward": sample.reward,
        "advantage": sample.advantage,
        "replayed": sample.replayed,
    }


def _prompt_state(p: Prompt) -> dict[str, Any]:
    prompt = {"uid": p.uid, "text": p.text, "ids": list(p.ids)}
    if p.messages is not None:
        prompt["messages"] = p.messages
    return prompt


def _completion_state(c: Completion, keep_start: bool = False) -> dict[str, Any]:
    completion = {
        "ids": list(c.ids),
        "text": c.text,
        "logprobs": list(c.logprobs),
        "finish_reason": c.finish_reason,
        "version": c.version,
    }
    t = c.trajectory
    if t is not None:  # its start is the sample's prompt (an earlier segment's: its own)
        plain = dataclasses.asdict(dataclasses.replace(t, start=None, earlier=[]))
        plain["earlier"] = [_completion_state(e, keep_start=True) for e in t.earlier]
        if keep_start and t.start is not None:
            plain["start"] = _prompt_state(t.start)
        completion["trajectory"] = plain
    if c.routes is not None:  # routing replay: the engine's record, as it came
        completion["routes"] = c.routes
    return completion


def _completion_from_state(state: dict[str, Any]) -> Completion:
    completion = dict(state)
    if completion.get("trajectory") is not None:
        trajectory = dict(completion["trajectory"])
        trajectory["segments"] = [(int(n), bool(m)) for n, m in trajectory["segments"]]
        trajectory["earlier"] = [_completion_from_state(e) for e in trajectory.get("earlier", [])]
        if trajectory.get("start") is not None:
            trajectory["start"] = Prompt(**trajectory["start"])
        completion["trajectory"] = Trajectory(**trajectory)
    return Completion(**completion)


def sample_from_state(state: dict[str, Any]) -> RolloutSample:
    return RolloutSample(
        group_id=state["group_id"],
        prompt=Prompt(**state["prompt"]),
        completion=_completion_from_state(state["completion"]),
        rewards=dict(state["rewards"]),
        reward=state["reward"],
        advantage=state["advantage"],
        replayed=state["replayed"],
    )


# -- RNG ------------------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    """Every generator a run draws from, in types `torch.load(weights_only=True)` accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


# -- files ----------------------------------------------------------------------------------


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def _atomic_directory(final: Path, what: str = "", needed: int = 0) -> Iterator[Path]:
    """Yield a temporary sibling of `final`; on success fsync it and rename it to `final`.

    `needed`: the bytes `what` will take at least; a disk with less free is refused before
    anything is written (`DiskFullError`). On an exception the temporary directory is
    removed (a crash leaves it to the next save, which removes it), and a write that filled
    the disk (torch reports it as a RuntimeError, not ENOSPC) is a `DiskFullError` too.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    check_free_space(final.parent, what, needed)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    tmp.chmod(0o777 & ~current_umask())  # mkdtemp makes it private; a run's files are not
    try:
        yield tmp
        _fsync_tree(tmp)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and _filled_the_disk(exc, final.parent, needed):
            raise DiskFullError(_no_room(final.parent, what, needed, written=True)) from exc
        raise
    if final.exists():  # re-saving a step: swap the old one out, then delete it
        old = Path(tempfile.mkdtemp(prefix=f".tmp-old-{final.name}-", dir=final.parent))
        os.replace(final, old / final.name)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    _fsync_dir(final.parent)


def saved_bytes(model: Any) -> int:
    """The bytes of the tensors a save writes of `model` (a peft model: its adapter; tied
    tensors once): a lower bound on the files."""
    if is_peft_model(model):
        from peft.utils import get_peft_model_state_dict

        tensors = list(get_peft_model_state_dict(model).values())
    else:
        tensors = list(model.state_dict().values())
    unique = {(t.untyped_storage().data_ptr(), t.storage_offset(), t.numel()): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())


def optimizer_bytes(optimizer: Any) -> int:
    """The bytes of an optimizer's state tensors (AdamW: two per trained parameter)."""
    if optimizer is None:
        return 0
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def check_free_space(directory: Path, what: str, needed: int) -> None:
    """Refuse, before a byte is written, a save the disk has no room for."""
    if needed and shutil.disk_usage(directory).free < needed:
        raise DiskFullError(_no_room(directory, what, needed, written=False))


def _filled_the_disk(exc: Exception, directory: Path, needed: int) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        return shutil.disk_usage(directory).free < max(needed, 1 << 20)
    except OSError:
        return False


def _no_room(directory: Path, what: str, needed: int, written: bool) -> str:
    free = shutil.disk_usage(directory).free
    done = "filled the disk and was removed" if written else "was not written"
    return (
        f"the disk holding {str(directory)!r} has {_mib(free)} free but {what} needs at least "
        f"{_mib(needed)}, so it {done} (the run's earlier checkpoints are intact and a rerun "
        f"resumes from the newest); free space there, lower checkpoint.keep_last, or move "
        f"run.output_dir to a larger disk."
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    if os.name != "posix":  # directories cannot be opened for fsync on Windows
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale_tmp(root: Path, prefix: str = ".tmp-") -> None:
    if root.is_dir():
        for child in root.iterdir():
            if child.name.startswith(prefix) and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)


def _prune(root: Path, step: int, keep_last: int) -> None:
    checkpoints = complete_checkpoints(root)
    abandoned = [path for s, path in checkpoints if s > step]
    kept_history = [path for s, path in checkpoints if s <= step]
    for path in abandoned + kept_history[:-keep_last]:
        shutil.rmtree(path)


def _to_json(state: dict[str, Any]) -> str:
    try:
        return json.dumps(state, indent=1, sort_keys=True)
    except TypeError:
        where, value = _first_unjsonable(state, "trainer_state")
        raise CheckpointError(
            f"{where} is a {type(value).__name__}, which JSON cannot hold; convert it to numbers, strings, lists or dicts before saving."
        ) from None


def _first_unjsonable(value: Any, where: str) -> tuple[str, Any]:
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str | int | float | bool) and key is not None:
                return f"{where} key {key!r}", key
            found = _first_unjsonable(item, f"{where}[{key!r}]")
            if found[0]:
                return found
        return "", None
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found = _first_unjsonable(item, f"{where}[{i}]")
            if found[0]:
                return found
        return "", None
    if value is None or isinstance(value, str | int | float | bool):
        return "", None
    return where, value
