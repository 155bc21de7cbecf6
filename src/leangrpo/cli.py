"""`leangrpo train | plan | report | serve`: thin entry points, heavy imports deferred.

Errors that are the user's to fix (config, data, reward functions, model files, the run
directory) print one sentence and exit with status 2; everything else keeps its
traceback. `train` runs every cheap check (preflight.py) before it imports the trainer, so
torch is never imported for a run that cannot start; a finished run prints one line and
exits 0. A run stopped by SIGTERM or Ctrl-C once training has begun saves a checkpoint at
the step it reached, prints one line and exits 128 + the signal (143, 130; stopping.py).

Under torchrun (WORLD_SIZE > 1) every rank runs the input checks first (no torch), then
joins the process group; rank 0 alone locks and classifies the run directory and tells
the others. A rank stopped by another rank's failure prints one line naming that rank
and the phase and exits 1; ranks > 0 log warnings and errors only.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from leangrpo.stopping import RunStopped  # no torch: stdlib only


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="leangrpo", description="Memory-lean, asynchronous GRPO training."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in [
        ("train", "train a policy with GRPO"),
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
        if name == "plan":
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
    rep = sub.add_parser(
        "report", help="summarise a run directory (and plot it if matplotlib is installed)"
    )
    rep.add_argument("run_dir")
    sub.add_parser(
        "serve", help="start a vLLM server with leangrpo's weight-sync extension", add_help=False
    )
    return parser


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
    except Exception as exc:  # user errors: one sentence, no traceback
        if _is_user_error(exc):
            if not getattr(exc, "shown_by_rank_0", False):  # torchrun: one copy of rank 0's
                print(f"leangrpo: error: {exc}", file=sys.stderr)
            return 2
        if _is_distributed_error(exc):  # another rank failed: it printed its own error
            print(f"leangrpo: error: {exc}", file=sys.stderr, flush=True)
            _exit_now(1)
        raise


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
    if args.command == "plan":
        from leangrpo.config import load_config
        from leangrpo.planner.plan import plan_memory, render_plan, world_size_from_env

        cfg = load_config(args.config, args.overrides)
        world = args.world_size or world_size_from_env()
        given = dict(tokens=args.tokens, prompt_tokens=args.prompt_tokens, world_size=world)
        print(render_plan(plan_memory(cfg, **given), cfg, **given, memory_gib=args.memory))
        return 0
    from leangrpo.metrics.report import report

    print(report(args.run_dir))
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
    from leangrpo.train import train

    final = train(cfg, checked)
    print({k: round(v, 4) for k, v in final.items()})
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
        final = train(cfg, checked, ctx)
    except RunStopped:  # every rank stopped at the same step and saved it
        ctx.shutdown()
        raise
    ctx.shutdown()
    if ctx.is_main:
        print({k: round(v, 4) for k, v in final.items()})
    return 0


def _is_distributed_error(exc: Exception) -> bool:
    module = sys.modules.get("leangrpo.distributed.watch")  # loaded only if a process group was
    return module is not None and isinstance(exc, module.DistributedError)


def _is_user_error(exc: Exception) -> bool:
    from leangrpo.errors import user_error_types

    return isinstance(exc, user_error_types())


if __name__ == "__main__":
    sys.exit(main())
