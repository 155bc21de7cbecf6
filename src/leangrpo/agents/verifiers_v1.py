"""verifiers 0.4's v1 stack as an agent command: one episode of a v1 environment (a
`Taskset`, its harness) against the episode's session, its reward printed.

    agent:
      command: /path/to/.venv-verifiers/bin/python -m leangrpo.agents.verifiers_v1 --taskset my-taskset

Run with the python of a venv that has verifiers 0.4 (`make setup-verifiers` makes
.venv-verifiers; the trainer's venv cannot hold it: it pins the classic verifiers < 0.4 for
environments/adapters/verifiers.py, and 0.4 needs openai < 3 and mcp 2). Nothing of
leangrpo's but this module is imported there, and nothing of verifiers at this module's
top, so the trainer's venv can read it.

`run` (the default; agent.command runs it once per episode, in the episode's box): the
environment `--taskset ID` names (an installed taskset package or a module on PYTHONPATH,
as verifiers loads them; its own `Env` or the single-agent one; every agent on the
subprocess runtime, the box being the sandbox; `--harness ID` pins the agents' harness,
else the taskset's own or verifiers' `bash`), the task from stdin (leangrpo's task JSON:
the prompt's `messages` and its data columns; a `vf_task` column is the task's data as
`export` wrote it, else the task's data is the messages as its `prompt` and the columns
its fields of the same names), one episode with verifiers' own machinery
(`Env.serving()`, `Env.run_episode`: its interception server relays every model call of
the harness to OPENAI_BASE_URL with OPENAI_API_KEY, i.e. the episode's session, through
verifiers' eval client), then the one trainable trace's reward (the weighted sum of the
task's rewards, what prime-rl trains on) printed as the last line. An episode that failed
(a trace with an error, a harness that exited non-zero, a model call refused) prints the
error on stderr and exits 1: leangrpo counts it and leaves the episode unscored.

`export --taskset ID --out FILE [--limit N]`: the taskset's tasks as leangrpo data rows
(`messages`: the task's prompt as chat messages; `vf_task`: its data), for data.path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

SESSION_KEY_VAR = "OPENAI_API_KEY"  # the episode's session key (agent.command sets it)


def env_config(taskset: str, harness: str | None = None, overrides: dict | None = None) -> Any:
    """The v1 environment's config: the taskset, every agent role on the subprocess runtime
    (and on `harness` when given), `overrides` merged on top (verifiers' own keys)."""
    import verifiers.v1 as vf

    overrides = dict(overrides or {})
    cls = vf.env_config_type(taskset, overrides.get("id", ""))
    role = {"runtime": {"type": "subprocess"}, **({"harness": {"id": harness}} if harness else {})}
    roles = {name: dict(role) for name, field in cls.model_fields.items() if isinstance(field.default, vf.AgentConfig)}
    return vf.resolve_env_config(_merged({"taskset": {"id": taskset}, **roles}, overrides))


def _merged(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def task_of(env: Any, task: dict) -> Any:
    """The v1 task for leangrpo's task JSON (see the module docstring)."""
    task_cls = type(env.taskset).task_type()
    data_cls = task_cls.data_type()
    if "vf_task" in task:
        data = data_cls.model_validate(task["vf_task"])
    else:
        fields = {k: v for k, v in task.items() if k in data_cls.model_fields and k != "prompt"}
        data = data_cls.model_validate({**fields, "prompt": task["messages"]})
    return task_cls(data, env.taskset.config.task)


async def run_episode(env: Any, task: Any, base_url: str, model: str) -> float:
    """One episode of `task`, every model call to `base_url` with the session's key; the
    trainable trace's reward, or RuntimeError naming what failed."""
    import verifiers.v1 as vf

    client = vf.EvalClientConfig(base_url=base_url, api_key_var=SESSION_KEY_VAR)
    ctx = vf.ModelContext(model=model, client=client)
    async with env.serving():
        episode = await env.run_episode(task, ctx)
    errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
    if errors or not episode.ok:
        raise RuntimeError("; ".join(f"{e.type}: {e.message}" for e in errors) or "the episode did not complete")
    trainable = [t for t in episode.traces if t.agent.trainable]
    if len(trainable) != 1:
        raise RuntimeError(f"the episode ran {len(trainable)} trainable agents; one session trains one agent")
    return trainable[0].reward


def export_rows(env: Any, limit: int | None) -> list[dict]:
    """The taskset's tasks as data rows: `messages` and `vf_task`."""
    tasks = env.taskset if limit is None else env.taskset.take(limit)
    return [{"messages": prompt_messages(task.data), "vf_task": task.data.model_dump(mode="json", exclude_none=True)}
            for task in tasks]  # fmt: skip


def prompt_messages(data: Any) -> list[dict]:
    """A task's prompt as chat messages (its system prompt first)."""
    if data.prompt is None:
        raise ValueError(f"task {data.idx} has no prompt (the user opens it); leangrpo's data needs the prompt's messages")
    system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return [*system, {"role": "user", "content": data.prompt}]
    return [*system, *(m.model_dump(mode="json", exclude_none=True) for m in data.prompt)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m leangrpo.agents.verifiers_v1", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", nargs="?", choices=["run", "export"], default="run")
    parser.add_argument("--taskset", required=True, help="the v1 taskset's id (an installed package or a module)")
    parser.add_argument("--harness", help="the agents' harness id (default: the taskset's own, else bash)")
    parser.add_argument("--env", default="{}", help="more of the v1 environment's config, as JSON")
    parser.add_argument("--model", default="policy", help="the model name sent (the endpoint answers any)")
    parser.add_argument("--out", help="export: the JSONL file to write")
    parser.add_argument("--limit", type=int, help="export: at most this many tasks")
    args = parser.parse_args(argv)
    env = _load_env(args)
    if args.action == "export":
        if not args.out:
            parser.error("export needs --out FILE")
        with open(args.out, "w", encoding="utf-8") as f:
            for row in export_rows(env, args.limit):
                f.write(json.dumps(row) + "\n")
        return 0
    base_url = os.environ.get("OPENAI_BASE_URL")
    if not base_url or SESSION_KEY_VAR not in os.environ:
        parser.error("run needs OPENAI_BASE_URL and OPENAI_API_KEY (agent.command sets both)")
    try:
        reward = asyncio.run(run_episode(env, task_of(env, json.load(sys.stdin)), base_url, args.model))
    except Exception as e:  # noqa: BLE001  the episode's failure, counted by leangrpo
        print(f"verifiers v1 episode failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(reward))
    return 0


def _load_env(args: argparse.Namespace) -> Any:
    import verifiers.v1 as vf

    return vf.load_environment(env_config(args.taskset, args.harness, json.loads(args.env)))


if __name__ == "__main__":
    sys.exit(main())
