"""Measuring memory on CPU, where it is deterministic: what autograd saves, what is alive.

- `saved_bytes(...)`: bytes of the distinct storages autograd saves for backward during a
  forward (torch.autograd.graph.saved_tensors_hooks), without the ones that existed before
  (parameters, buffers, the batch's own tensors).
- `LiveBytes`: a TorchDispatchMode that follows every storage an op allocates while it is
  active (weak references say when each is freed): `live` and `peak` bytes.
- `real_micro_batch(...)`: a tiny policy built the trainer's way, one packed micro-batch of
  synthetic GRPO samples, and the forward + loss + backward of `train.step.train_step`.
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from leangrpo.config import config_from_dict
from leangrpo.contracts import Completion, Prompt, RolloutSample


def storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}


@contextmanager
def saved_bytes(out: dict, exclude: set[int]):
    """Fill out["bytes"] with the distinct saved storages not in `exclude`."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield
    out["bytes"] = sum(seen.values())


@contextmanager
def saved_alive_bytes(out: dict, exclude: set[int]):
    """Like `saved_bytes`, counting only the saved storages still alive when the block
    ends (hold the forward's output inside it): a branch of the graph the forward drops
    (a mixture of experts' router weights that routing replay replaces) frees what it
    saved, and its addresses may be reused by later tensors."""
    alive: dict[int, tuple[weakref.ref, int]] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in exclude and (key not in alive or alive[key][0]() is None):
            alive[key] = (weakref.ref(storage), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield
    out["bytes"] = sum(size for ref, size in alive.values() if ref() is not None)


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages allocated by ops while active and still alive; their peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._alive: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = storages(tree_flatten((args, kwargs))[0])
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self._track(t.untyped_storage())  # a view or an in-place result is not new
        return out

    def _track(self, storage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if key in self._alive or size == 0:
            return
        self._alive[key] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        size = self._alive.pop(key, None)
        if size is not None:
            self.live -= size

    def peak_of(self, fn: Callable[[], object]) -> int:
        """Peak bytes allocated by `fn()` beyond what was alive before it."""
        with self:
            start, self.peak = self.live, self.live
            fn()
            return self.peak - start


def step_config(**over) -> object:
    """A validated config for the tiny CPU measurements; `over` = {section: {key: value}}."""
    cfg = {
        "run": {"device": "cpu"},
        "model": {"name_or_path": "tiny", "dtype": "float32"},
        "data": {"path": "unused.jsonl"},
        "rewards": {"functions": ["length"]},
        "lora": {"enabled": False, "r": 8, "alpha": 16},
        "rollout": {"num_generations": 4, "prompts_per_batch": 1, "max_new_tokens": 96},
        "train": {"micro_batch_tokens": 4096},
        "packing": {"shared_prefix": "off"},
        "offload": {"min_tensor_bytes": 0},
    }
    for section, values in over.items():
        cfg.setdefault(section, {}).update(values)
    return config_from_dict(cfg)


def group(vocab: int, generations: int, prompt: int, completion: int, seed: int = 0):
    """One prompt and its completions of exactly these lengths, random tokens."""
    rng = random.Random(seed)
    p = Prompt(0, "", [rng.randrange(vocab) for _ in range(prompt)])
    samples = []
    for i in range(generations):
        ids = [rng.randrange(vocab) for _ in range(completion)]
        comp = Completion(ids, "", [-1.0] * completion, "stop", 0)
        samples.append(RolloutSample(0, p, comp, reward=float(i % 2), advantage=i % 2 - 0.5))
    return samples


def train_pass(policy, mb, cfg) -> Callable[[], object]:
    """The forward, loss and backward of one micro-batch, as step.train_step runs them."""
    from leangrpo.model.scoring import score
    from leangrpo.train.inputs import loss_inputs, normalisers
    from leangrpo.train.loss import compute_loss

    sampling = cfg.rollout.sampling_params()
    norm = normalisers([mb], cfg.loss, cfg.rollout.max_new_tokens)

    def forward():
        logprobs, entropy = score(policy.model, mb, sampling, cfg.logprobs, with_entropy=True)
        inputs, _ = loss_inputs(mb, logprobs, entropy, cfg.loss)
        return compute_loss(inputs, norm, cfg.loss).loss

    return forward


def batch_storages(mb) -> set[int]:
    return storages(vars(mb).values())
