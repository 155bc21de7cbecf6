"""vLLM worker extension: reload trainer weights from safetensors files into the live model.

vLLM mixes this class into each of its workers (`worker_extension_cls`), and the engine
reaches its methods with `collective_rpc`. Only file paths cross the process boundary:
vLLM's default msgspec serialiser turns tensors into nested lists, so the trainer writes
the weights as safetensors buckets and the worker streams them back (memory-mapped).

The tensors go through the worker's own `reload_weights(weights_iterator=...,
is_checkpoint_format=True)`: the model's `load_weights` maps checkpoint names (q/k/v ->
qkv_proj, tensor-parallel shards), and vLLM's layerwise reload re-runs each layer's
post-load processing. Plain `model.load_weights` is not enough: on CPU, for example,
linear weights are repacked for oneDNN after loading and the original parameter is
emptied. All buckets go through ONE reload call, so a layer never ends up half-loaded.

Tied weights: the layerwise reload processes a shared parameter only through the layer
that loads it (embed_tokens), so a layer that reads it through the tie (lm_head) keeps
kernels derived from the old values where its method precomputes any (CPU: a packed
GEMM weight). Such layers are processed again after the reload.
This module imports nothing from vLLM: the worker provides `reload_weights`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from safetensors import safe_open


def iter_safetensors(paths: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) from each file in turn, one tensor in memory at a time."""
    for path in paths:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def modules_sharing_parameters(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module that holds a parameter object some other module holds too (ties)."""
    holders: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append(module)
    return [m for group in holders.values() if len(group) > 1 for m in group]


class WeightSyncExtension:
    """Mixed into vLLM's worker (which provides `reload_weights` and `model_runner`)."""

    def load_weights_from_files(self, paths: list[str]) -> int:
        """Reload the model from checkpoint-named tensors in `paths`; returns how many."""
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for item in iter_safetensors(paths):
                count += 1
                yield item

        self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        for module in modules_sharing_parameters(self.model_runner.get_model()):
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
        return count
