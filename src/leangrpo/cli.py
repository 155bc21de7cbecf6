"""`leangrpo train | check | plan | report | merge | eval | serve | serve-agent`, `--version`:
thin entry points,
heavy imports deferred.

Errors that are the user's to fix (config, data, reward functions, model files, the run
directory) print one sentence and exit with status 2; everything else keeps its
traceback. `train` runs every cheap check (preflight.py) before it imports the trainer, so
torch is never imported for a run that cannot start; a run already finished prints one
line and exits 0. Then it starts the reward and environment workers (prestart.py) and
imports the trainer, saying what it does as it goes; a run that ends prints a short
summary (metrics/report.py `run_summary`) and exits without the interpreter's teardown of
torch (every file is closed by then). Output cut short by its reader (`plan ... | head`)
ends quietly (exit 141). A run stopped by SIGTERM or Ctrl-C once training has begun saves a checkpoint at
the step it reached, prints one line and exits 128 + the signal (143, 130; stopping.py).

Under torchrun (WORLD_SIZE > 1) every rank runs the input checks first (no torch), then
joins the process group; rank 0 alone locks and classifies the run directory and tells
the others. A rank stopped by another rank's failure prints one line naming that rank
and the phase and exits 1; ranks > 0 log warnings and errors only.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
import time

from leangrpo.errors import is_user_error
from leangrpo.stopping import RunStopped  # no torch: stdlib only

STARTED = time.monotonic()  # the summary's time counts from the command's start


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    """`plan`'s own options: the shape and the world to plan for."""
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="tokens per micro-batch to plan for (default: train.micro_batch_tokens)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="longest prompt in tokens (default: data.max_prompt_tokens, else 512)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="torchrun ranks, sharded with FSDP (default: $WORLD_SIZE, else 1)",
    )
    p.add_argument(
        "--memory",
        type=float,
        default=None,
        metavar="GIB",
        help="also print the longest micro-batch (sequence) that fits GIB per device",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="leangrpo", description="Memory-lean, asynchronous GRPO training."
    )
    parser.add_argument("--version", action=_Version, help="print leangrpo's version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in [
        ("train", "train a policy with GRPO"),
        (
            "check",
            "run every check `train` runs before the model loads, then exit (writes nothing in the run directory)",
        ),
        ("plan", "estimate the memory a config needs, without loading the model"),
    ]:
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("config", help="YAML config file")
        p.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config value, e.g. train.learning_rate=1e-5",
        )
        if name == "check":
            p.add_argument(
                "--model",
                action="store_true",
                help="also load the model (and LoRA, quantization) as training would",
            )
        if name == "plan":
            _plan_arguments(p)
    rep = sub.add_parser(
        "report",
        help="summarise a run directory, and draw its dashboard",
        description="Print first / last / min / max of a run's key metrics (from RUN_DIR/metrics.jsonl) and, when matplotlib is installed, write its dashboard into the run directory: RUN_DIR/report.png (the curves by step) and RUN_DIR/report.html (the picture and the table).",
    )
    rep.add_argument("run_dir", metavar="RUN_DIR", help="a run's output directory (run.output_dir)")
    text = (
        "merge a LoRA run's adapter into its base: a full model directory a new run can start from"
    )
    merge = sub.add_parser("merge", help=text, description=text)
    merge.add_argument(
        "source", help="the run directory (its final/ is used) or an adapter directory"
    )
    merge.add_argument("out", help="the merged model's directory (must not exist)")
    _eval_parser(sub)
    sub.add_parser(
        "serve", help="start a vLLM server with leangrpo's weight-sync extension", add_help=False
    )
    text = "serve a policy on the OpenAI-compatible agent endpoint, for an outside agent (no training)"
    sa = sub.add_parser("serve-agent", help=text, description=text + "; docs/agents.md.")
    sa.add_argument("config", help="YAML config file (its model, rollout sampling, agent limits)")
    sa.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value")  # fmt: skip
    sa.add_argument("--model", default=None, metavar="DIR",
                    help="the model to serve: a run's final/ or a model directory (default: model.name_or_path)")  # fmt: skip
    sa.add_argument("--port", type=int, default=8000, help="the loopback port (0: a free one; default 8000)")
    return parser


def _eval_parser(sub) -> None:
    """`eval`'s arguments (api/evaluation.py does the work)."""
    text = "score a run's final/ or a checkpoint on a data set with reward functions (the eval/* figures a run logs)"
    p = sub.add_parser(
        "eval",
        help=text,
        description=text + "; they are printed and appended to RUN_DIR/eval.jsonl.",
    )
    p.add_argument(
        "target",
        metavar="RUN_OR_CHECKPOINT",
        help="a run directory (its final/, or its newest intact checkpoint when that is newer), a checkpoints/step-N or a final/ directory",
    )
    p.add_argument(
        "--data",
        default=None,
        metavar="FILE",
        help="prompts to score (.jsonl, .json, .parquet, .csv; default: the run's own eval prompts)",
    )
    p.add_argument(
        "--rewards",
        nargs="+",
        default=None,
        metavar="NAME",
        help="reward functions, replacing the run's: math, format, length, module:fn or file.py:fn",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        metavar="N",
        help="score the first N prompts (default: eval.num_prompts, else all)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 = greedy (default: the run's eval.temperature)",
    )
    p.add_argument(
        "--num-generations",
        type=int,
        default=None,
        metavar="K",
        help="completions per prompt (default: the run's eval.num_generations)",
    )
    p.add_argument(
        "--config",
        default=None,
        help="the run's settings, when no config.yaml is beside the weights",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="where the row of figures is appended (default: RUN_DIR/eval.jsonl)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a setting of the run's config, e.g. rollout.max_new_tokens=64",
    )


class _Version(argparse.Action):
    """`--version`, looked up only when asked for (importlib.metadata costs a tenth of a
    second at every start otherwise)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("leangrpo")
        except PackageNotFoundError:  # a source tree on sys.path, not installed
            found = "(not installed)"
        print(f"leangrpo {found}")
        parser.exit()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        from leangrpo.rollout.vllm.server import serve_main

        return serve_main(argv[1:])
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _dispatch(args)
    except RunStopped as stop:  # a signal during training: the checkpoint is saved
        if stop.show:  # torchrun: rank 0's line
            print(f"leangrpo: {stop}", file=sys.stderr, flush=True)
        return stop.exit_code
    except KeyboardInterrupt:
        print("leangrpo: interrupted; the last complete checkpoint is intact", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `leangrpo plan ... | head`: the reader has what it wanted
        _silence_stdout()
        return 141  # 128 + SIGPIPE, as a shell tool killed by it
    except Exception as exc:  # user errors: one sentence, no traceback
        if _is_disk_full(exc):  # a write outside a checkpoint (those say it themselves)
            print(f"leangrpo: error: {_disk_full_message(exc)}", file=sys.stderr)
            return 2
        if is_user_error(exc):
            if not getattr(exc, "shown_by_rank_0", False):  # torchrun: one copy of rank 0's
                print(f"leangrpo: error: {exc}", file=sys.stderr)
            return 2
        if _is_distributed_error(exc):  # another rank failed: it printed its own error
            print(f"leangrpo: error: {exc}", file=sys.stderr, flush=True)
            _exit_now(1)
        raise


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush meets no closed pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _exit_now(code: int) -> None:
    """Exit without interpreter teardown: after a peer failed, gloo's threads may still hold
    a collective in flight, and destroying them at exit aborts the process (SIGABRT)
    instead of the exit status torchrun should see."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _dispatch(args) -> int:
    if args.command == "train":
        return _train(args)
    if args.command == "check":
        return _check(args)
    if args.command == "plan":
        return _plan(args)
    if args.command == "merge":
        return _merge(args)
    if args.command == "eval":
        return _eval(args)
    if args.command == "serve-agent":
        return _serve_agent(args)
    from leangrpo.metrics.report import report

    _print(report(args.run_dir))
    return 0


def _plan(args) -> int:
    from leangrpo.config import load_config
    from leangrpo.planner.plan import (
        plan_memory,
        planned_prompt_tokens,
        render_plan,
        world_size_from_env,
    )

    cfg = load_config(args.config, args.overrides)
    world = args.world_size or world_size_from_env()
    prompt, source = planned_prompt_tokens(cfg, args.prompt_tokens)
    given = dict(tokens=args.tokens, prompt_tokens=prompt, world_size=world)
    _print(
        render_plan(
            plan_memory(cfg, **given), cfg, **given, prompt_source=source, memory_gib=args.memory
        )
    )
    return 0


def _print(text: str) -> None:
    """Print and flush now, so a reader that stops early (`| head`) is met in main()."""
    print(text, flush=True)


def _merge(args) -> int:
    from leangrpo.model.files import check_merge

    check_merge(args.source, args.out)  # before torch is imported
    from leangrpo.model import merge_adapter

    print(f"leangrpo: merged model written to {merge_adapter(args.source, args.out)}")
    return 0


def _eval(args) -> int:
    from leangrpo.api.evaluation import evaluate, render

    eval_section = {
        k: v
        for k, v in (("temperature", args.temperature), ("num_generations", args.num_generations))
        if v is not None
    }
    result = evaluate(
        args.target, args.data, reward_funcs=args.rewards, num_prompts=args.num_prompts,
        config=args.config, set_values=args.overrides, out=args.out, data_label="--data",
        **({"eval": eval_section} if eval_section else {}),
    )  # fmt: skip
    _print(render(result))
    return 0


def _serve_agent(args) -> int:
    from leangrpo.config import load_config

    cfg = load_config(args.config, args.overrides)
    from leangrpo.agents.serve import serve_agent

    serve_agent(cfg, args.model, args.port, ready=lambda url: _print(f"leangrpo: serving at {url}"))
    _exit_now(0)  # served and closed: skip tearing torch down
    return 0


def _train(args) -> int:
    from leangrpo.config import load_config
    from leangrpo.preflight import preflight

    cfg = load_config(args.config, args.overrides)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _train_ranks(cfg)
    checked = preflight(cfg)  # holds the run directory's lock from here on
    if checked.finished:
        checked.release()
        print(f"leangrpo: {checked.finished_message()}")
        return 0
    from leangrpo.api.grpo import run_checked

    run_checked(cfg, checked)  # the workers prestarted, then the trainer (as GRPO.train)
    _print_summary(cfg)
    _exit_now(0)  # every file is closed: skip tearing torch down (seconds on a busy machine)
    return 0


def _check(args) -> int:
    """`train`'s checks up to the model load (or through it, `--model`), nothing written."""
    from leangrpo.config import load_config
    from leangrpo.preflight import check_summary, preflight

    cfg = load_config(args.config, args.overrides)
    checked = preflight(cfg, dry=True)
    print(f"leangrpo check: {args.config}: the config and the cheap checks pass", flush=True)
    for line in check_summary(cfg, checked, load_model=args.model):
        print(f"  {line}", flush=True)
    print("leangrpo check: OK (nothing was written to the run directory)")
    return 0


def _train_ranks(cfg) -> int:
    """One torchrun rank: cheap checks, the process group, rank 0's run directory, train."""
    from leangrpo.preflight import Preflight, check_inputs, open_shared_run_dir

    rank = int(os.environ.get("RANK", "0"))
    if rank > 0:  # rank 0 reports progress; the others only warnings and errors
        logging.getLogger("leangrpo").setLevel(logging.WARNING)
    model, limit = check_inputs(cfg, warn=rank == 0)
    from leangrpo.distributed.context import init_distributed  # torch loads from here on

    if rank > 0:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

    ctx = init_distributed(cfg.distributed, cfg.run.device)
    checked = Preflight(open_shared_run_dir(cfg, ctx), model, limit)
    if checked.finished:
        checked.release()
        if ctx.is_main:
            print(f"leangrpo: {checked.finished_message()}")
        ctx.shutdown()
        return 0
    from leangrpo.train import train

    try:
        train(cfg, checked, ctx)
    except RunStopped:  # every rank stopped at the same step and saved it
        ctx.shutdown()
        raise
    ctx.shutdown()
    if ctx.is_main:
        _print_summary(cfg)
    return 0


def _print_summary(cfg) -> None:
    from leangrpo.metrics.report import run_summary

    _print(run_summary(cfg.run.output_dir, time.monotonic() - STARTED))


def _is_distributed_error(exc: Exception) -> bool:
    module = sys.modules.get("leangrpo.distributed.watch")  # loaded only if a process group was
    return module is not None and isinstance(exc, module.DistributedError)


def _is_disk_full(exc: Exception) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _disk_full_message(exc: OSError) -> str:
    where = f" writing {exc.filename}" if exc.filename else ""
    return f"no space left on the disk{where} ({exc.strerror}); free space there or move run.output_dir to a larger disk, then run again: a run resumes from its newest complete checkpoint."


if __name__ == "__main__":
    sys.exit(main())
