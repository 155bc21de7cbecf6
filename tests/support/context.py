"""A context-parallel group run in one process: C threads, one per rank, exchanging through
shared slots (`ThreadGroup`) instead of a process group, so the code every rank runs
(ops/context_parallel) is the one a torchrun rank runs, only the transport differs.

`run_ranks(size, fn)` calls `fn(rank, exchange)` on `size` threads and returns the results
in rank order; a rank that raises breaks the group's barrier, so its peers stop too and the
first error is raised here.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch

BARRIER_TIMEOUT_S = 120.0


class ThreadGroup:
    """The slots and barrier `size` threads exchange through."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=BARRIER_TIMEOUT_S)
        self.slots: list[Any] = [None] * size

    def exchange(self, rank: int) -> RankExchange:
        return RankExchange(self, rank)


class RankExchange:
    """`ops.context_parallel.exchange.Exchange` of one thread of a ThreadGroup."""

    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank = group, rank

    def _everyone(self, value: Any, combine: Callable[[list[Any]], Any]) -> Any:
        g = self.group
        g.slots[self.rank] = value
        g.barrier.wait()
        out = combine(list(g.slots))
        g.barrier.wait()  # nobody overwrites a slot before every rank has read them
        return out

    def all_to_all(self, chunks: torch.Tensor) -> torch.Tensor:
        return self._everyone(chunks, lambda parts: torch.stack([p[self.rank] for p in parts]))

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        def total(parts):
            out = torch.zeros_like(values)
            for p in parts:  # in rank order, as a process group's sum of one contributor
                out = out + p
            return out

        return self._everyone(values, total)


class PerThread(threading.local):
    """A module-level cache dict of the attention kernels, one per thread: each rank of a
    real group is a process with its own (threads sharing one would rebuild each other's
    plans, which changes what autograd saves, though not the values)."""

    def __init__(self):
        self.entries: dict = {}

    def get(self, key, default=None):
        return self.entries.get(key, default)

    def __getitem__(self, key):
        return self.entries[key]

    def __setitem__(self, key, value):
        self.entries[key] = value


@contextlib.contextmanager
def per_thread_caches():
    from leangrpo.ops.attention import adapter, kernels

    names = [(kernels, "_HOST_BOUNDS"), (kernels, "_BATCHED_PLANS"),
             (kernels, "_FLEX_PLAIN_CACHE"), (adapter, "_IMPLICIT_CACHE")]  # fmt: skip
    saved = [getattr(module, name) for module, name in names]
    for module, name in names:
        setattr(module, name, PerThread())
    try:
        yield
    finally:
        for (module, name), value in zip(names, saved):
            setattr(module, name, value)


def run_ranks(size: int, fn: Callable[[int, RankExchange], Any]) -> list[Any]:
    """fn(rank, exchange) on `size` threads; results in rank order (the first error raised).
    The kernels' caches are per thread meanwhile, as per process on real ranks."""
    with per_thread_caches():
        return _run_threads(size, fn)


def _run_threads(size: int, fn: Callable[[int, RankExchange], Any]) -> list[Any]:
    group = ThreadGroup(size)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = fn(rank, group.exchange(rank))
        except BaseException as exc:  # noqa: BLE001 (re-raised below)
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    return results


# ------------------------------------------------------------- the cases both kinds run

DEMO_VOCAB = 32  # examples/demo/model: Qwen2, 2 query heads, 1 key/value head, tied head


def cp_samples(multiturn: bool = False, seed: int = 0) -> list:
    """Four groups of two whose rows cover the shard boundary cases: a long prompt
    (a shard of prompt only: no completion token to score), completions of odd lengths
    (rows C does not divide), a long completion (a sequence longer than a shard, straddling
    its boundary). Multi-turn: each completion is model | environment | model segments."""
    from leangrpo.contracts import Completion, Prompt, RolloutSample, Trajectory

    g = torch.Generator().manual_seed(seed)
    spec = [(5, [4, 9]), (23, [3, 6]), (3, [14, 2]), (6, [20, 25])]
    out = []
    for gid, (plen, lens) in enumerate(spec):
        prompt = torch.randint(2, DEMO_VOCAB, (plen,), generator=g).tolist()
        for j, n in enumerate(lens):
            segments = [(n, True)] if not multiturn else [(2, True), (3, False), (n, True)]
            ids = torch.randint(2, DEMO_VOCAB, (sum(k for k, _ in segments),), generator=g)
            model_tokens = sum(k for k, m in segments if m)
            behaviour = (-2.5 + 0.3 * torch.randn(model_tokens, generator=g)).tolist()
            trajectory = None
            if multiturn:
                trajectory = Trajectory(segments=segments, turn_versions=[0, 0], messages=[])
            finish = "length" if (gid + j) % 3 == 1 else "stop"
            completion = Completion(ids.tolist(), "", behaviour, finish, 0, trajectory)
            advantage = (1.0 if j == 0 else -1.0) * (1 + gid / 4)
            sample = RolloutSample(gid, Prompt(gid, "", prompt), completion, advantage=advantage)
            sample.reward = advantage
            out.append(sample)
    return out


def cp_config(demo_model, size: int = 1, **sections):
    """A validated Config of the sections a step reads, on the demo model."""
    from leangrpo.config import config_from_dict

    cfg = {
        "model": {"name_or_path": str(demo_model), "dtype": "float32"},
        "data": {"path": "unused.jsonl"},
        "rewards": {"functions": ["math"]},
        "rollout": {"num_generations": 2, "max_new_tokens": 16},
        "train": {"micro_batch_tokens": 40, "max_grad_norm": 1.0},
        "packing": {"shared_prefix": "off"},
        "logprobs": {"row_tile": 4, "vocab_tile": 8},
        "distributed": {"context_parallel_size": size, "timeout_s": 60},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return config_from_dict(cfg)


class RecordingOptimizer:
    """Stands in for the optimizer of `train_step`: records the (clipped) gradients it is
    asked to step with, whole (a DTensor's gathered: every rank calls it), and leaves the
    weights alone, so one policy serves many cases."""

    def __init__(self, named_parameters):
        self.named = [(n, p) for n, p in named_parameters if p.requires_grad]
        self.grads: dict[str, torch.Tensor] = {}

    def step(self) -> None:
        from torch.distributed.tensor import DTensor

        for name, p in self.named:
            if p.grad is not None:
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                self.grads[clean(name)] = grad.detach().clone()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, p in self.named:
            p.grad = None


def clean(name: str) -> str:
    for prefix in ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod."):
        name = name.replace(prefix, "")
    return name


def one_step(policy, samples: list, cfg, ranks=None) -> dict:
    """Plan, the no-grad passes, one optimizer step's gradients: what a case compares."""
    from leangrpo.train.passes import attach_old_and_ref
    from leangrpo.train.planning import plan_steps
    from leangrpo.train.ranks import ONE_PROCESS
    from leangrpo.train.step import train_step

    ranks = ranks or ONE_PROCESS
    sampling = cfg.rollout.sampling_params()
    steps = plan_steps(samples, cfg, policy, ranks.rank, ranks.world_size)
    attach_old_and_ref(policy, steps, cfg.loss, cfg.logprobs, sampling, ranks, cfg.distill)
    recorder = RecordingOptimizer(policy.model.named_parameters())
    result = train_step(policy, steps[0].micro_batches, recorder, cfg, sampling, ranks)
    return {
        "metrics": result.metrics,
        "grads": recorder.grads,
        "passes": {  # every share's samples
            k: v
            for part in ranks.all_gather_object(per_sample_passes(steps[0].micro_batches))
            for k, v in part.items()
        },
        "micro_batches": len(steps[0].micro_batches),
        "padding": sum(ranks.all_gather_object(sum(mb.padding for mb in steps[0].micro_batches))),
    }


def per_sample_passes(micro_batches) -> dict:
    """Old and reference log-probs of each sample, keyed by its completion's targets (the
    same whatever micro-batch and rank a sample lands in)."""
    out = {}
    for mb in micro_batches:
        if mb.padding:
            continue
        lens = mb.completion_lens.tolist()
        keys = [tuple(t.tolist()) for t in mb.targets.split(lens)]
        for name in ("old_logprobs", "ref_logprobs"):
            values = getattr(mb, name)
            if values is None:
                continue
            for key, part in zip(keys, values.split(lens)):
                out[(name, key)] = part.detach().clone()
    return out


class ThreadRanks:
    """`contracts.StepRanks` of one thread of a simulated context group of C (one share):
    the gradient averaged over the group before clipping, as FSDP's reduce-scatter does."""

    rank, world_size = 0, 1

    def __init__(self, exchange: RankExchange, size: int):
        self.exchange, self.processes = exchange, size

    def all_reduce(self, values, op="sum"):
        return [float(v) for v in values]  # one share

    def all_true(self, flag):
        return flag

    def all_gather_object(self, obj):
        return [obj]

    def clip_gradients(self, parameters, max_norm):
        from leangrpo.train.ranks import clip_gradients

        for p in parameters:  # every rank holds every parameter: average like FSDP
            grad = torch.zeros_like(p) if p.grad is None else p.grad
            p.grad = self.exchange.all_reduce_sum(grad.clone()) / self.processes
        return clip_gradients(parameters, max_norm)

    def release_gathered(self, policy):
        pass


def simulated_step(policy, samples: list, cfg, size: int) -> list[dict]:
    """`one_step` on `size` threads, each a rank of one context group with its own copy of
    the policy (scoring roots splitting rows with Ulysses over the threads' exchange)."""
    import copy

    from leangrpo.model.scoring import PackedScorer
    from leangrpo.ops.attention.adapter import enable_packed_attention
    from leangrpo.ops.context_parallel.ulysses import Ulysses

    copies = [copy.deepcopy(policy) for _ in range(size)]
    for mine in copies:  # the probe's verdict is kept per model object: probe each copy
        enable_packed_attention(mine.model, policy.attention_backend)
        if mine.teacher is not None:
            enable_packed_attention(mine.teacher, policy.attention_backend)

    def rank(c: int, exchange: RankExchange) -> dict:
        mine = copies[c]
        split = Ulysses(exchange, c, size)
        mine.root = PackedScorer(mine.model, split)
        if mine.reference is not None:
            mine.reference = PackedScorer(mine.reference, split)
        if mine.teacher is not None:  # a distillation teacher: split like the reference
            mine.teacher = PackedScorer(mine.teacher, split)
        return one_step(mine, samples, cfg, ThreadRanks(exchange, size))

    return run_ranks(size, rank)
