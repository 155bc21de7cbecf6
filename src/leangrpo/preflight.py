"""The cheap checks, in one place: everything that can fail before the model loads.

`preflight(cfg)` runs right after the config validates and imports no torch, so bad input
costs a second, not a model load. In order (the run directory last, since locking it is
the first thing that touches the disk):

0. the rollout engine is installed (vLLM, where this process runs it);
1. data files: exist, UTF-8, parse (Parquet magic, CSV quoting and field counts, named by
   line), columns, every prompt typed and non-empty (data/prompts.py, data/files.py);
2. reward functions resolve (rewards/registry.py), and so do an environment's names and
   files (environments/registry.py; it is imported at the trainer's set-up, before the
   model loads: environments/setup.py), and an agent's entry or command (agents/check.py);
   a `namespace` sandbox asked for can start here
   (sandbox/levels.py);
3. model files: config.json, weights, safetensors headers, tokenizer (model/files.py),
   a quantized base's needs (bitsandbytes installed, the CPU, vLLM's in-flight
   quantization: model/quantization.py), and the prompt limit that follows from the
   model's context; a prompt whose text is longer than that many tokens can hold is
   refused before anything is tokenised (data/lengths.py); with data.chat_template and the
   tokenizer's record (model/tokenizer.py `recall`), a prompt of each kind of messages
   rendered, so a role the template refuses is named (data/prompts.py `check_chat_rows`);
   then an environment section's
   checks (environments/check.py: names, template, the environment and its tools imported
   in a worker, rewards that could only be 0, and with the tokenizer's record the template
   and the prompts' first turns);
4. a distillation teacher: its files, a quantized teacher's needs, and its tokenizer
   mapping every id to the policy's token (distill/check.py); a served teacher's servers
   (distill.teacher_urls) asked what their model's tokenizer and context are;
   the metrics backends are installed; what torchrun runs cannot do, and a
   distributed.context_parallel_size that the processes or the model's heads cannot take
   (`check_world`, `check_context_parallel`); options that do nothing in the chosen mode
   are listed in one warning;
5. the run directory is locked and classified: resume (from the newest intact
   checkpoint), finished, or a clean start (checkpoint/rundir.py), config changes since
   the resume checkpoint checked. An earlier run that run.overwrite replaces stays in
   place until the trainer's set-up is done (`RunDir.begin_writing`).

`leangrpo check CONFIG` runs the same `preflight(cfg, dry=True)`: the run directory is
classified without being created, locked or changed (cli.py); then what the set-up runs
before the model loads (`check_summary`), with the tokenizer's record where an earlier run
or check left one (`check_tokenizer`: no transformers or torch, about a second in all).

The trainer's set-up takes the returned `Preflight` over (it releases the lock at close)
and runs `load_checked_tokenizer` and `prepare_prompts` (prompts, `check_micro_batch`) before the model
loads; so does `leangrpo check`.

Under torchrun every rank runs checks 1-4 (`check_inputs`; only rank 0 warns), then rank
0 alone opens the run directory and broadcasts its decision, or its error, which every
rank then raises (`open_shared_run_dir`): the other ranks never take or wait for the lock.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from leangrpo.checkpoint.overwrite import ASIDE
from leangrpo.checkpoint.rundir import RunDir, RunDirError, open_run_dir
from leangrpo.config import ConfigError
from leangrpo.data.files import CheckedFile
from leangrpo.data.lengths import check_prompt_text
from leangrpo.data.prompts import (
    PromptLimit,
    PromptSet,
    check_chat_rows,
    check_data,
    load_prompts,
)
from leangrpo.distill.check import check_teacher
from leangrpo.model.files import (
    EXPERT_KEYS,
    ModelFiles,
    attention_heads,
    check_context_heads,
    check_model_files,
    check_model_fits,
    check_tokenizer_fits,
    declared_experts,
    read_model_config,
)
from leangrpo.model.quantization import check_environment as check_quantization_environment
from leangrpo.model.tokenizer import recall

log = logging.getLogger("leangrpo")


@dataclass
class Preflight:
    """What the cheap checks found; the run directory stays locked until `release()`."""

    run_dir: RunDir
    model: ModelFiles
    prompt_limit: PromptLimit | None

    @property
    def finished(self) -> bool:
        return bool(self.run_dir.finished)

    def finished_message(self) -> str:
        return self.run_dir.finished

    def release(self) -> None:
        self.run_dir.release()


def preflight(cfg: Any, ctx: Any = None, dry: bool = False) -> Preflight:
    """Every check; `ctx` (a DistContext) when running under torchrun; `dry`: the run
    directory is only inspected (`leangrpo check`)."""
    model, limit = check_inputs(cfg, warn=ctx is None or ctx.is_main)
    run_dir = open_run_dir(cfg, dry=True) if dry else open_shared_run_dir(cfg, ctx)
    return Preflight(run_dir, model, limit)


def check_inputs(
    cfg: Any, warn: bool = True, training: bool = True
) -> tuple[ModelFiles, PromptLimit | None]:
    """Checks 1-4: everything but the run directory; `training` False: for scoring only
    (`leangrpo eval`: no backward pass)."""
    from leangrpo.rewards import check_rewards

    check_engine_installed(cfg)
    data_files = check_data(cfg.data)
    check_reward_columns(cfg, check_rewards(cfg.rewards), data_files)
    if cfg.environment is not None:  # the names and files; the import is the trainer's set-up
        from leangrpo.environments.registry import spec_of
        from leangrpo.sandbox.levels import check_level

        spec_of(cfg.environment)
        check_level(cfg.environment, "environment")
    if cfg.agent is not None:  # the entry's file or module, the command's program; no import
        from leangrpo.agents.check import check_agent
        from leangrpo.sandbox.levels import check_level

        check_agent(cfg.agent)
        check_level(cfg.agent, "agent")
    model = check_model_files(cfg.model)
    check_model_fits(cfg, model)
    if cfg.data.chat_template and cfg.environment is None:  # its check renders the first turns
        check_chat_rows(cfg.data, recall(model.directory))
    check_attention_backend(cfg, training=training)
    check_quantization_environment(cfg)
    limit = prompt_limit(cfg, model)
    check_trajectory_fits_micro_batch(cfg)  # after the context: the limit to name first
    if limit is not None:  # prompts too long by their text alone, untokenised
        bound = check_prompt_text(cfg.data, limit, model.directory)
        limit = dataclasses.replace(limit, text=bound)
    if cfg.environment is not None:  # environment, tools, template, first turns (< 2 s)
        from leangrpo.environments.check import check_environment

        check_environment(cfg, model.directory, limit)
    from leangrpo.metrics.logger import check_backends  # rich: imported once it is needed

    check_backends(list(cfg.logging.backends))
    check_world(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    check_context_parallel(cfg, int(os.environ.get("WORLD_SIZE", "1")), model)
    check_teacher(cfg, model, int(os.environ.get("WORLD_SIZE", "1")), limit)
    check_mixture_of_experts(cfg, model)
    ignored = ignored_options(cfg)
    if ignored and warn:
        log.warning("options ignored in this configuration: %s", "; ".join(ignored))
    if warn:
        warn_threads_over_cores(cfg)
    return model, limit


def check_engine_installed(cfg: Any) -> None:
    """vLLM must be importable where this process runs it: colocated, or the local server
    it starts when rollout.vllm.urls is empty (servers at urls need none here)."""
    v = cfg.rollout.vllm
    if cfg.rollout.engine != "vllm" or (v.mode == "server" and v.urls):
        return
    if importlib.util.find_spec("vllm") is None:
        from leangrpo.rollout.vllm.settings import INSTALL_HINT

        where = "runs vLLM in this process" if v.mode == "colocate" else "starts a local vLLM server"
        raise ConfigError(
            f"rollout.engine: vllm (rollout.vllm.mode: {v.mode}) {where}, but vLLM is not installed for {sys.executable}; install it with {INSTALL_HINT}, or set rollout.engine: hf."
        )


def builtin_columns(spec: Any) -> list[str]:
    """The data columns a built-in reward reads; none for user code, a function sent by
    value included, whose name may be a built-in's (a notebook's own `math`)."""
    from leangrpo.rewards.builtin import columns_read
    from leangrpo.rewards.registry import is_user_code

    return [] if is_user_code(spec) else columns_read(spec.name, spec.kwargs)


def check_reward_columns(cfg: Any, specs: list, data_files: dict[str, CheckedFile]) -> None:
    """The data columns the built-in rewards read exist in every local data file and are
    passed to the rewards (data.columns), known before the model loads; a hub dataset's
    columns are known only once it loads."""
    multi = cfg.multi_turn() is not None
    extra = {"messages", "num_turns", "tool_calls", "env_rewards"} if multi else set()
    for i, spec in enumerate(specs):
        for column in builtin_columns(spec):
            if column in spec.kwargs or column in extra:
                continue
            where = f"rewards.functions[{i}] ({spec.name}) reads column {column!r}"
            if spec.kwargs.get("answer_column"):
                where += " (kwargs.answer_column)"
            for key, checked in data_files.items():
                if column not in checked.columns:
                    raise ConfigError(
                        f"{where}, but {key} has no such column (it has: {', '.join(checked.columns)}); set the reward's kwargs.answer_column to one of them, or rename a column with data.column_map."
                    )
            passed = cfg.data.columns
            if passed is not None and column not in passed:
                raise ConfigError(
                    f"{where}, but data.columns passes only {', '.join(passed) or 'no column'} to the rewards; add {column!r} to data.columns."
                )


def check_attention_backend(cfg: Any, device: str | None = None, training: bool = True) -> None:
    """A packed-attention kernel asked for by name must run where the run does: the CUDA
    kernels on a GPU, flash_varlen with flash-attn installed, flex not for training on
    the CPU (torch has no CPU flex backward; its forward, for scoring, runs there).
    `device`: the device run.device resolved to (the trainer's set-up, for `auto`); else
    run.device. ops/attention/adapter.py says it again, with the device, before the
    model's first forward."""
    backend = cfg.packing.attention_backend
    device = device or cfg.run.device
    where = f"run.device is {cfg.run.device}"
    if device != cfg.run.device:
        where += f" ({device} here)"
    if backend == "flex" and training and device == "cpu":
        raise ConfigError(
            f"packing.attention_backend: flex cannot train on the CPU (torch's flex attention has no backward there), but {where}; set packing.attention_backend: auto (or sdpa_segments), or run on a GPU."
        )
    if backend not in ("flash_varlen", "torch_varlen"):
        return
    if device == "cpu":
        raise ConfigError(
            f"packing.attention_backend: {backend} needs a CUDA device, but {where}; set packing.attention_backend: auto (or sdpa_segments), or run on a GPU."
        )
    if backend == "flash_varlen" and importlib.util.find_spec("flash_attn") is None:
        raise ConfigError(
            f"packing.attention_backend: flash_varlen needs the flash-attn package, which is not installed for {sys.executable}; pip install flash-attn, or set packing.attention_backend: auto."
        )


def check_trajectory_fits_micro_batch(cfg: Any) -> None:
    """A micro-batch must hold a whole trajectory (environment.max_total_tokens, or
    agent.max_total_tokens: one segment of an episode); checked after `prompt_limit`, which
    names a max_total_tokens over the model's context first."""
    multi = cfg.multi_turn()
    if multi is not None and cfg.train.micro_batch_tokens < multi[1]:
        key, total = multi
        raise ConfigError(
            f"train.micro_batch_tokens ({cfg.train.micro_batch_tokens}) must be at least {key}.max_total_tokens ({total}), because a micro-batch must hold a whole trajectory; raise train.micro_batch_tokens or lower {key}.max_total_tokens."
        )


def warn_threads_over_cores(cfg: Any) -> None:
    """run.num_threads above the cores this process may use only makes threads wait."""
    threads = cfg.run.num_threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if threads and cores and threads > cores:
        log.warning(
            "run.num_threads is %d but this process may use %d CPU cores: the extra threads only wait for one; set run.num_threads to %d or less (0 = torch's default)",
            threads,
            cores,
            cores,
        )


def check_world(cfg: Any, world_size: int) -> None:
    """What torchrun runs cannot do (yet), in one sentence each."""
    if world_size < 2:
        return
    if cfg.rollout.engine == "vllm" and cfg.rollout.vllm.mode == "colocate":
        raise ConfigError(
            f"rollout.vllm.mode is 'colocate', which runs vLLM inside one trainer process, but this run has {world_size} torchrun processes; start `leangrpo serve` on other GPUs or nodes and set rollout.vllm.mode: server with rollout.vllm.urls, or use rollout.engine: hf."
        )
    if cfg.model.quantization == "int8":
        raise ConfigError(
            f"model.quantization: int8 cannot be sharded by FSDP2 (bitsandbytes' int8 layers lose their scales when their weight becomes a DTensor), and this run has {world_size} torchrun processes; use model.quantization: nf4 or fp4, which shard, or one process."
        )
    if cfg.rollout.engine == "hf" and cfg.pipeline.min_groups_per_step is not None:
        raise ConfigError(
            f"pipeline.min_groups_per_step (streaming) lets each process take whatever chunks are ready, which {world_size} torchrun processes generating their own shares with the hf engine cannot agree on; unset it, or generate with vLLM servers (rollout.vllm.mode: server), where rank 0 decides."
        )


def check_context_parallel(cfg: Any, world_size: int, model: ModelFiles) -> None:
    """distributed.context_parallel_size C must fit the processes and the model's heads:
    one sentence each, before the model loads (its config.json, when on disk, tells the
    heads; the set-up checks the attention itself, distributed/mesh.py)."""
    c = cfg.distributed.context_parallel_size
    if c == 1:
        return
    if world_size < 2:
        raise ConfigError(
            f"distributed.context_parallel_size is {c}, which splits each sequence over {c} processes, but this run is a single process; start it with torchrun --nproc_per_node {c} (or a multiple of {c}), or set distributed.context_parallel_size: 1."
        )
    if world_size % c:
        raise ConfigError(
            f"distributed.context_parallel_size ({c}) does not divide the {world_size} torchrun processes; use a context_parallel_size that divides {world_size}, or start a multiple of {c} processes."
        )
    if model.directory is None:
        return
    heads = attention_heads(read_model_config(cfg.model))
    check_context_heads(c, heads, cfg.model.name_or_path)


def check_mixture_of_experts(cfg: Any, model: ModelFiles) -> None:
    """Routing replay and the router's aux loss need routers: config.json must declare
    experts (a hub model not cached yet is checked when it loads, model/moe/control.py)."""
    asked = [
        key
        for key, on in (
            ("rollout.routing_replay", cfg.rollout.routing_replay),
            ("train.router_aux_loss_coef", cfg.train.router_aux_loss_coef > 0),
        )
        if on
    ]
    if not asked or model.directory is None:
        return
    if not declared_experts(read_model_config(cfg.model)):
        raise ConfigError(
            f"{asked[0]} needs a mixture-of-experts model, but config.json of model.name_or_path = {cfg.model.name_or_path!r} declares no experts ({', '.join(EXPERT_KEYS)}); turn it off for this dense model."
        )


def open_shared_run_dir(cfg: Any, ctx: Any = None) -> RunDir:
    """open_run_dir on rank 0; its decision (or error) broadcast to the other ranks."""
    if ctx is None or not ctx.distributed:
        return open_run_dir(cfg)
    if not ctx.is_main:
        decision = ctx.broadcast_object(None)
        if "error" in decision:
            error = RunDirError(decision["error"])
            error.shown_by_rank_0 = True  # type: ignore[attr-defined]  # the CLI prints it once
            raise error
        return RunDir.follower(decision)
    try:
        run_dir = open_run_dir(cfg)
    except Exception as exc:
        told = str(exc) if isinstance(exc, RunDirError) else f"rank 0 failed to open it: {exc}"
        ctx.broadcast_object({"error": told})
        raise
    ctx.broadcast_object(run_dir.decision())
    return run_dir


def prompt_limit(cfg: Any, model: ModelFiles) -> PromptLimit | None:
    """The smaller of data.max_prompt_tokens and the room the context leaves a prompt."""
    new_tokens = cfg.rollout.max_new_tokens
    limits = []
    if cfg.data.max_prompt_tokens is not None:
        limits.append(
            PromptLimit(
                cfg.data.max_prompt_tokens, f"data.max_prompt_tokens = {cfg.data.max_prompt_tokens}"
            )
        )
    contexts = []
    if model.context is not None:
        contexts.append(
            (
                model.context,
                f"the model's context of {model.context} positions ({model.context_source})",
            )
        )
    vllm_len = cfg.rollout.vllm.max_model_len
    if cfg.rollout.engine == "vllm" and vllm_len is not None:
        contexts.append((vllm_len, f"rollout.vllm.max_model_len = {vllm_len}"))
    multi = cfg.multi_turn()  # (environment | agent, its max_total_tokens)
    for context, what in contexts:
        if context <= new_tokens:
            raise ConfigError(
                f"rollout.max_new_tokens ({new_tokens}) leaves no room for a prompt in {what}; lower rollout.max_new_tokens."
            )
        if multi is not None and multi[1] > context:
            raise ConfigError(
                f"{multi[0]}.max_total_tokens ({multi[1]}) exceeds {what}, so a long trajectory would run past the positions the model has; lower {multi[0]}.max_total_tokens."
            )
        limits.append(
            PromptLimit(context - new_tokens, f"{what} minus rollout.max_new_tokens = {new_tokens}")
        )
    if multi is not None:  # the first turn must fit the trajectory's budget
        limits.append(
            PromptLimit(
                multi[1] - new_tokens,
                f"{multi[0]}.max_total_tokens = {multi[1]} minus rollout.max_new_tokens = {new_tokens}",
            )
        )
    return min(limits, key=lambda lim: lim.tokens, default=None)


def load_checked_tokenizer(cfg: Any, checked: Preflight) -> tuple[Any, PromptLimit | None]:
    """The set-up's first step past the cheap checks (the trainer's and `leangrpo
    check`'s): a hub model's config.json fetched for its context, and the tokenizer.
    Returns the tokenizer and the prompt limit."""
    from leangrpo.model.policy import load_tokenizer  # transformers: not a cheap check

    limit = checked.prompt_limit
    if checked.model.directory is None:  # a hub model not cached yet: fetch config.json
        limit = prompt_limit(cfg, check_model_files(cfg.model, fetch=True))
    tokenizer = load_tokenizer(cfg.model)
    # what tokenizer.json could not tell (another tokenizer format, a hub model)
    check_tokenizer_fits(cfg.model.name_or_path, read_model_config(cfg.model), len(tokenizer))
    return tokenizer, limit


def prepare_prompts(
    cfg: Any, tokenizer: Any, limit: PromptLimit | None, first_turn: Any = None
) -> PromptSet:
    """Every prompt rendered (as its first turn renders it, for multi-turn), tokenised and
    held to the limit, and the longest sequence against the micro-batch; still before the
    model loads."""
    prompts = load_prompts(cfg.data, tokenizer, cfg.run.seed, limit, first_turn)
    check_micro_batch(prompts.train, cfg)
    check_reward_cells(cfg, prompts)
    return prompts


def check_tokenizer(cfg: Any, checked: Preflight) -> tuple[Any, PromptLimit | None, str]:
    """`leangrpo check`'s tokenizer: the record an earlier run or check left
    (model/tokenizer.py `recall`: exactly what transformers' tokenizer does, read without
    transformers or torch, which take seconds to import), else the real one, loaded as the
    set-up loads it and remembered for the next check. Returns it, the prompt limit, and
    which it was."""
    from leangrpo.model.tokenizer import records_dir, remember

    record = recall(checked.model.directory)
    if record is not None:
        return record, checked.prompt_limit, "its record from an earlier run or check (transformers not loaded)"
    tokenizer, limit = load_checked_tokenizer(cfg, checked)
    kept = remember(checked.model.directory, tokenizer)
    how = f"loaded with transformers{f'; its record kept in {records_dir()} for the next check' if kept else ''}"
    return tokenizer, limit, how


def check_reward_cells(cfg: Any, prompts: PromptSet) -> None:
    """Prompts without a value in a column a built-in reward reads (the math reward's
    answers) leave their completions unscored: counted in one warning, and refused when
    no train prompt has one."""
    from leangrpo.rewards import parse_specs

    for i, spec in enumerate(parse_specs(cfg.rewards)):
        for column in builtin_columns(spec):
            if column in spec.kwargs:
                continue
            reads = f"column {column!r}, which rewards.functions[{i}] ({spec.name}) reads"
            empty = {
                split: [p.uid for p in group if p.columns.get(column) is None]
                for split, group in (("train", prompts.train), ("eval", prompts.eval))
            }
            if len(empty["train"]) == len(prompts.train):
                raise ConfigError(
                    f"no train prompt has a value in {reads}, so no completion could be scored; fill the column in, or point the reward's kwargs.answer_column at the column that holds the answers."
                )
            counts = [f"{len(empty[s])} of {len(g)} {s} prompts (rows {_rows_of(empty[s])})" for s, g in (("train", prompts.train), ("eval", prompts.eval)) if empty[s]]  # fmt: skip
            if counts:
                log.warning(
                    "%s have no value in %s: their completions are left unscored (reward/unscored); fill them in or drop those rows",
                    " and ".join(counts),
                    reads,
                )


def _rows_of(uids: list[int], shown: int = 5) -> str:
    text = ", ".join(str(u) for u in sorted(uids)[:shown])
    return text + (f" and {len(uids) - shown} more" if len(uids) > shown else "")


def check_summary(cfg: Any, checked: Preflight, load_model: bool = False) -> Iterator[str]:
    """`leangrpo check` after `preflight(cfg, dry=True)`: one line per check as it passes,
    running what the trainer's set-up runs before the model loads (the tokenizer, the
    environment's start-up, `prepare_prompts`, the probe), and with `load_model` the model load itself."""
    yield f"run directory: {describe_run_dir(checked.run_dir)}"
    tokenizer, limit, how = check_tokenizer(cfg, checked)
    yield f"tokenizer: {how}"
    environments = None
    if cfg.environment is not None:
        from leangrpo.environments.setup import start_environments

        one_worker = cfg.model_copy(update={"environment": cfg.environment.model_copy(update={"num_workers": 1})})
        environments = start_environments(one_worker, tokenizer)  # one worker: one probe
    try:
        first_turn = environments.renderer.first_turn if environments is not None else None
        prompts = prepare_prompts(cfg, tokenizer, limit, first_turn)
        longest = max(len(p.ids) for p in [*prompts.train, *prompts.eval])
        allowed = f" ({limit.tokens} allowed by {limit.reason})" if limit is not None else ""
        counts = [
            (int(prompts.metrics[f"data/{what}_prompts"]), what)
            for what in ("dropped", "truncated")
        ]
        yield (
            f"prompts: {len(prompts.train)} to train on, {len(prompts.eval)} to evaluate; the "
            f"longest has {longest} tokens{allowed}"
            + "".join(f", {n} {what}" for n, what in counts if n)
        )
        if environments is not None:
            environments.probe(prompts.train[0])
            yield f"environment: {cfg.environment.name} started, its template checked and a reset probed"
    finally:
        if environments is not None:
            environments.close()
    if not load_model:
        yield "model: its files are checked, not loaded (add --model to load it)"
        return
    from leangrpo.model.policy import load_policy, load_tokenizer, resolve_device

    device = resolve_device(cfg.run.device)
    policy = load_policy(cfg, load_tokenizer(cfg.model), device)  # the real one, as training
    total = sum(p.numel() for p in policy.model.parameters())
    trained = sum(p.numel() for p in policy.trainable_parameters())
    yield f"model: loaded on {device}, {total:,} parameters, {trained:,} of them trained"


def describe_run_dir(run_dir: RunDir) -> str:
    """What a run would do with its directory, as `open_run_dir(dry=True)` decided."""
    path = str(run_dir.path)
    if (run_dir.path / ASIDE).is_dir() or (run_dir.path / f"{ASIDE}.tmp").is_dir():
        return f"{path} holds {ASIDE}/, left by a run killed while replacing an earlier one: train settles it first (deleted beside a complete checkpoint, else put back), so what it then does is decided only after that"
    if run_dir.finished:
        return run_dir.finished
    if run_dir.resume_from is not None:
        notes = (
            f"; changed settings: {'; '.join(run_dir.config_notes)}" if run_dir.config_notes else ""
        )
        return f"{path}: resumes from {run_dir.resume_from} (step {run_dir.resume_step}, its files verified){notes}"
    if run_dir.replaces:
        return f"{path}: run.overwrite replaces the earlier run there ({', '.join(run_dir.replaces)}) once the new run has written its first checkpoint"
    if run_dir.leftovers:
        return f"{path}: a fresh start, deleting what a run that failed before its first step left there ({', '.join(run_dir.leftovers)})"
    return f"{path}: a fresh start" + ("" if run_dir.path.is_dir() else " (to be created)")


def check_micro_batch(prompts: list, cfg: Any) -> None:
    """Every sequence (prompt + up to max_new_tokens) must fit one micro-batch (a
    trajectory's environment.max_total_tokens do: a rule of the config)."""
    if not prompts or cfg.multi_turn() is not None:
        return
    longest = max(prompts, key=lambda p: len(p.ids))
    need = len(longest.ids) + cfg.rollout.max_new_tokens
    budget = cfg.train.micro_batch_tokens
    if need > budget:
        raise ConfigError(
            f"train.micro_batch_tokens ({budget}) is smaller than the longest sequence a micro-batch must hold: prompt row {longest.uid} has {len(longest.ids)} tokens plus rollout.max_new_tokens = {cfg.rollout.max_new_tokens} makes {need}; raise train.micro_batch_tokens to at least {need} or lower data.max_prompt_tokens."
        )


# -- options that do nothing ----------------------------------------------------------------


def ignored_options(cfg: Any) -> list[str]:
    """'keys (why)' for every option set away from its default that this mode never reads."""
    has_eval = cfg.data.eval_path or cfg.data.eval_split or cfg.data.eval_size > 0
    tracker = {"wandb", "trackio"} & set(cfg.logging.backends)
    engine, vllm_mode = cfg.rollout.engine, cfg.rollout.vllm.mode
    replay_age = _replay_age(cfg)
    rules = [
        (cfg.pipeline.mode == "sync", "pipeline", ("prefetch_depth", "min_groups_per_step"), "pipeline.mode is sync"),
        (cfg.generates_with_live_weights(), "pipeline", ("sync_interval",), "the hf engine in sync mode generates with the trainer's live weights"),
        (engine == "hf", "rollout.vllm", None, "rollout.engine is hf"),
        (engine == "vllm", "rollout", ("hf_prompts_per_forward", "max_batch_size", "kv_cache_tokens"), "rollout.engine is vllm"),
        (cfg.multi_turn() is None, "rollout", ("max_batch_size", "kv_cache_tokens"), "there is no environment or agent: single-turn generation batches by rollout.hf_prompts_per_forward"),
        (cfg.multi_turn() is not None and engine == "hf", "rollout", ("hf_prompts_per_forward",), "multi-turn turns decode in a continuous batch of rollout.max_batch_size rows"),
        (engine == "vllm" and vllm_mode == "colocate", "rollout.vllm", ("urls", "request_timeout_s", "max_retries"), "rollout.vllm.mode is colocate"),
        (engine == "vllm" and vllm_mode == "server", "rollout.vllm", ("share_weights", "adapter_sync"), "rollout.vllm.mode is server"),
        (cfg.shares_vllm_weights() and not cfg.lora.enabled and cfg.pipeline.mode == "sync", "pipeline", ("sync_interval",), "colocated vLLM shares the trainer's weights (rollout.vllm.share_weights), so it generates with the live weights"),
        (cfg.offload.activations == "none", "offload", ("keep_last_layers", "min_tensor_bytes"), "offload.activations is none"),
        (not has_eval, "eval", None, "there are no eval prompts: data.eval_path, data.eval_split and data.eval_size are unset"),
        (not cfg.lora.enabled, "lora", None, "lora.enabled is false"),
        (cfg.model.quantization == "none", "model", ("quantization_compute_dtype", "quantization_double_quant"), "model.quantization is none"),
        (cfg.model.quantization == "int8", "model", ("quantization_compute_dtype", "quantization_double_quant"), "model.quantization is int8, whose layers compute in their input's dtype with one scale per row"),
        (cfg.loss.is_correction == "none", "loss", ("is_mode", "is_cap", "is_min"), "loss.is_correction is none"),
        (cfg.loss.is_correction == "bypass", "loss", ("is_mode", "is_cap", "is_min"), "loss.is_correction is bypass: the clipped ratio against the behaviour log-probs is the correction, no IS weight is applied"),
        (not cfg.pipeline.replay.enabled, "pipeline.replay", ("capacity",), "pipeline.replay.enabled is false"),
        (not cfg.pipeline.reroll.enabled, "pipeline.reroll", ("max_attempts",), "pipeline.reroll.enabled is false"),
        (replay_age > cfg.pipeline.max_staleness, "pipeline.replay", ("enabled",), f"a replayed group comes from an earlier batch, normally {replay_age} versions old (loss.mu x train.steps_per_generation updates per batch), beyond pipeline.max_staleness = {cfg.pipeline.max_staleness}"),
        (not cfg.logprobs.chunked, "logprobs", ("row_tile", "vocab_tile"), "logprobs.chunked is false"),
        (cfg.data.dataset is None, "data", ("dataset_config", "split"), "data.path is used, not data.dataset"),
        (not tracker, "logging", ("wandb_project",), "logging.backends has neither wandb nor trackio"),
    ]  # fmt: skip
    found = []
    for applies, path, names, why in rules:
        if not applies:
            continue
        section = cfg
        for part in path.split("."):
            section = getattr(section, part)
        changed = _changed(section, names)
        if changed:
            found.append(f"{', '.join(f'{path}.{name}' for name in changed)} ({why})")
    return found


def _replay_age(cfg: Any) -> int:
    """Versions between a batch and the next at full size: the youngest a stand-in can be."""
    streaming = cfg.pipeline.mode == "async" and cfg.pipeline.min_groups_per_step is not None
    groups = cfg.pipeline.min_groups_per_step if streaming else cfg.rollout.prompts_per_batch
    return cfg.loss.mu * min(cfg.train.steps_per_generation, groups)


def _changed(section: Any, names: tuple[str, ...] | None) -> list[str]:
    fields = type(section).model_fields
    return [
        name
        for name in (names or tuple(fields))
        if getattr(section, name) != fields[name].get_default(call_default_factory=True)
    ]
