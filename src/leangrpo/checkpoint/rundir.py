"""The run directory: one run at a time, never two runs in one set of files.

`open_run_dir(cfg)` runs before any model loads and imports no torch. It decides what a
run does with `run.output_dir`, in this order:

1. The path must be a writable directory or creatable: a file, a path under a file, or a
   read-only directory is refused in one sentence.
2. An exclusive `fcntl.flock` on `output_dir/.lock` (which holds the pid) is taken for the
   whole run. The OS drops it when the process ends, however it ends, so a crashed run
   never leaves a stale lock; a second run in the same directory is refused naming the
   holder's pid. The lock file itself is never deleted (deleting it would let two
   processes lock two different inodes). An earlier run that run.overwrite had set aside
   when its replacement was killed is settled now (overwrite.py).
3. Where to resume from: `run.resume: auto` takes the newest complete checkpoint of this
   directory whose files match the record in its COMPLETE marker (manifest.py); newer
   damaged ones are named in one warning and, once the set-up is done, renamed
   `damaged-step-N` (`keep_damaged`: the run's first save would prune them, intact
   weights and all), and a directory whose checkpoints are all
   damaged is refused, naming them. An explicit path must be a complete, intact
   checkpoint (checked now, not after the model has loaded); `never` and
   `run.overwrite: true` take none.
4. A resume checkpoint at or beyond `run.max_steps` (with final/ written at its step, when
   `checkpoint.save_final_model`) means the run is finished: the CLI says so and exits 0
   without loading anything. Without final/ (a crash between the last checkpoint and
   final/), or with a final/ older than that checkpoint (the run was extended past it and
   stopped), the run resumes and only finishes: the last evaluation and final/.
5. A run that does not resume from this directory's own checkpoints needs a directory
   without an earlier run's files (metrics, samples, checkpoints, final model...):
   starting over there would append a second run to the old metrics.jsonl and prune the
   old checkpoints. It is refused, naming the files, unless `run.overwrite: true`, which
   replaces exactly the files leangrpo writes (never anything else): they stay in place
   through every check and the set-up, are set aside when the run starts writing
   (`RunDir.begin_writing`), deleted at its first checkpoint and put back if it ends
   before one (overwrite.py). Not an earlier run: what a run that failed before its first
   step left (`never_stepped`: a metrics.jsonl of step-0 rows only, the evaluation before
   training, and the trackers' directories of it); the next start deletes it when it
   starts writing, so a corrected config simply runs again.
6. A checkpoint written by another number of processes (torchrun ranks; 1 without
   torchrun) is refused: the sharded state and the per-rank RNG streams fit only the
   world size that wrote them.
7. A resume compares the config with the one stored in the checkpoint (config.yaml,
   written by every save; the run directory's own config.yaml is rewritten each start).
   Keys that only change where output goes or how often (HARMLESS_KEYS) are noted; any
   other difference breaks exact resume and is refused, listing old -> new, unless
   `run.allow_config_changes: true`, which resumes with a warning listing them.
   `run.max_steps` only says where to stop: the LR schedule keeps the horizon the run
   started with (`schedule_horizon`, saved in every checkpoint's trainer_state.json).
   rollout.routing_replay turned on inside a batch generated without route records is
   refused, naming the step that batch ends at (`check_batch_routes`).

final/ holds `final_state.json` (FINAL_STATE: the step and policy version it was written
at), written inside it before it is renamed into place: a run extended past its final/
(run.max_steps raised) leaves the older final/ where it was until it finishes, and what
reads final/ as the run's model (`current_final`, `leangrpo eval`) checks that record
against the newest checkpoint. A final/ without the record (written before leangrpo kept
it) counts as the run's model only in a run without checkpoints.

Under torchrun only rank 0 opens (locks, classifies, sets aside) the directory; the others
receive its decision (`follower`) and never touch the lock (preflight.py). `leangrpo
check` opens it `dry`: every check and the decision, nothing created, locked or moved.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from leangrpo.checkpoint.manifest import COMPLETE, checkpoint_problem, read_complete
from leangrpo.checkpoint.overwrite import ASIDE, EarlierRun, remove, set_aside, settle
from leangrpo.errors import UserError

try:
    import fcntl
except ImportError:  # Windows: no flock; runs are not locked there
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("leangrpo")

STEP_DIR = re.compile(r"^step-(\d+)$")
LOCK_FILE = ".lock"
CHECKPOINT_CONFIG = "config.yaml"
# What leangrpo writes into a run directory: what run.overwrite deletes, and what makes a
# directory "hold an earlier run". config.yaml alone does not (a run that failed its data
# checks has written it), nor do empty files or directories.
RUN_FILES = (
    "checkpoints",
    "final",
    "metrics.jsonl",
    "samples.jsonl",
    "tensorboard",
    "wandb",
    "report.png",
    "report.html",
    "config.yaml",
    "eval.jsonl",  # `leangrpo eval`'s figures (api/evaluation.py)
)
# In final/: {"step": N, "version": V}, the step and policy version final/ was written at.
FINAL_STATE = "final_state.json"
# Settings that change where output goes or how often, never what is trained.
HARMLESS_KEYS = (
    "run.max_steps",  # the LR schedule's horizon stays the first one (schedule_horizon)
    "run.output_dir",
    "run.resume",
    "run.overwrite",
    "run.allow_config_changes",
    "run.num_threads",
    "rewards.num_workers",
    "logging.",
    "eval.",
    "checkpoint.",
)


class RunDirError(UserError):
    """The run directory cannot be used as configured; the message says how to fix it."""


# -- checkpoints on disk (no torch: the checkpoint files themselves are in local.py) ---


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete `step-N` directory under `root`, by step: the step
    its COMPLETE marker records, not the one its name says (a directory renamed by hand);
    the name only where the marker holds none (a damaged one: refused as such later)."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir() and (child / COMPLETE).is_file():
            found.append((checkpoint_step(child), child))
    return sorted(found)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step in `output_dir`, or None."""
    found = complete_checkpoints(Path(output_dir) / "checkpoints")
    return found[-1][1] if found else None


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint holds: its COMPLETE marker's record, else its name's."""
    recorded = read_complete(path).get("step")
    match = STEP_DIR.match(path.name)
    if isinstance(recorded, int) and not isinstance(recorded, bool):
        if match and int(match.group(1)) != recorded and path not in _NAMED_WRONG:
            _NAMED_WRONG.add(path)
            log.warning(
                "checkpoint %s holds step %d (its %s marker records it): taken as step %d, "
                "whatever its name says; rename it step-%d",
                path, recorded, COMPLETE, recorded, recorded,
            )  # fmt: skip
        return recorded
    if match:
        return int(match.group(1))
    raise RunDirError(
        f"{str(path)!r} records no step (its {COMPLETE} marker is not what leangrpo writes) and its name is not step-N; pass a checkpoints/step-N directory written by leangrpo."
    )


_NAMED_WRONG: set[Path] = set()  # each misnamed checkpoint is warned about once


# -- final/ and the step it holds -------------------------------------------------------------


def write_final_state(directory: Path, step: int, version: int) -> None:
    """FINAL_STATE in `directory` (final/ being written): the step and version it holds."""
    text = json.dumps({"step": int(step), "version": int(version)})
    (directory / FINAL_STATE).write_text(text + "\n", encoding="utf-8")


def final_state(final: Path) -> dict[str, int] | None:
    """final/'s FINAL_STATE ({"step", "version"}), or None: no such file, or one that
    does not hold two integers (written before leangrpo kept it, or damaged)."""
    try:
        state = json.loads((final / FINAL_STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict):
        return None
    numbers = {k: state.get(k) for k in ("step", "version")}
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in numbers.values()):
        return None
    return numbers  # type: ignore[return-value]


def final_holds(final: Path, step: int) -> bool:
    """`final` is a final/ written at `step` or later (its FINAL_STATE says so)."""
    state = final_state(final) if final.is_dir() else None
    return state is not None and state["step"] >= step


def current_final(run_dir: Path) -> Path | None:
    """The run's final/ when it holds the run's newest weights: written at the step of its
    newest complete checkpoint or later, or the run has no checkpoint; else None (no
    final/, or one the run has trained past since: extended and stopped, or finished with
    checkpoint.save_final_model off)."""
    final = Path(run_dir) / "final"
    if not final.is_dir():
        return None
    found = complete_checkpoints(Path(run_dir) / "checkpoints")
    return final if not found or final_holds(final, found[-1][0]) else None


# -- the lock -------------------------------------------------------------------------------


class RunLock:
    """An exclusive flock on `directory/.lock`, held until `release()` or process exit.

    `probe`: only check that no other run holds it (an existing lock file is opened
    read-only, nothing is created) and let go at once: `leangrpo check`."""

    def __init__(self, directory: Path, probe: bool = False):
        self.path = directory / LOCK_FILE
        self._fd: int | None = None
        if fcntl is None or (probe and not self.path.is_file()):
            return
        try:
            fd = os.open(self.path, os.O_RDONLY if probe else os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise RunDirError(not_writable(directory, exc.strerror or str(exc))) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            who = (
                "this process (a Trainer that was not closed)"
                if holder == str(os.getpid())
                else f"another leangrpo run (pid {holder})"
            )
            raise RunDirError(
                f"run.output_dir {str(directory)!r} is in use by {who}; wait for it to end or give this run another run.output_dir."
            ) from None
        if probe:
            os.close(fd)  # closing the descriptor drops the lock
            return
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def not_writable(directory: Path, why: str) -> str:
    return f"run.output_dir {str(directory)!r} is not writable ({why}); make it writable for this user, or choose another run.output_dir."


# -- the decision ---------------------------------------------------------------------------


@dataclass
class RunDir:
    """A locked run directory and what the run does with it."""

    path: Path
    lock: RunLock
    resume_from: Path | None = None  # a complete checkpoint, or None = start fresh
    resume_step: int | None = None
    finished: str = ""  # set (to a sentence) when the resume checkpoint is at run.max_steps
    config_notes: list[str] = field(default_factory=list)  # harmless config changes
    replaces: list[str] = field(default_factory=list)  # run.overwrite: the earlier run's files
    leftovers: list[str] = field(default_factory=list)  # of a run that never stepped: deleted
    damaged: list[Path] = field(default_factory=list)  # newer than resume_from, damaged
    _earlier: EarlierRun | None = None  # set aside until this run's first checkpoint

    def begin_writing(self) -> None:
        """Right before the run writes its first file: run.overwrite sets the earlier run
        aside now, every check and the whole set-up having passed (overwrite.py); damaged
        checkpoints newer than the resume one are kept out of the pruning (`keep_damaged`)."""
        keep_damaged(self.damaged)
        self.damaged = []
        for name in self.leftovers:
            remove(self.path / name)
        if self.leftovers:
            left = ", ".join(self.leftovers)
            log.info("deleted what a run that failed before its first step left: %s", left)
            self.leftovers = []
        if self.replaces and self._earlier is None:
            self._earlier = set_aside(self.path, self.replaces, RUN_FILES)
            self.replaces = []
            left = ", ".join(n for n in earlier_run_files(self.path) if not n.startswith(ASIDE))
            if left:
                log.info("run.overwrite keeps the files leangrpo did not write: %s", left)

    def checkpoint_saved(self) -> None:
        """The run holds a checkpoint: an earlier run set aside is deleted now."""
        if self._earlier is not None:
            self._earlier.discard()
            self._earlier = None

    def release(self) -> None:
        """Unlock; an earlier run still set aside (no checkpoint written) is put back."""
        try:
            if self._earlier is not None:
                self._earlier.restore()
                self._earlier = None
        finally:
            self.lock.release()

    def decision(self) -> dict[str, Any]:
        """What other torchrun ranks need to know (plain data, see `follower`)."""
        resume = None if self.resume_from is None else str(self.resume_from)
        return {"path": str(self.path), "resume_from": resume, "resume_step": self.resume_step,
                "finished": self.finished, "config_notes": list(self.config_notes)}  # fmt: skip

    @classmethod
    def follower(cls, decision: dict[str, Any]) -> RunDir:
        """Rank 0's decision on a rank > 0: the same run directory, without the lock (and
        nothing to set aside: rank 0 does that)."""
        resume = decision["resume_from"]
        return cls(
            Path(decision["path"]),
            _NoLock(),  # type: ignore[arg-type]
            None if resume is None else Path(resume),
            decision["resume_step"],
            decision["finished"],
            list(decision["config_notes"]),
        )


def keep_damaged(damaged: list[Path]) -> None:
    """Rename damaged checkpoints `step-N` to `damaged-step-N`: no longer a checkpoint to
    resume from or to prune. Newer than the step a run resumed from, they would otherwise
    be deleted by its first save (local.py's `_prune` drops checkpoints past the step
    saved), and their weights may be intact (a full disk cuts the optimizer state short)."""
    for path in damaged:
        kept = path.with_name(f"damaged-{path.name}")
        n = 1
        while kept.exists():
            kept, n = path.with_name(f"damaged-{path.name}.{n}"), n + 1
        os.rename(path, kept)
        log.warning(
            "kept the damaged checkpoint %s as %s, out of this run's way (never resumed or "
            "pruned): copy what is intact out of it, then delete it",
            path.name,
            kept,
        )


class _NoLock:
    """A torchrun rank > 0: rank 0 holds the run directory's lock for the whole run."""

    def release(self) -> None:
        pass


def open_run_dir(cfg: Any, dry: bool = False) -> RunDir:
    """Validate, lock and classify `cfg.run.output_dir`; see the module docstring.

    `dry` (`leangrpo check`): the same checks and decision, but nothing is created, locked
    or moved (a lock held by another run is still reported); a directory still holding an
    earlier run set aside by a killed run is left unclassified (`leangrpo check` says so)."""
    path = Path(cfg.run.output_dir).expanduser()
    make_directory(path, create=not dry)
    run_dir = RunDir(path, RunLock(path, probe=dry))
    unsettled = any((path / name).is_dir() for name in (ASIDE, f"{ASIDE}.tmp"))
    try:
        if unsettled and dry:  # what train decides depends on settling it first
            return run_dir
        if unsettled:  # a run killed while an earlier run was set aside
            settle(path, RUN_FILES, has_checkpoint=bool(complete_checkpoints(path / "checkpoints")))
        _classify(run_dir, cfg)
    except BaseException:
        run_dir.release()
        raise
    return run_dir


def make_directory(path: Path, create: bool = True) -> None:
    """`path` is (or can become) a writable directory; created unless `create` is False."""
    key = f"run.output_dir = {str(path)!r}"
    if path.exists() and not path.is_dir():
        raise RunDirError(f"{key} is a file, not a directory; choose a directory path.")
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise RunDirError(
            f"{key} cannot be created because {str(blocker)!r} is a file; choose a directory path."
        )
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunDirError(f"{key} cannot be created: {exc.strerror or exc}.") from None
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "read-only" if existing == path else f"{str(existing)!r} is read-only"
        raise RunDirError(not_writable(path, why))


def _classify(run_dir: RunDir, cfg: Any) -> None:
    run = cfg.run
    own = run_dir.path / "checkpoints"
    fresh = run.resume == "never" or (run.overwrite and run.resume == "auto")
    resume = None if fresh else _resume_checkpoint(run, own)
    if run.overwrite and run.resume not in ("auto", "never") and _is_inside(Path(run.resume), own):
        raise RunDirError(
            f"run.overwrite: true would delete the checkpoint run.resume = {run.resume!r} resumes from; drop one of the two settings."
        )
    if resume is not None:
        run_dir.resume_from, run_dir.resume_step = resume, checkpoint_step(resume)
        if run.resume == "auto":  # any newer complete checkpoint was passed over as damaged
            newer = complete_checkpoints(own)
            run_dir.damaged = [path for step, path in newer if step > run_dir.resume_step]
        final_missing = cfg.checkpoint.save_final_model and not final_holds(
            run_dir.path / "final", run_dir.resume_step
        )
        if run_dir.resume_step >= run.max_steps and not final_missing:
            run_dir.finished = f"Run {str(run_dir.path)!r} is already finished: its checkpoint {resume.name} is at step {run_dir.resume_step} and run.max_steps is {run.max_steps}; nothing to do (raise run.max_steps to train on, or set run.overwrite: true to start again)."
            return
        check_world_size(resume)
        check_context_parallel_size(resume, cfg.distributed.context_parallel_size)
        run_dir.config_notes = check_config_changes(resume, cfg)
        check_batch_routes(resume, cfg)
    if resume is None or not _is_inside(resume, own):
        files = earlier_run_files(run_dir.path) if run_dir.path.is_dir() else []
        if not run.overwrite and never_stepped(run_dir.path, files):
            run_dir.leftovers = [name.rstrip("/") for name in files]
            return
        run_dir.replaces = _earlier_run(run_dir.path, run.overwrite, run.resume)


def _resume_checkpoint(run: Any, own: Path) -> Path | None:
    if run.resume == "auto":
        return newest_intact_checkpoint(own)
    path = Path(run.resume).expanduser()
    key = f"run.resume = {run.resume!r}"
    if (path / COMPLETE).is_file():
        problem = checkpoint_problem(path)
        if problem is not None:
            raise RunDirError(
                f"{key} is damaged: {problem}; restore its files from a copy, or resume from another checkpoint (run.resume: auto takes the newest intact one of run.output_dir)."
            )
        return path
    inside = complete_checkpoints(path / "checkpoints") or complete_checkpoints(path)
    if inside:
        raise RunDirError(
            f"{key} is not a checkpoint directory; did you mean {str(inside[-1][1])!r} (the newest there)?"
        )
    if path.exists():
        raise RunDirError(
            f"{key} is not a complete checkpoint (it has no {COMPLETE} marker: one interrupted while being written?); pass a checkpoints/step-N directory written by leangrpo."
        )
    raise RunDirError(
        f"{key} does not exist; pass a checkpoints/step-N directory written by leangrpo, or 'auto'."
    )


def newest_intact_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under `root` whose files match their record
    (manifest.py); the damaged ones newer than it are named in one warning. None when there
    is no checkpoint; RunDirError when every one is damaged."""
    damaged: list[str] = []
    for _, path in reversed(complete_checkpoints(root)):
        problem = checkpoint_problem(path)
        if problem is None:
            if damaged:
                log.warning(
                    "resuming from %s, the newest intact checkpoint: %s",
                    path.name,
                    "; ".join(damaged),
                )
            return path
        damaged.append(f"{path.name} is damaged ({problem})")
    if damaged:
        raise RunDirError(
            f"No intact checkpoint to resume from in {str(root)!r}: {'; '.join(damaged)}; restore those files from a copy, or set run.overwrite: true to start this run again (its files are deleted once the new run writes a checkpoint)."
        )
    return None


def _is_inside(path: Path, root: Path) -> bool:
    try:
        path.expanduser().resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


def earlier_run_files(path: Path) -> list[str]:
    """Entries that hold an earlier run's output (see RUN_FILES), or anything unknown."""
    found = []
    for child in sorted(path.iterdir()):
        if child.name in (LOCK_FILE, "config.yaml") or _is_empty(child):
            continue
        found.append(child.name + ("/" if child.is_dir() else ""))
    return found


def _is_empty(path: Path) -> bool:
    if path.is_dir():
        return all(_is_empty(child) for child in path.iterdir())
    return path.is_file() and path.stat().st_size == 0


# What a run that failed before its first step may leave (besides config.yaml and .lock).
NEVER_STEPPED = ("metrics.jsonl", "tensorboard/", "wandb/")


def never_stepped(path: Path, files: list[str]) -> bool:
    """`files` (`earlier_run_files`) are only what a run that failed before its first step
    left: a metrics.jsonl whose every row is step 0 (the evaluation before training) and at
    most the trackers' directories beside it. A torn or unreadable row, or any other file,
    is an earlier run's (refused unless run.overwrite)."""
    if "metrics.jsonl" not in files or not set(files) <= set(NEVER_STEPPED):
        return False
    try:
        lines = (path / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError):
        return False
    return all(isinstance(row, dict) and row.get("step") == 0 for row in rows)


def _earlier_run(path: Path, overwrite: bool, resume: str) -> list[str]:
    """The earlier run's files (RUN_FILES) that run.overwrite replaces; a directory holding
    an earlier run without run.overwrite is refused."""
    files = earlier_run_files(path) if path.is_dir() else []
    if not files:
        return []
    if not overwrite:
        shown = ", ".join(files[:4]) + (f" and {len(files) - 4} more" if len(files) > 4 else "")
        why = {
            "never": "run.resume is 'never'",
            "auto": "it has no complete checkpoint to resume from",
        }.get(resume, f"this run resumes from {resume!r}, outside it")
        raise RunDirError(
            f"run.output_dir {str(path)!r} already holds an earlier run ({shown}) and {why}, so a new run would mix with it; set run.overwrite: true to replace it, or choose another run.output_dir."
        )
    return [name for name in RUN_FILES if (path / name).exists()]


def check_world_size(checkpoint: Path) -> None:
    """The checkpoint's writers (trainer_state.json world_size; 1 when absent) = this run's."""
    state_file = checkpoint / "trainer_state.json"
    if not state_file.is_file():
        return
    saved = int(json.loads(state_file.read_text()).get("world_size", 1))
    now = int(os.environ.get("WORLD_SIZE", "1"))
    if saved != now:
        how = "without torchrun" if saved == 1 else f"with torchrun on {saved} processes"
        raise RunDirError(
            f"Checkpoint {str(checkpoint)!r} was written by {saved} process(es) but this run has {now}; its sharded state and per-rank random streams fit only that number, so resume it {how} (or start a new run in another run.output_dir)."
        )


def check_context_parallel_size(checkpoint: Path, size: int) -> None:
    """The checkpoint's distributed.context_parallel_size (its config.yaml; 1 when absent)
    = this run's: the batch in progress it holds was dealt to that many data-parallel
    shares, and each process kept its own share's old and reference log-probs, so another
    split would hand them to the wrong micro-batches. run.allow_config_changes does not
    waive it."""
    saved_path = checkpoint / CHECKPOINT_CONFIG
    if not saved_path.is_file():
        return
    saved = yaml.safe_load(saved_path.read_text(encoding="utf-8")) or {}
    saved_size = int((saved.get("distributed") or {}).get("context_parallel_size", 1))
    if saved_size != size:
        raise RunDirError(
            f"Checkpoint {str(checkpoint)!r} was written with distributed.context_parallel_size = {saved_size} but this run has {size}; the batch in progress it holds is split for that size, so resume it with distributed.context_parallel_size: {saved_size} (or start a new run in another run.output_dir)."
        )


def check_batch_routes(checkpoint: Path, cfg: Any) -> None:
    """A run with rollout.routing_replay cannot train on the checkpoint's batch in progress
    if it was generated without route records (replay turned on by a resume mid-batch):
    trainer_state.json's `batch_in_progress` says (the step it ends at, whether its
    samples carry routes). A checkpoint saved before it was recorded is checked when its
    batch loads (train/inflight.py), with the same sentence."""
    state_file = checkpoint / "trainer_state.json"
    if not cfg.rollout.routing_replay or not state_file.is_file():
        return
    batch = json.loads(state_file.read_text()).get("batch_in_progress")
    if isinstance(batch, dict) and batch.get("routes") is False:
        holder = f"Checkpoint {str(checkpoint)!r}"
        raise RunDirError(unrouted_batch(holder, batch.get("ends_at_step")))


def unrouted_batch(holder: str, ends_at: int | None) -> str:
    """Why a routing-replay run cannot resume a batch generated without routes, and how."""
    until = "until that batch is done"
    if ends_at:
        until = f"and run.max_steps: {ends_at} (the step that batch ends at)"
    return f"{holder} holds a batch in progress generated without route records (rollout.routing_replay was off when it was generated), which a run with rollout.routing_replay: true cannot train on; resume with rollout.routing_replay: false {until}, then resume again with it on (the next batch is generated with routes)."


def schedule_horizon(checkpoint: Path, default: int) -> int:
    """The LR schedule's horizon a run started with (trainer_state.json `schedule_steps`;
    for a checkpoint written before it was saved, its config's run.max_steps)."""
    state_file = checkpoint / "trainer_state.json"
    if state_file.is_file():
        state = json.loads(state_file.read_text())
        if "schedule_steps" in state:
            return int(state["schedule_steps"])
    saved_path = checkpoint / CHECKPOINT_CONFIG
    if saved_path.is_file():
        saved = yaml.safe_load(saved_path.read_text(encoding="utf-8")) or {}
        steps = (saved.get("run") or {}).get("max_steps")
        if isinstance(steps, int):
            return steps
    return default


# -- config changes on resume ---------------------------------------------------------------


def check_config_changes(checkpoint: Path, cfg: Any) -> list[str]:
    """Refuse (or, if allowed, warn about) changes that break exact resume; return the
    harmless ones as notes."""
    saved_path = checkpoint / CHECKPOINT_CONFIG
    if not saved_path.is_file():
        log.warning(
            "%s holds no config.yaml (saved by an older leangrpo), so config changes since it cannot be checked",
            checkpoint,
        )
        return []
    saved = yaml.safe_load(saved_path.read_text(encoding="utf-8")) or {}
    changes = config_changes(without_values(saved), without_values(cfg.model_dump(mode="json")))
    harmless = [c for c in changes if c[0].startswith(HARMLESS_KEYS)]
    breaking = [c for c in changes if not c[0].startswith(HARMLESS_KEYS)]
    notes = [_describe(c) for c in harmless]
    _check_schedule_extension(checkpoint, cfg)
    if notes:
        log.info("resuming with changed settings that do not affect training: %s", "; ".join(notes))
    if breaking:
        listed = "; ".join(_describe(c) for c in breaking)
        if not cfg.run.allow_config_changes:
            raise RunDirError(
                f"Resuming from {str(checkpoint)!r} with settings that differ from its config ({listed}) would not continue the same run; restore them, set run.allow_config_changes: true to resume anyway, or start a new run in another run.output_dir."
            )
        log.warning(
            "resuming from %s with changed settings (run.allow_config_changes): %s; the run is no longer an exact continuation",
            checkpoint,
            listed,
        )
    return notes


def _check_schedule_extension(checkpoint: Path, cfg: Any) -> None:
    """A decaying LR schedule keeps its first horizon, so steps past it would train at a
    learning rate of 0: refused unless the user allows config changes."""
    horizon = schedule_horizon(checkpoint, cfg.run.max_steps)
    if cfg.train.lr_scheduler == "constant" or cfg.run.max_steps <= horizon:
        return
    if not cfg.run.allow_config_changes:
        raise RunDirError(
            f"run.max_steps ({cfg.run.max_steps}) goes past the end of this run's {cfg.train.lr_scheduler} learning-rate schedule ({horizon} steps, kept from when the run started), so every step after {horizon} would train at a learning rate of 0; {_new_run_advice(checkpoint.parent.parent, cfg, horizon)}, or set run.allow_config_changes: true to run those steps anyway."
        )


def _new_run_advice(run_dir: Path, cfg: Any, horizon: int) -> str:
    """How to train on with a schedule of its own, for the kind of run this is: full
    fine-tuning leaves a model in final/, LoRA (quantized base or not) an adapter, which
    `leangrpo merge` makes a model of."""
    final = run_dir / "final"
    first = ""
    if not final.is_dir():
        first = f"write its final model first (run.max_steps: {horizon} with checkpoint.save_final_model: true), then "
    if not cfg.lora.enabled:
        return (
            f"{first}start a new run from {str(final)!r} (model.name_or_path) with its own schedule"
        )
    merged = f"{run_dir}-merged"
    base = (
        "its base"
        if cfg.model.quantization == "none"
        else "its unquantized base (the new run quantizes it again)"
    )
    return f"{first}merge the run's LoRA adapter into {base} with `leangrpo merge {shlex.quote(str(run_dir))} {shlex.quote(merged)}` and start a new run from {merged!r} (model.name_or_path) with its own schedule"


MISSING = "(unset)"


def without_values(config: dict) -> dict:
    """The config with the pickled bytes of user code passed by value left out (rewards,
    the environment class, its tools): they differ between sessions for the same code
    (code objects hold their cell's file name), so a resume compares the names only, as it
    compares a reward file's name and not its text."""
    config = dict(config)
    rewards = dict(config.get("rewards") or {})
    if isinstance(rewards.get("functions"), list):
        rewards["functions"] = [_no_value(f) for f in rewards["functions"]]
        config["rewards"] = rewards
    env = config.get("environment")
    if isinstance(env, dict):
        env = _no_value(env)
        if isinstance(env.get("tools"), list):
            env["tools"] = [_no_value(t) for t in env["tools"]]
        config["environment"] = env
    return config


def _no_value(entry: Any) -> Any:
    return {k: v for k, v in entry.items() if k != "value"} if isinstance(entry, dict) else entry


def config_changes(old: dict, new: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, old, new) for every leaf that differs; lists compare as whole values."""
    changes = []
    for key in [*new, *(k for k in old if k not in new)]:
        a, b = old.get(key, MISSING), new.get(key, MISSING)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            changes += config_changes(a, b, f"{name}.")
        elif a != b:
            changes.append((name, a, b))
    return changes


def _describe(change: tuple[str, Any, Any]) -> str:
    key, old, new = change

    def short(value: Any) -> str:
        text = value if value is MISSING else repr(value)
        return text if len(text) <= 40 else text[:37] + "..."

    return f"{key} {short(old)} -> {short(new)}"
