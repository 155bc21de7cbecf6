"""`leangrpo eval` and `leangrpo.evaluate`: a checkpoint or final/ scored on a data set.

    leangrpo eval RUN_OR_CHECKPOINT [--data FILE] [--rewards NAME ...] [--num-prompts N]

What is scored (`locate`, before torch is imported): a run directory gives its final/ when
final/ is at least as new as its newest intact checkpoint (the step final/ records,
checkpoint/rundir.py FINAL_STATE), else that checkpoint (a run extended past its final/
and stopped; the printed line says final/ was older); a `checkpoints/step-N` directory is verified
against its COMPLETE record (sizes and checksums, checkpoint/manifest.py) and a damaged
one is refused in one sentence naming the damaged files; a final/ directory (full model
or LoRA adapter, QLoRA included) has its JSON files parsed and its safetensors headers
checked (final/ keeps no checksums: a flipped bit inside a tensor can only be caught as a
non-finite weight once loaded, which is refused too), and is reported at the step it
records (0 when it records none), with a note when its run has a newer checkpoint. A sharded (torchrun) checkpoint is
refused: its run's final/ is one ordinary directory.

The settings are the run's own (its config.yaml, in the checkpoint or the run directory,
or `config=` / `--config`), with the data, rewards and number of prompts given here, and
the `eval` section for greedy (temperature 0, the default) or sampled scoring
(`--temperature`, `--num-generations`); `**overrides` as `leangrpo.GRPO` takes them.
Generation runs on the hf engine in this process, multi-turn included (the run's
environment, its workers started as the trainer starts them), and the figures are the
Evaluator's, the same `eval/*` keys a run logs (pipeline/evaluation.py): a run's final
evaluation and `leangrpo eval RUN` on its own eval set agree. Every check the trainer
makes before its model loads runs first (preflight.py `check_inputs`). The figures are
printed and appended as one JSON row to RUN_DIR/eval.jsonl (`out=` / `--out`), with the
step, what was scored and the data.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from leangrpo.api.grpo import console_logging
from leangrpo.api.inputs import (
    build_config,
    config_dict,
    dataset_source,
    reward_entries,
    section,
)
from leangrpo.checkpoint.manifest import COMPLETE, checkpoint_problem
from leangrpo.checkpoint.rundir import (
    FINAL_STATE,
    checkpoint_step,
    complete_checkpoints,
    final_holds,
    final_state,
)
from leangrpo.config import Config
from leangrpo.config.io import apply_override
from leangrpo.data.files import check_file
from leangrpo.errors import UserError
from leangrpo.model.files import ADAPTER_CONFIG, check_safetensors_header

log = logging.getLogger("leangrpo")
EVAL_FILE = "eval.jsonl"


class EvalTargetError(UserError):
    """What `leangrpo eval` was asked to score cannot be scored (one sentence)."""


@dataclass(frozen=True)
class EvalTarget:
    """The weights to score, and where they come from."""

    path: Path  # a checkpoints/step-N or a final/ directory
    kind: str  # "checkpoint" or "final"
    run_dir: Path | None  # the run directory holding it, when it is in one
    step: int  # the checkpoint's step (final/: the step it records; 0 unknown)
    version: int  # the policy version at that step
    adapter: bool  # LoRA weights (an adapter) rather than a full model
    note: str = ""  # why this and not the run's final/ (or: final/ is older than ...)

    @property
    def weights(self) -> Path:
        return self.path / "model" if self.kind == "checkpoint" else self.path


@dataclass(frozen=True)
class EvalResult:
    """The eval/* figures of one scoring, and where they were written."""

    target: Path
    step: int
    metrics: dict[str, float]
    written_to: Path
    note: str = ""  # EvalTarget.note


def evaluate(
    run_or_checkpoint: str | Path,
    data: Any = None,
    *,
    reward_funcs: list | None = None,
    num_prompts: int | None = None,
    config: Any = None,
    set_values: list[str] | None = None,
    out: str | Path | None = None,
    data_label: str = "data",
    **overrides: Any,
) -> EvalResult:
    """Score a run's final/ or a checkpoint on `data` (a file, rows or a Dataset; default:
    the run's own eval prompts); `set_values`: `KEY=VALUE` strings as `--set` takes them,
    applied to the run's settings first; `data_label`: how a refusal of `data` names it
    (`leangrpo eval`: --data). See the module docstring."""
    with console_logging():
        target = locate(Path(run_or_checkpoint))
        base = config_dict(config) if config is not None else _saved_config(target)
        if reward_funcs is not None:  # first: `set_values` may then set their kwargs
            section(base, "rewards")["functions"] = reward_entries(reward_funcs)
        for value in set_values or []:
            apply_override(base, value)
        cfg = eval_config(target, data, num_prompts, base, overrides, data_label)
        from leangrpo.preflight import check_inputs

        _, limit = check_inputs(cfg, training=False)  # data, rewards, environment, model files
        log.info("scoring %s (step %d) ...", target.path, target.step)
        metrics = score(cfg, target, limit)
        written = write_row(out, target, cfg, metrics)
    return EvalResult(target.path, target.step, metrics, written, target.note)


# -- what is scored (no torch) ---------------------------------------------------------------


def locate(path: Path) -> EvalTarget:
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a directory"
        raise EvalTargetError(
            f"{str(path)!r} {what}; pass a run directory (run.output_dir), one of its checkpoints/step-N or its final/."
        )
    if (path / "dcp").is_dir():
        raise EvalTargetError(
            f"{str(path)!r} is a sharded (torchrun) checkpoint, which leangrpo eval cannot load in one process; evaluate the run's final/ (one ordinary model directory) instead."
        )
    if (path / COMPLETE).is_file() or (path / "trainer_state.json").is_file():
        return _checkpoint(path, _run_of(path.parent.parent))
    if (path / ADAPTER_CONFIG).is_file() or (path / "config.json").is_file():
        return _final(path, _run_of(path.parent))
    if (path / "checkpoints").is_dir() or (path / "final").is_dir():
        return _in_run(path)
    raise EvalTargetError(
        f"{str(path)!r} holds no run, checkpoint or model (no checkpoints/, final/, {COMPLETE}, config.json or {ADAPTER_CONFIG}); pass a run directory, one of its checkpoints/step-N or its final/."
    )


def _run_of(path: Path) -> Path | None:
    return path if (path / "checkpoints").is_dir() or (path / "config.yaml").is_file() else None


def _in_run(run_dir: Path) -> EvalTarget:
    """A run directory: its final/ unless its newest intact checkpoint is newer (or final/
    records no step), else that checkpoint (the damaged ones newer than it named in one
    warning)."""
    final = run_dir / "final"
    newest, damaged = _newest_intact(run_dir)
    if final.is_dir() and (newest is None or final_holds(final, checkpoint_step(newest))):
        return _final(final, run_dir)
    if newest is None:
        held = f" ({'; '.join(damaged)})" if damaged else ""
        raise EvalTargetError(
            f"run directory {str(run_dir)!r} has no final/ and no intact checkpoint{held}; nothing in it can be evaluated."
        )
    if damaged:
        log.warning("scoring %s, the newest intact checkpoint: %s", newest.name, "; ".join(damaged))
    target = _checkpoint(newest, run_dir)
    if not final.is_dir():
        return target
    note = f"the run's {_final_age(final, newest)}"
    log.warning("scoring %s, not final/: %s", newest.name, note)
    return dataclasses.replace(target, note=note)


def _final_age(final: Path, newer: Path) -> str:
    """How final/ is older than the run's checkpoint `newer`, in words."""
    state = final_state(final)
    if state is None:
        return f"final/ records no step (no {FINAL_STATE}), so {newer.name} may be newer"
    return f"final/ holds step {state['step']}, older than {newer.name}"


def _newest_intact(run_dir: Path) -> tuple[Path | None, list[str]]:
    damaged = []
    for _, path in reversed(complete_checkpoints(run_dir / "checkpoints")):
        problem = checkpoint_problem(path)
        if problem is None:
            return path, damaged
        damaged.append(f"{path.name} is damaged: {problem}")
    return None, damaged


def _checkpoint(path: Path, run_dir: Path | None) -> EvalTarget:
    if not (path / COMPLETE).is_file():
        raise EvalTargetError(
            f"checkpoint {str(path)!r} is not complete (no {COMPLETE} marker: it was being written when its run stopped); evaluate another checkpoint or the run's final/."
        )
    problem = checkpoint_problem(path)
    if problem is not None:
        raise EvalTargetError(
            f"checkpoint {str(path)!r} is damaged ({problem}); evaluate another checkpoint or the run's final/."
        )
    state = _json(path / "trainer_state.json", "checkpoint")
    adapter = (path / "model" / "adapter_model.safetensors").is_file()
    return EvalTarget(
        path,
        "checkpoint",
        run_dir,
        int(state.get("step", 0)),
        int(state.get("version", 0)),
        adapter,
    )


def _final(path: Path, run_dir: Path | None) -> EvalTarget:
    adapter = (path / ADAPTER_CONFIG).is_file()
    _json(path / (ADAPTER_CONFIG if adapter else "config.json"), "final/")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise EvalTargetError(
            f"{str(path)!r} holds no .safetensors weights; evaluate a checkpoint of its run instead."
        )
    for file in weights:
        try:
            check_safetensors_header(file)
        except UserError as e:
            raise EvalTargetError(f"{str(path)!r} is damaged: {e}") from None
    state = final_state(path) or {"step": 0, "version": 0}  # 0: unknown
    note = ""
    newest = complete_checkpoints(run_dir / "checkpoints") if run_dir is not None else []
    if newest and not final_holds(path, newest[-1][0]):
        note = _final_age(path, newest[-1][1])
        log.warning("scoring %s: %s", path, note)
    return EvalTarget(path, "final", run_dir, state["step"], state["version"], adapter, note)


def _json(file: Path, what: str) -> dict:
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise EvalTargetError(
            f"{what} file {str(file)!r} cannot be read as JSON ({e}); it is damaged."
        ) from None
    if not isinstance(value, dict):
        raise EvalTargetError(f"{what} file {str(file)!r} holds no JSON object; it is damaged.")
    return value


# -- settings -------------------------------------------------------------------------------


def eval_config(
    target: EvalTarget,
    data: Any,
    num_prompts: int | None,
    base: dict,
    overrides: dict,
    data_label: str = "data",
) -> Config:
    """The run's settings (`base`, the rewards asked for in it), for scoring: the data and
    prompts asked for (`data`: its file checked here, a refusal naming it `data_label`),
    the hf engine, full-model weights from final/ itself, no reference model."""
    scoring = {
        "rollout": {"engine": "hf"},
        "pipeline": {"mode": "sync"},
        "loss": {"beta": 0.0},
        "logging": {"backends": ["jsonl"]},
        "distributed": {"context_parallel_size": 1},
    }
    if target.kind == "final" and not target.adapter:
        scoring["model"] = {"name_or_path": str(target.path), "revision": None}
    if num_prompts is not None:
        scoring["eval"] = {"num_prompts": num_prompts}
    if data is not None:  # scored, and the train file too: the run's may not be here
        file = dataset_source(data, data_label, train=False)["eval_path"]
        scoring["data"] = {"path": file, "dataset": None, "eval_path": file}
        scoring["data"].update(eval_size=0, eval_split=None)
    for key, value in overrides.items():
        scoring[key] = (
            {**scoring.get(key, {}), **value}
            if isinstance(value, dict) and isinstance(scoring.get(key), dict)
            else value
        )
    cfg = build_config(base, overrides=scoring)
    if data is not None:  # its problems named as it was given, before the run's checks
        check_file(cfg.data.eval_path, data_label, cfg.data)
    d = cfg.data
    if not (d.eval_path or d.eval_split or d.eval_size > 0):
        raise EvalTargetError(
            f"the run of {str(target.path)!r} had no eval prompts (data.eval_path, data.eval_split and data.eval_size are unset); pass the prompts to score with --data FILE (data= from Python)."
        )
    return cfg


def _saved_config(target: EvalTarget) -> dict:
    for folder in (target.path, target.run_dir):
        if folder is not None and (folder / "config.yaml").is_file():
            try:
                loaded = yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8"))
            except (OSError, yaml.YAMLError) as e:
                raise EvalTargetError(
                    f"{folder / 'config.yaml'} cannot be read ({e}); pass the run's settings with --config."
                ) from None
            if isinstance(loaded, dict):
                return loaded
    raise EvalTargetError(
        f"no config.yaml beside {str(target.path)!r} (nor in its run directory) says how its run was set up; pass one with --config (config= from Python)."
    )


# -- scoring (torch from here) --------------------------------------------------------------


def score(cfg: Config, target: EvalTarget, limit: Any) -> dict[str, float]:
    """The Evaluator's figures for the target's weights on cfg's eval prompts."""
    from leangrpo.environments.setup import start_environments
    from leangrpo.model.policy import load_tokenizer
    from leangrpo.preflight import prepare_prompts
    from leangrpo.rewards import RewardPool

    tokenizer = load_tokenizer(cfg.model)
    environments = rewards = engines = None
    try:
        if cfg.environment is not None:
            environments = start_environments(cfg, tokenizer)
        first_turn = environments.renderer.first_turn if environments is not None else None
        prompts = prepare_prompts(cfg, tokenizer, limit, first_turn)
        policy = load_scored_policy(cfg, target, tokenizer)
        from leangrpo.pipeline.evaluation import Evaluator
        from leangrpo.rollout.factory import make_engines

        engines = make_engines(cfg, policy)
        rewards = RewardPool(cfg.rewards)
        evaluator = Evaluator(
            engines.eval, rewards, prompts.eval, cfg,
            engine_lock=threading.Lock(), reward_lock=threading.Lock(),
            shared_weights=engines.eval_shares_weights,
            turns=environments.rollout(engines.eval) if environments is not None else None,
        )  # fmt: skip
        log.info("evaluating on %d prompts ...", len(evaluator.prompts))
        return evaluator.run(target.version, step=target.step)
    finally:
        for part in (rewards, environments, engines):
            if part is not None:
                part.close()


def load_scored_policy(cfg: Config, target: EvalTarget, tokenizer: Any) -> Any:
    """The run's model as configured (LoRA, quantized base), the target's weights in it."""
    import torch

    from leangrpo.checkpoint.local import load_model_weights
    from leangrpo.model.policy import load_policy, resolve_device

    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    policy = load_policy(cfg, tokenizer, resolve_device(cfg.run.device))
    if target.kind == "checkpoint" or target.adapter:  # full final/: loaded as the model itself
        try:
            load_model_weights(policy.model, target.weights)
        except Exception as e:  # a tensor that does not read back, or does not fit
            raise EvalTargetError(
                f"the weights in {str(target.weights)!r} cannot be loaded: {e}"
            ) from None
    broken = [
        n
        for n, p in policy.model.named_parameters()
        if p.is_floating_point() and not torch.isfinite(p).all()
    ]
    if broken:
        raise EvalTargetError(
            f"{str(target.path)!r} holds non-finite weights ({broken[0]}{f' and {len(broken) - 1} more' if len(broken) > 1 else ''}); it is damaged, or its run diverged: evaluate an earlier checkpoint."
        )
    return policy


def write_row(out: str | Path | None, target: EvalTarget, cfg: Config, metrics: dict) -> Path:
    """One JSON row (the step, what was scored, on what, the figures) appended to `out`."""
    path = Path(out) if out is not None else (target.run_dir or target.path.parent) / EVAL_FILE
    data = cfg.data.eval_path or cfg.data.path or cfg.data.dataset
    row = {"step": target.step, "checkpoint": str(target.path), "data": str(data), **metrics}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({k: _json_number(v) for k, v in row.items()}) + "\n")
    return path


def _json_number(value: Any) -> Any:
    return None if isinstance(value, float) and value != value else value


def render(result: EvalResult) -> str:
    """What `leangrpo eval` prints: the figures, one a line, and where they went."""
    width = max((len(k) for k in result.metrics), default=0)
    note = f"; {result.note}" if result.note else ""
    lines = [f"leangrpo eval: {result.target} (step {result.step}{note})"]
    lines += [f"  {k:<{width}}  {v:.4g}" for k, v in sorted(result.metrics.items())]
    lines.append(f"  written to {result.written_to}")
    return "\n".join(lines)
