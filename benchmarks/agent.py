"""Agents through the OpenAI-compatible endpoint.  python benchmarks/agent.py [--quick]

Case `request`: the endpoint's overhead per request. The same turns (the tool demo's
prompt, its model at T=1, `max_tokens` 16, each its own seed), one at a time: `direct`
(baseline: submitted to the hf engine's turn stream and advanced by the caller) and
`endpoint` (POST /v1/chat/completions with the openai SDK: HTTP, the session's planning
and rendering, the pump thread, the OpenAI-shaped answer). Figures: seconds per request,
`overhead_ms` = (endpoint - direct) per request.

Case `generation`: one generation call of P prompts x G episodes (8 agent workers, boxes
as configured by default), the tool demo's model and prompts: `native` (baseline: the
tool environment through environments/driver.py) and agents that make the same kind of
episodes through the endpoint: `box_only` (an agent that returns at once: the cost of a
box per episode), `openai_client` (the tool loop with the plain openai client,
tests/support/agents.py `native_tools`) and `agents_sdk` (examples/agent_demo/agent.py:
an Agents SDK `Agent`, `function_tool`, `Runner.run`).

Case `demo_step`: the demos' training step, measured in the same run: `make demo-tools`'s
config (baseline, examples/tools_demo.yaml) and `make demo-agent`'s
(examples/agent_demo.yaml), each trained for a few steps (no evaluation, no checkpoint);
`step_time_s` = the wall time of those steps / steps, `step_time_ratio` = agent / native
(goal: at most 1.25).

One JSON line per case and variant (`bench`, `case`, `device`, `variant`, `time_s`,
`peak_bytes` (the process's peak RSS on CPU), and `time_ratio`/`mem_ratio` against the
baseline of the same run).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
sys.path.insert(0, str(ROOT / "tests"))  # tests/support/agents.py for the agent workers

import torch  # noqa: E402
from device_info import device_name  # noqa: E402

from leangrpo.config import load_config  # noqa: E402
from leangrpo.contracts import Prompt, SamplingParams, TurnRequest  # noqa: E402

TOOLS_YAML = ROOT / "examples" / "tools_demo.yaml"
AGENT_YAML = ROOT / "examples" / "agent_demo.yaml"
TOOLS_DEMO = ROOT / "examples" / "tools_demo"


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def row(case: str, variant: str, time_s: float, base: dict | None = None, **extra) -> dict:
    out = {"bench": "agent", "case": case, "device": device_name(torch.device("cpu")), "variant": variant,
           "time_s": round(time_s, 4), "peak_bytes": peak_bytes(), **extra}  # fmt: skip
    if base is not None:
        out["time_ratio"] = round(time_s / base["time_s"], 3)
        out["mem_ratio"] = round(out["peak_bytes"] / base["peak_bytes"], 3)
    return out


def tools_prompts(n: int) -> list[Prompt]:
    rows = [json.loads(line) for line in (TOOLS_DEMO / "eval.jsonl").read_text().splitlines()[:n]]
    return [Prompt(i, r["prompt"], [0], {"answer": r["answer"]}, [{"role": "user", "content": r["prompt"]}])
            for i, r in enumerate(rows)]  # fmt: skip


def model_and_tokenizer():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(TOOLS_DEMO / "model")
    model = AutoModelForCausalLM.from_pretrained(TOOLS_DEMO / "model", dtype=torch.float32).eval()
    return model, tokenizer


def agent_cfg(entry: str, workers: int = 8):
    return load_config(AGENT_YAML, [f"agent.entry={entry}", f"agent.num_workers={workers}"])


# -- case request ---------------------------------------------------------------------------


def case_request(n: int) -> list[dict]:
    import openai

    from leangrpo.agents.setup import start_agents
    from leangrpo.rollout.hf.engine import HFEngine

    model, tokenizer = model_and_tokenizer()
    engine = HFEngine(model, tokenizer)
    cfg = agent_cfg("support.agents:one_turn", workers=1)
    agents = start_agents(cfg, tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=0)
    messages = [{"role": "user", "content": "395+136="}]
    prompt_ids = agents.endpoint.renderer(None).encode(agents.first_turn(messages))
    try:
        t0 = time.perf_counter()  # direct: the same turns through the turn stream
        with engine.open_turns(params, 0) as stream:
            for k in range(n):
                stream.submit(TurnRequest(prompt_ids, k, 16, k))
                while stream.pending():
                    stream.advance(0.0)
                stream.release(k)
        direct = time.perf_counter() - t0
        endpoint = agents.endpoint
        with endpoint.generating(engine, params, 0):
            sessions = [endpoint.open_session(None, seed=k) for k in range(n)]
            client = openai.OpenAI(base_url=endpoint.base_url, api_key="-", max_retries=0)
            t0 = time.perf_counter()
            for s in sessions:  # one client (its construction is not the endpoint's cost)
                client.chat.completions.create(model="policy", messages=messages, max_tokens=16,
                                               extra_headers={"Authorization": f"Bearer {s.key}"})  # fmt: skip
            served = time.perf_counter() - t0
            for s in sessions:
                endpoint.end_session(s.key)
    finally:
        agents.close()
    base = row("request", "direct", direct / n, requests=n)
    over = row("request", "endpoint", served / n, base, requests=n,
               overhead_ms=round(1000 * (served - direct) / n, 2))  # fmt: skip
    return [base, over]


# -- case generation ------------------------------------------------------------------------


def case_generation(prompts: int, group: int) -> list[dict]:
    from leangrpo.agents.setup import start_agents
    from leangrpo.environments.setup import start_environments
    from leangrpo.rollout.hf.engine import HFEngine

    model, tokenizer = model_and_tokenizer()
    tasks = tools_prompts(prompts)
    params = SamplingParams(temperature=1.0, max_new_tokens=64, seed=1)
    native_cfg = load_config(TOOLS_YAML)
    engine = HFEngine(model, tokenizer, max_batch_size=native_cfg.rollout.max_batch_size,
                      kv_cache_tokens=native_cfg.rollout.kv_cache_tokens)  # fmt: skip
    envs = start_environments(native_cfg, tokenizer)
    try:
        t0 = time.perf_counter()
        groups = envs.rollout(engine).generate(tasks, params, group, 0)
        native = time.perf_counter() - t0
    finally:
        envs.close()
    tokens = sum(c.num_model_tokens for g in groups for c in g)
    base = row("generation", "native", native, episodes=prompts * group, model_tokens=tokens)
    out = [base]
    for variant, entry in (("box_only", "support.agents:returns_at_once"),
                           ("openai_client", "support.agents:native_tools"),
                           ("agents_sdk", str(ROOT / "examples" / "agent_demo" / "agent.py") + ":run")):  # fmt: skip
        agents = start_agents(agent_cfg(entry), tokenizer)
        try:
            rollout = agents.rollout(engine)
            t0 = time.perf_counter()
            groups = rollout.generate(tasks, params, group, 0)
            took = time.perf_counter() - t0
        finally:
            agents.close()
        tokens = sum(c.num_model_tokens for g in groups for c in g)
        out.append(row("generation", variant, took, base, episodes=prompts * group, model_tokens=tokens,
                       requests=rollout.last_metrics.get("agent/requests", 0.0),
                       errors=rollout.last_metrics.get("agent/errors", 0.0)))  # fmt: skip
    return out


# -- case demo_step -------------------------------------------------------------------------


def demo_step_time(yaml: Path, steps: int, out: str) -> tuple[float, dict]:
    from leangrpo.train import Trainer

    cfg = load_config(yaml, [f"run.output_dir={out}", f"run.max_steps={steps}", "run.overwrite=true",
                             "data.eval_path=null", "eval.every_steps=0", "checkpoint.every_steps=0",
                             "checkpoint.save_final_model=false", "logging.progress_bar=false",
                             "logging.samples_every=0"])  # fmt: skip
    trainer = Trainer(cfg)
    t0 = time.perf_counter()
    trainer.train()
    took = time.perf_counter() - t0
    rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if r.get("step", 0) >= 1]
    reward = sum(r.get("reward/mean", 0.0) for r in last) / max(len(last), 1)
    return took / steps, {"reward_mean": round(reward, 3)}


def case_demo_step(steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        native, extra = demo_step_time(TOOLS_YAML, steps, f"{tmp}/tools")
        base = row("demo_step", "native_tools_demo", native, steps=steps, step_time_s=round(native, 3), **extra)
        agent, extra = demo_step_time(AGENT_YAML, steps, f"{tmp}/agent")
    over = row("demo_step", "agent_demo", agent, base, steps=steps, step_time_s=round(agent, 3),
               step_time_ratio=round(agent / native, 3), **extra)  # fmt: skip
    return [base, over]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU size: a minute or two")
    parser.add_argument("--case", choices=["request", "generation", "demo_step"], action="append")
    args = parser.parse_args()
    cases = args.case or ["request", "generation", "demo_step"]
    if "request" in cases:
        for r in case_request(16 if args.quick else 64):
            print(json.dumps(r), flush=True)
    if "generation" in cases:
        for r in case_generation(4 if args.quick else 16, 8):
            print(json.dumps(r), flush=True)
    if "demo_step" in cases:
        for r in case_demo_step(3 if args.quick else 10):
            print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
