"""One run of one variant of benchmarks/vs_trl.py, inside its own subprocess.

`run_variant(variant, case, workdir, device)` trains for `case.steps` optimizer steps with
leangrpo's Trainer or TRL's GRPOTrainer, timing every step at the end of the trainer's own
step hook (leangrpo: `Trainer.on_step_end`; TRL: a `TrainerCallback.on_step_end`), then
reads peak memory and runs the common greedy evaluation. Returns one flat dict.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path

import psutil
import torch

from leangrpo.rewards.builtin import BUILTINS

ROOT = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 1  # the first step pays one-off costs (first generate, imports): left out


def cpu_seconds() -> float:
    """User + system CPU of this process and its live children (leangrpo's reward workers)."""
    proc = psutil.Process()
    total = sum(proc.cpu_times()[:2])
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += sum(child.cpu_times()[:2])
    return total


class StepClock:
    """Timestamps at the end of every optimizer step, and per-step phase seconds."""

    def __init__(self):
        self.walls, self.cpus, self.phases = [], [], []
        self.current: dict[str, float] = defaultdict(float)
        self.start_wall, self.start_cpu = time.perf_counter(), cpu_seconds()

    def mark(self, phases: dict[str, float]) -> None:
        self.walls.append(time.perf_counter())
        self.cpus.append(cpu_seconds())
        self.phases.append(dict(phases))

    def summary(self) -> dict:
        walls = [b - a for a, b in zip(self.walls, self.walls[1:])]  # steps 2..N
        cpus = [b - a for a, b in zip(self.cpus, self.cpus[1:])]
        timed = self.phases[WARMUP_STEPS:]
        med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
        step_s = med(walls)
        out = {
            "steps": len(self.walls),
            "step_s": step_s,
            "step_cpu_s": med(cpus),
            "total_s": self.walls[-1] - self.start_wall if self.walls else float("nan"),
            "first_step_end_s": self.walls[0] - self.start_wall if self.walls else float("nan"),
            "step_walls": [round(w, 4) for w in walls],
        }
        for key in ("generate_s", "reward_s", "score_train_s", "tokens_per_step"):
            out[key] = med([p.get(key, 0.0) for p in timed])
        if timed and "padded_tokens_per_step" in timed[0]:
            out["padded_tokens_per_step"] = med([p["padded_tokens_per_step"] for p in timed])
        out["other_s"] = step_s - out["generate_s"] - out["reward_s"] - out["score_train_s"]
        return out


# ------------------------------------------------------------------------ common eval


def eval_prompt_ids(tokenizer, rows: list[dict], case) -> list[list[int]]:
    """Exactly what both trainers feed the model: the chat template, or the raw text."""
    if not case.chat:
        return [tokenizer(r["prompt"])["input_ids"] for r in rows]
    out = []
    for r in rows:
        text = tokenizer.apply_chat_template(
            chat_messages(r["prompt"], case), tokenize=False, add_generation_prompt=True
        )
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def chat_messages(prompt, case) -> list[dict]:
    """A prompt as chat messages, as leangrpo's data role builds them (system prompt first)."""
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if case.system_prompt is not None and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": case.system_prompt})
    return messages


def total_reward(case, prompts: list[str], completions: list[str], rows: list[dict]) -> list[float]:
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    total = [0.0] * len(completions)
    for spec in case.rewards:
        values = BUILTINS[spec["name"]](prompts, completions, **spec.get("kwargs", {}), **columns)
        for i, v in enumerate(values):
            total[i] += spec.get("weight", 1.0) * (v or 0.0)
    return total


@torch.no_grad()
def greedy_eval(model, tokenizer, rows: list[dict], case, device: str, chunk: int = 32) -> float:
    """Mean total reward of greedy completions on the eval rows (same code for both)."""
    from transformers import GenerationConfig

    model.eval()
    ids = eval_prompt_ids(tokenizer, rows, case)
    eos = model.generation_config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    config = GenerationConfig(
        do_sample=False, max_new_tokens=case.max_new_tokens, eos_token_id=eos, pad_token_id=pad
    )
    completions = []
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        width = max(map(len, part))
        input_ids = torch.full((len(part), width), pad)
        mask = torch.zeros((len(part), width), dtype=torch.long)
        for i, p in enumerate(part):
            input_ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
        out = model.generate(
            input_ids=input_ids.to(device), attention_mask=mask.to(device), generation_config=config
        )
        completions += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    prompts = [r["prompt"] for r in rows]
    return statistics.mean(total_reward(case, prompts, completions, rows))


class ChildMemory:
    """Peak summed RSS of this process's children, sampled every 50 ms in a thread.

    ru_maxrss of RUSAGE_CHILDREN is no use here: a child started by fork + exec is charged
    the parent's whole RSS for the instant between the two. For the same reason a sample
    skips a child that has not exec'd yet (it still shows the parent's command line).
    """

    def __init__(self, interval: float = 0.05):
        self.peak, self.interval = 0, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        proc = psutil.Process()
        own = proc.cmdline()
        while not self._stop.wait(self.interval):
            total = 0
            for child in proc.children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    if child.cmdline() != own:  # a fork not yet exec'd shares our pages
                        total += child.memory_info().rss
            self.peak = max(self.peak, total)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def peak_memory(device: str, children: ChildMemory) -> dict:
    self_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    child_peak = children.stop()
    out = {
        "peak_rss_self_bytes": self_peak,
        "peak_rss_children_bytes": child_peak,
        "peak_bytes": self_peak + child_peak,
    }
    if device == "cuda":
        out["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
        out["peak_bytes"] = out["peak_cuda_bytes"]
    return out


# ------------------------------------------------------------------------- leangrpo


def leangrpo_config(case, paths: dict, out_dir: Path, device: str):
    from leangrpo.config import config_from_dict, load_config

    overrides = {
        "run": {
            "output_dir": str(out_dir),
            "max_steps": case.steps,
            "device": device,
            "resume": "never",
            "seed": 0,
            "num_threads": 1 if device == "cpu" else None,
        },
        "model": {"name_or_path": paths["model"], "dtype": "float32"},
        "eval": {"every_steps": 0, "num_prompts": 1},  # the common eval below is what counts
        "checkpoint": {"every_steps": 0, "save_final_model": False},
        "logging": {"backends": ["jsonl"], "progress_bar": False},
    }
    if case.yaml is not None:  # a bundled example, as shipped (paths relative to the root)
        data = load_config(str(ROOT / case.yaml)).model_dump(mode="json")
        for section, values in overrides.items():
            data[section].update(values)
        cfg = config_from_dict(data)
        check_same_work(cfg, case)
        return cfg
    return config_from_dict(
        {
            **overrides,
            "lora": {"enabled": case.lora, "r": 16, "alpha": 32},
            "data": {
                "path": paths["train"],
                "eval_path": paths["eval"],
                "chat_template": case.chat,
                "system_prompt": case.system_prompt,
            },
            "rewards": {"functions": list(case.rewards), "num_workers": 1},
            "rollout": {
                "engine": "hf",
                "num_generations": case.group,
                "prompts_per_batch": case.prompts_per_step,
                "temperature": case.temperature,
                "max_new_tokens": case.max_new_tokens,
            },
            "loss": {"type": "grpo", "beta": 0.0, "mu": 1},
            "train": {"learning_rate": case.lr, "lr_scheduler": "constant", "max_grad_norm": 1.0},
            "pipeline": {"mode": "sync"},
        }
    )


def check_same_work(cfg, case) -> None:
    """The example config and the Case fields the TRL side reads must describe one job."""
    rewards = [
        {"name": f.name, "weight": f.weight, "kwargs": f.kwargs} for f in cfg.rewards.functions
    ]
    want = [{"weight": 1.0, "kwargs": {}, **spec} for spec in case.rewards]
    pairs = {
        "rollout.num_generations": (cfg.rollout.num_generations, case.group),
        "rollout.prompts_per_batch": (cfg.rollout.prompts_per_batch, case.prompts_per_step),
        "rollout.max_new_tokens": (cfg.rollout.max_new_tokens, case.max_new_tokens),
        "rollout.temperature": (cfg.rollout.temperature, case.temperature),
        "train.learning_rate": (cfg.train.learning_rate, case.lr),
        "lora.enabled": (cfg.lora.enabled, case.lora),
        "data.chat_template": (cfg.data.chat_template, case.chat),
        "data.system_prompt": (cfg.data.system_prompt, case.system_prompt),
        "rewards.functions": (rewards, want),
        "loss": ((cfg.loss.type, cfg.loss.beta, cfg.loss.mu), ("grpo", 0.0, 1)),
    }
    drift = [f"{k}: {a!r} vs {b!r}" for k, (a, b) in pairs.items() if a != b]
    if drift:
        raise ValueError(f"{case.yaml} and case {case.name} differ: " + "; ".join(drift))


def run_leangrpo(case, paths: dict, workdir: Path, device: str) -> dict:
    from leangrpo.model.scoring import causal_lm
    from leangrpo.train import Trainer

    clock, children = StepClock(), ChildMemory()

    class TimedTrainer(Trainer):
        def on_step_end(self, metrics, batch):
            super().on_step_end(metrics, batch)
            clock.mark(
                {
                    "generate_s": metrics.get("time/generate", 0.0),
                    "reward_s": metrics.get("time/rewards", 0.0),
                    "score_train_s": metrics.get("time/score", 0.0) + metrics["time/train"],
                    "tokens_per_step": metrics.get("packing/tokens", 0.0),
                }
            )

    cfg = leangrpo_config(case, paths, workdir / f"run-leangrpo-{os.getpid()}", device)
    trainer = TimedTrainer(cfg)
    trainer.train()
    result = {**clock.summary(), **peak_memory(device, children)}
    model = trainer.policy.model
    causal_lm(model).set_attn_implementation("sdpa")  # the common eval uses plain attention
    evaluate = tools_eval if case.tools else greedy_eval
    result["final_eval"] = evaluate(
        model, trainer.policy.tokenizer, read_rows(paths["eval"], case), case, device
    )
    return result


# ------------------------------------------------------------------------------ TRL


def trl_reward(spec: dict):
    fn, kwargs = BUILTINS[spec["name"]], spec.get("kwargs", {})
    hidden = {"trainer_state", "log_extra", "log_metric", "environments", "completion_ids"}

    def reward(prompts, completions, **columns):
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        cols = {k: v for k, v in columns.items() if k not in hidden}
        return fn(prompts, texts, **kwargs, **cols)

    reward.__name__ = spec["name"]
    return reward


def trl_dataset(path: str, case):
    from datasets import Dataset

    rows = []
    for r in read_jsonl(path):
        if case.chat:
            r = {**r, "prompt": chat_messages(r["prompt"], case)}
        rows.append(r)
    return Dataset.from_list(rows)


def timed_trl_classes(clock: StepClock):
    """GRPOTrainer with timers around generation and rewards, and a per-step callback."""
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    timed = ("_generate", "_calculate_rewards", "_generate_and_score_completions")
    missing = [name for name in timed if not hasattr(GRPOTrainer, name)]
    if missing:  # private hooks: a TRL that renamed them would leave the phase timers at 0
        raise RuntimeError(f"this TRL's GRPOTrainer has no {missing}; update the phase timers")
    phase: dict[str, float] = defaultdict(float)

    class TimedGRPO(GRPOTrainer):
        def _generate(self, prompts):
            t0 = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                phase["generate_s"] += time.perf_counter() - t0

        def _calculate_rewards(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return super()._calculate_rewards(*args, **kwargs)
            finally:
                phase["reward_s"] += time.perf_counter() - t0

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            real = out["completion_mask"].sum() + out["prompt_mask"].sum()
            phase["tokens_per_step"] += float(real)
            phase["padded_tokens_per_step"] += float(
                out["prompt_ids"].numel() + out["completion_ids"].numel()
            )
            return out

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            phase["begin"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step = time.perf_counter() - phase["begin"]  # generation happens inside the step
            gen, reward = phase["generate_s"], phase["reward_s"]
            clock.mark(
                {
                    "generate_s": gen,
                    "reward_s": reward,
                    "score_train_s": step - gen - reward,
                    "tokens_per_step": phase["tokens_per_step"],
                    "padded_tokens_per_step": phase["padded_tokens_per_step"],
                }
            )
            phase.clear()

    return TimedGRPO, Clock


def trl_args(case, out_dir: Path, device: str, tools: dict | None = None):
    """GRPOConfig for the same job: one optimizer step per generation batch, no accumulation.
    `tools`: the multi-turn settings (tool-calling iterations, the completion budget)."""
    from trl import GRPOConfig

    extra = {}
    if tools is not None:
        extra = {
            "max_tool_calling_iterations": tools["iterations"],
            "max_completion_length": tools["completion_tokens"],
        }
    return GRPOConfig(
        **({"max_completion_length": case.max_new_tokens} | extra),
        output_dir=str(out_dir),
        per_device_train_batch_size=case.prompts_per_step * case.group,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=case.group,
        temperature=case.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=case.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        weight_decay=0.0,
        max_steps=case.steps,
        beta=0.0,
        loss_type="grpo",
        epsilon=0.2,
        scale_rewards="group",
        num_iterations=1,
        reward_weights=[spec.get("weight", 1.0) for spec in case.rewards],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=device == "cpu",
        bf16=False,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def run_trl(case, paths: dict, workdir: Path, device: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    clock, children = StepClock(), ChildMemory()
    timed_trainer, step_callback = timed_trl_classes(clock)
    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    model = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32)
    peft_config = None
    if case.lora:  # leangrpo's: r 16, alpha 32, no dropout, every linear layer
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=16,
            lora_alpha=32,
            lora_dropout=0.0,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        )
    tools, multi_turn = [], None
    if case.tools:
        tools, multi_turn = trl_tools(case, tokenizer, paths["train"])
    trainer = timed_trainer(
        model=model,
        reward_funcs=[trl_reward(spec) for spec in case.rewards],
        args=trl_args(case, workdir / f"run-trl-{os.getpid()}", device, multi_turn),
        train_dataset=trl_dataset(paths["train"], case),
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[step_callback()],
        **({"tools": tools} if tools else {}),
    )
    trainer.train()
    result = {**clock.summary(), **peak_memory(device, children)}
    evaluate = tools_eval if case.tools else greedy_eval
    result["final_eval"] = evaluate(
        trainer.model, tokenizer, read_rows(paths["eval"], case), case, device
    )
    return result


# ---------------------------------------------------------------- multi-turn (case e)

# How TRL reads a turn of the tool demo's template (transformers' response_template): its
# content up to <|end|>, and Hermes tool calls, JSON in <tool_call> tags, as TRL's Qwen one.
TOOL_DEMO_RESPONSE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|end\|>\s*", "content": "text"},
    },
}


def tool_demo_settings(case) -> tuple:
    """The example config's environment: (its tool functions, max_turns, max_total_tokens)."""
    import importlib.util

    from leangrpo.config import load_config

    env = load_config(str(ROOT / case.yaml)).environment
    tools = []
    for spec in env.tools:
        path, name = spec.rsplit(":", 1)
        loader = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
        tools.append(getattr(module, name))
    return tools, env.max_turns, env.max_total_tokens


def trl_tools(case, tokenizer, train_path: str) -> tuple[list, dict]:
    """TRL's side of the same multi-turn job: the tools, its parser for the template, and
    the budgets: max_turns - 1 tool-calling iterations, and every turn of a trajectory
    within max_total_tokens (TRL counts completion tokens: max_total less the longest
    prompt, as the prompts render with the tools listed)."""
    tools, max_turns, max_total = tool_demo_settings(case)
    tokenizer.response_template = TOOL_DEMO_RESPONSE
    longest = max(
        len(tokenizer.apply_chat_template(chat_messages(r["prompt"], case), tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False))
        for r in read_jsonl(train_path)
    )  # fmt: skip
    return tools, {"iterations": max_turns - 1, "completion_tokens": max_total - longest}


@torch.no_grad()
def tools_eval(model, tokenizer, rows: list[dict], case, device: str) -> float:
    """Greedy multi-turn trajectories with the tool (leangrpo's rollout on either model), and
    the mean reward of their last turns: the same measure for both trainers."""
    from leangrpo.config import load_config
    from leangrpo.contracts import Prompt, SamplingParams
    from leangrpo.environments.driver import MultiTurnRollout, TurnLimits
    from leangrpo.environments.pool import EnvironmentPool
    from leangrpo.environments.rendering import Renderer
    from leangrpo.rollout.hf.engine import HFEngine

    env_cfg = load_config(str(ROOT / case.yaml)).environment
    prompts = [
        Prompt(i, r["prompt"], [0], {}, chat_messages(r["prompt"], case))
        for i, r in enumerate(rows)
    ]
    engine = HFEngine(model.eval(), tokenizer)
    with EnvironmentPool(env_cfg) as pool:  # the example's paths: relative to the root (cwd)
        limits = TurnLimits(env_cfg.max_turns, env_cfg.max_total_tokens)
        rollout = MultiTurnRollout(
            engine, pool, Renderer(tokenizer, pool.tools), limits, {tokenizer.eos_token_id}
        )
        params = SamplingParams(temperature=0.0, max_new_tokens=case.max_new_tokens)
        groups = rollout.generate(prompts, params, 1, 0)
    completions = [g[0].text for g in groups]
    return statistics.mean(total_reward(case, [r["prompt"] for r in rows], completions, rows))


# --------------------------------------------------------------------------- entry


def read_jsonl(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def read_rows(path: str, case) -> list[dict]:
    return read_jsonl(path)[: case.eval_prompts]


def run_variant(variant: str, case, workdir: Path, device: str) -> dict:
    if device == "cpu":
        torch.set_num_threads(1)
    paths = json.loads((workdir / "case.json").read_text())
    run = run_leangrpo if variant == "leangrpo" else run_trl
    t0 = time.perf_counter()
    result = run(case, paths, workdir, device)
    result["run_wall_s"] = time.perf_counter() - t0
    return result
