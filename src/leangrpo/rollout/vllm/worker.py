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
This module imports nothing from vLLM at import time: the worker provides `reload_weights`.

`SharingExtension` (mixed in too) serves colocated vLLM that shares its weights with the
trainer (sharing.py), in-process only, where `collective_rpc` passes live objects both
ways: the model itself; where the worker runs and which storages it serves from (plain
numbers, so the answer is true across any process boundary); on CPU, plain weights
again where vLLM prepacked them, and vLLM's own processing back after a refusal; and LoRA
adapters from tensors in memory, refused when they adapt a module vLLM serves no LoRA on
(the check vLLM's file loader makes; `leangrpo_lora_modules` lists what it serves, for
every engine). Its methods are prefixed `leangrpo_`: an extension may not define a name
the worker has (vLLM asserts it).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from leangrpo.rollout.vllm.files import unservable_message, unservable_modules


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


class SharingExtension:
    """In-process vLLM sharing its tensors with the trainer (rollout/vllm/sharing.py)."""

    def leangrpo_model(self) -> torch.nn.Module:
        """The live model (in-process, `collective_rpc` returns it as it is)."""
        return self.model_runner.get_model()

    def leangrpo_whereabouts(self) -> tuple[int, list[int]]:
        """This worker's process id and the data pointers of its model's parameter
        storages: what the caller compares with its own process and the model it got."""
        model = self.model_runner.get_model()
        return os.getpid(), sorted({p.untyped_storage().data_ptr() for p in model.parameters()})

    def leangrpo_lora_modules(self) -> list[str]:
        """The module names vLLM serves LoRA on for this model (packed names expanded), as
        `WorkerLoRAManager._load_adapter` computes them; [] with LoRA off."""
        workers = getattr(self.model_runner, "lora_manager", None)
        manager = getattr(workers, "_adapter_manager", None)
        if manager is None:
            return []
        packed = manager.packed_modules_mapping
        names: set[str] = set()
        for module in manager.supported_lora_modules:
            names.update(packed.get(module, [module]))
            if module == "experts":
                names.add(module)
        return sorted(names)

    @torch.no_grad()
    def leangrpo_plain_weights(self) -> list[str]:
        """CPU: serve every linear layer from a plain weight again, read from the checkpoint.

        vLLM's CPU path prepacks each unquantized linear weight (and the lm_head's) into a
        oneDNN or sgl handle and empties `layer.weight` (`dispatch_cpu_unquantized_gemm` in
        vllm.model_executor.layers.utils); a trainer can neither view nor update that copy.
        Each emptied layer gets its weight back from its own quant method's
        `create_weights`, every layer computes with `F.linear` on it (the packed copies
        go), and the checkpoint is loaded again through the model's own `load_weights`
        (its name mapping fills the fused q/k/v and gate/up tensors). Returns the layers
        still without a weight afterwards (none expected)."""
        import torch.nn.functional as F
        from vllm.model_executor.layers.linear import (
            WEIGHT_LOADER_V2_SUPPORTED,
            UnquantizedLinearMethod,
        )
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
        )
        from vllm.model_executor.model_loader import get_model_loader

        model = self.model_runner.get_model()
        emptied, plain, names = [], [], []
        for name, layer in model.named_modules():
            method = getattr(layer, "quant_method", None)
            if "weight" not in layer._parameters:  # LoRA wrappers: the weight is base_layer's
                continue
            if isinstance(method, UnquantizedLinearMethod):
                if layer.weight.numel() == 0:
                    loader = (
                        layer.weight_loader_v2
                        if type(method).__name__ in WEIGHT_LOADER_V2_SUPPORTED
                        else layer.weight_loader
                    )
                    method.create_weights(
                        layer,
                        getattr(layer, "input_size_per_partition", layer.input_size),
                        layer.output_partition_sizes,
                        layer.input_size,
                        layer.output_size,
                        layer.params_dtype,
                        weight_loader=loader,
                    )
                    layer.weight.requires_grad_(False)  # vLLM's parameters never train
                    emptied.append(name)
                plain.append(layer)
                names.append(name)
            elif isinstance(method, UnquantizedEmbeddingMethod):
                plain.append(layer)  # the lm_head's packed copy goes too
                names.append(name)
        self._leangrpo_plain = names  # what leangrpo_vllm_weights processes again
        for layer in plain:
            layer.cpu_linear = F.linear
        gc.collect()
        if emptied:
            config = self.vllm_config
            loader = get_model_loader(config.load_config)
            model.load_weights(loader.get_all_weights(config.model_config, model))
        return [
            name
            for name, layer in model.named_modules()
            if "weight" in layer._parameters and layer.weight.numel() == 0
        ]

    @torch.no_grad()
    def leangrpo_vllm_weights(self) -> int:
        """Undo `leangrpo_plain_weights` (sharing was refused after it ran): each layer it
        changed is processed again by its own quant method, as vLLM did after loading (on
        CPU: packed for oneDNN, the weight emptied), so the layers are again the ones its
        layerwise reload recorded. Returns how many layers were processed."""
        names = getattr(self, "_leangrpo_plain", [])
        modules = dict(self.model_runner.get_model().named_modules())
        for name in names:
            layer = modules[name]
            layer.quant_method.process_weights_after_loading(layer)
        self._leangrpo_plain = []
        gc.collect()
        return len(names)

    def leangrpo_add_adapter(self, int_id: int, tensors: dict, config: dict) -> bool:
        """Register a LoRA adapter from tensors (peft's saved names) and its peft config,
        as `WorkerLoRAManager._load_adapter` does after reading the files
        (vllm.lora.worker_manager): validated against vLLM's LoRA limits, mapped by the
        model's own weights mapper. The tensors must be the caller's copies: vLLM keeps
        them as they are when their device and dtype already match."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        workers = self.model_runner.lora_manager
        manager = workers._adapter_manager
        servable = self.leangrpo_lora_modules()
        refused = unservable_modules(tensors, servable)
        if refused:  # vLLM would keep the rest and serve half an adapter
            raise ValueError(unservable_message(refused, servable))
        helper = PEFTHelper.from_dict(
            {**config, "vllm_max_position_embeddings": workers.max_position_embeddings}
        )
        helper.validate_legal(workers.lora_config)
        model = manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=int_id,
            tensors=tensors,
            peft_helper=helper,
            device="cpu",  # as the file path: activation copies it into the device slots
            dtype=workers.lora_config.lora_dtype,
            model_vocab_size=workers.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        manager.remove_adapter(lora.id)
        if len(manager) + 1 > manager.capacity:
            manager.remove_oldest_adapter()
        return bool(manager.add_adapter(lora))


class WeightSyncExtension(SharingExtension):
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
