"""In-process rollout engine on transformers models (small models, tests, CPU runs).

Algorithm: prompts are left-padded into chunks of at most `max_batch_size` sequences and
sampled by leangrpo's own KV-cached loop (`decode.py`: the model's forward with a
transformers `DynamicCache`), in eval mode, under no_grad. Each token is drawn from
softmax(`sampling.process_logits`(logits)) and its behaviour log-prob is
log_softmax(process_logits(logits))[token]: exactly what the trainer recomputes.

Choices:
- Our loop instead of `model.generate`: generate draws from the global torch RNG (it has
  no generator argument), which the trainer's dropout and checkpoint recomputation share;
  and only SamplingParams shape the distribution (no model generation_config defaults
  such as a repetition penalty or top_k=50 can slip in).
- EOS is part of a completion (ids and log-probs): the policy must learn to stop. The text
  is decoded without special tokens.
- Stop strings: a completion that produced one keeps the token that completed it (ids,
  log-probs) and its text is cut before it, as vLLM does. Finish reason: "stop" (EOS or
  stop string), else "length".
- Temperature 0 is greedy; its log-probs are the unfiltered temperature-1 ones.
- Randomness: each prompt samples from its own `torch.Generator` on the engine's device,
  seeded from (params.seed, version, the prompt's index in the generation batch) when
  params.seed is set (`prompt_offset` is the index of the call's first prompt: a torchrun
  rank generating its share of a batch passes where its share starts), else one stream
  from the OS for the call. So a group's samples depend neither on the call's other
  prompts nor on how a batch is split over calls or ranks (the batched forward still
  rounds by its batch: `max_batch_size` = n, one group per forward, makes it bitwise).
  The caller makes seeds distinct (the producer derives one per generation batch); no
  hidden per-engine counter takes part, so evaluations or a resume in between change
  nothing. The global RNG streams are never read or seeded, so an async producer thread
  cannot race the trainer's dropout masks.
- Multi-turn (`open_turns`, turns.py): a stream per generation call, batching turns
  continuously (they join and leave the decode batch between steps, at most
  `max_batch_size` rows) and keeping each trajectory's KV cache between its turns within
  `kv_cache_tokens` (least recently used evicted, recomputed when needed);
  `generate_turns` is a stream whose requests are all submitted at once.
- share_weights=True generates with the caller's model object (sync training: weight sync
  only moves the version tag); train mode and gradient checkpointing flags are restored
  afterwards. share_weights=False deep-copies the model at construction (async generation
  in a background thread), unless `owned=True` says the model is the engine's own already
  (torchrun: built from the policy's shards, `fsdp.unsharded_copy`); `update_weights`
  copies tensors in by name under a lock.
- Routing replay (a mixture of experts whose policy installed it): every completion
  carries its route record, the experts each router chose at the position that predicted
  each token, in the forward that sampled it (decode.py, turns.py; model/moe/routes.py).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from leangrpo.contracts import (
    Completion,
    EngineVersionError,
    Prompt,
    SamplingParams,
    TurnRequest,
)
from leangrpo.model.moe.control import routing_of
from leangrpo.rollout.hf.decode import DecodedRow, decode
from leangrpo.rollout.hf.turns import HFTurnStream
from leangrpo.rollout.sampling import check_sampling
from leangrpo.seeding import derive_seed

_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "base_model.model.")
_LORA_SEGMENTS = r"lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector"
_BASE_LAYER = re.compile(rf"\.base_layer\.(?!(?:{_LORA_SEGMENTS})\.)")  # not a nested adapter's


class HFEngine:
    """`RolloutEngine` on a transformers model; see the module docstring for the choices."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        share_weights: bool = True,
        device=None,
        max_batch_size: int | None = None,
        owned: bool = False,  # share_weights=False: `model` is this engine's own, not copied
        kv_cache_tokens: int | None = None,  # turn streams: KV positions held at most
    ):
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1 or None, got {max_batch_size}")
        if kv_cache_tokens is not None and kv_cache_tokens < 2:
            raise ValueError(f"kv_cache_tokens must be >= 2 or None, got {kv_cache_tokens}")
        self.tokenizer = tokenizer
        self.share_weights = share_weights
        self.max_batch_size = max_batch_size
        self.kv_cache_tokens = kv_cache_tokens
        model_device = next(model.parameters()).device
        self.device = torch.device(device) if device is not None else model_device
        if share_weights:
            if not _same_device(self.device, model_device):
                raise ValueError(
                    f"share_weights=True generates on the model's device "
                    f"({model_device}), not {self.device}; pass device=None or share_weights=False"
                )
            self.device, self.model = model_device, model
        elif owned:
            self.model = model.to(self.device).eval()
        else:
            # requires_grad is kept as in the source: under no_grad it changes no memory, but
            # some CPU kernels round differently for frozen weights, and a copy that rounds
            # like the trainer's own model makes async at staleness 0 equal sync exactly
            self.model = copy.deepcopy(model).to(self.device).eval()
            for param in self.model.parameters():
                param.grad = None  # the copy never trains: drop any copied gradients
        self._version = 0
        self._lock = threading.Lock()
        self._closed = False
        # routing replay: the model's control records the routes of every forward
        control = routing_of(self.model)
        self._routes = control if control.replay else None

    @property
    def version(self) -> int:
        return self._version

    def generate(
        self,
        prompts: list[Prompt],
        params: SamplingParams,
        n: int,
        version: int,
        prompt_offset: int = 0,
    ) -> list[list[Completion]]:
        """n completions per prompt, in prompt order, tagged with `version`.

        `prompt_offset`: the index of `prompts[0]` in its generation batch (seeds).
        """
        check_sampling(params.temperature, params.top_k, params.top_p, params.min_p)
        if n < 1 or params.max_new_tokens < 1:
            raise ValueError(
                f"n and max_new_tokens must be >= 1, got {n} and {params.max_new_tokens}"
            )
        for prompt in prompts:
            if not prompt.ids:
                raise ValueError(f"prompt uid={prompt.uid} has no token ids; tokenise it first")
        with self._lock:
            self._check_ready(version)
            generators = self._generators(params, len(prompts), prompt_offset)
            with _generation_mode(self.model), torch.no_grad(), self._recording():
                return [
                    group
                    for start, chunk in self._chunks(prompts, n)
                    for group in self._generate_chunk(
                        chunk, params, n, _chunk_of(generators, start, len(chunk))
                    )
                ]

    def generate_turns(
        self, requests: list[TurnRequest], params: SamplingParams, version: int
    ) -> list[Completion]:
        """One completion per request (a turn of a multi-turn trajectory), tagged with
        `version`: request i sampled from its own seed (a generator of its own; none given:
        from the OS) and at most its own max_new_tokens, through a turn stream (all
        submitted at once, nothing kept)."""
        for i, request in enumerate(requests):
            if not request.ids or request.max_new_tokens < 1:
                raise ValueError(f"turn request {i} needs token ids and max_new_tokens >= 1")
        submitted = [dataclasses.replace(r, key=None) for r in requests]  # nothing kept
        position = {id(r): i for i, r in enumerate(submitted)}
        out: list[Completion | None] = [None] * len(requests)
        with self.open_turns(params, version) as stream:
            for request in submitted:
                stream.submit(request)
            while stream.pending():
                for request, completion in stream.advance():
                    out[position[id(request)]] = completion
        return out

    def open_turns(self, params: SamplingParams, version: int) -> HFTurnStream:
        """A continuous batch for one generation call's turns (turns.py): at most
        `max_batch_size` rows, at most `kv_cache_tokens` KV positions with the kept caches.
        The engine is held (no weight update, no other generation) until it is closed."""
        check_sampling(params.temperature, params.top_k, params.top_p, params.min_p)
        self._lock.acquire()
        modes = contextlib.ExitStack()
        try:
            self._check_ready(version)
            modes.enter_context(_generation_mode(self.model))
            modes.enter_context(self._recording())
        except BaseException:
            modes.close()
            self._lock.release()
            raise

        def on_close() -> None:
            try:
                modes.close()
            finally:
                self._lock.release()

        return HFTurnStream(
            self.model,
            params,
            eos_ids=eos_token_ids(self.model, self.tokenizer),
            device=self.device,
            completion=lambda row, p: self._completion(
                row, self.tokenizer.decode(row.ids, skip_special_tokens=True), p
            ),
            stop_text=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
            max_rows=self.max_batch_size,
            kv_cache_tokens=self.kv_cache_tokens,
            on_close=on_close,
            routes=self._routes,
        )

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Copy full or LoRA tensors (peft names, with or without prefixes) in as `version`."""
        with self._lock:
            self._check_open()
            if not self.share_weights:
                copy_named_tensors(self.model, named_tensors)
            self._set_version(version)

    def load_adapter(self, path: str, version: int) -> None:
        """Load a peft adapter saved at `path` into this engine's own copy as `version`."""
        if self.share_weights:
            raise ValueError(
                "load_adapter needs share_weights=False: a shared engine generates "
                "with the trainer's model, which already holds its adapter"
            )
        from peft import PeftModel, load_peft_weights, set_peft_model_state_dict

        with self._lock:
            self._check_open()
            if isinstance(self.model, PeftModel):
                result = set_peft_model_state_dict(self.model, load_peft_weights(path))
                unexpected = [k for k in result.unexpected_keys if "lora" in k]
                if unexpected:
                    raise ValueError(
                        f"adapter at {path} does not fit this model: unexpected "
                        f"tensors {unexpected[:3]}; was it trained on another base?"
                    )
            else:
                self.model = PeftModel.from_pretrained(self.model, path).to(self.device)
                self.model.eval().requires_grad_(False)
            self._set_version(version)

    def close(self) -> None:
        with self._lock:
            if not self.share_weights:
                self.model = None  # drop the own copy now, not when the engine is collected
            self._closed = True

    def _recording(self):
        """Routing replay: the routers' experts are recorded during generation."""
        return self._routes.recording() if self._routes is not None else contextlib.nullcontext()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this HFEngine was closed; create a new one")

    def _check_ready(self, version: int) -> None:
        """Open, and holding the policy version the caller generates with."""
        self._check_open()
        if version != self._version:
            raise EngineVersionError(
                f"asked to generate with policy version {version}, "
                f"but this engine holds version {self._version}"
            )

    def _set_version(self, version: int) -> None:
        self._version = version

    def _generators(self, params: SamplingParams, count: int, offset: int):
        """One random stream per prompt (seeded), one for the call (unseeded), or None
        (greedy decoding draws nothing)."""
        if params.temperature == 0:
            return None
        if params.seed is None:
            generator = torch.Generator(device=self.device)
            generator.seed()  # non-deterministic, from the OS: the global RNG stays untouched
            return generator
        return [
            torch.Generator(device=self.device).manual_seed(
                derive_seed(params.seed, self._version, offset + i)
            )
            for i in range(count)
        ]

    def _chunks(self, prompts: list[Prompt], n: int) -> Iterator[tuple[int, list[Prompt]]]:
        per_chunk = (
            len(prompts) if self.max_batch_size is None else max(1, self.max_batch_size // n)
        )
        for start in range(0, len(prompts), per_chunk):
            yield start, prompts[start : start + per_chunk]

    def _generate_chunk(
        self, prompts: list[Prompt], params: SamplingParams, n: int, generator
    ) -> list[list[Completion]]:
        input_ids, attention_mask = self._left_pad(prompts)  # (B, P) each
        copies = n if params.temperature == 0 else 1  # greedy: one sample, n identical copies
        rows = decode(
            self.model,
            input_ids,
            attention_mask,
            params,
            n // copies,
            eos_ids=eos_token_ids(self.model, self.tokenizer),
            generator=generator,
            stop_text=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
            routes=self._routes,
        )
        texts = self.tokenizer.batch_decode([row.ids for row in rows], skip_special_tokens=True)
        completions = [self._completion(row, text, params) for row, text in zip(rows, texts)]
        if copies > 1:  # independent lists per copy: a caller may edit one completion
            completions = [_copy(c) for c in completions for _ in range(copies)]
        return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _completion(self, row: DecodedRow, text: str, params: SamplingParams) -> Completion:
        if row.stopped == "stop":
            text = text[: min(text.find(s) for s in params.stop if s in text)]
        return Completion(
            ids=row.ids,
            text=text,
            logprobs=row.logprobs,
            finish_reason="length" if row.stopped is None else "stop",
            version=self._version,
            routes=row.routes,
        )

    def _left_pad(self, prompts: list[Prompt]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p.ids) for p in prompts)
        input_ids = torch.full((len(prompts), width), _pad_id(self.model, self.tokenizer))
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            input_ids[i, width - len(prompt.ids) :] = torch.tensor(prompt.ids)
            attention_mask[i, width - len(prompt.ids) :] = 1
        return input_ids.to(self.device), attention_mask.to(self.device)


def _chunk_of(generators, start: int, count: int):
    """The generators of prompts [start, start + count): a per-prompt list is sliced."""
    if isinstance(generators, list):
        return generators[start : start + count]
    return generators


def copy_named_tensors(
    model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> int:
    """Copy tensors into `model` by name; returns how many were copied.

    Names match after dropping wrapper prefixes (`module.`, `_orig_mod.`,
    `base_model.model.`), peft's `.base_layer` (but the one before a nested wrapper's own
    adapter: peft wraps each targeted parameter of a mixture of experts' experts module
    in a ParamWrapper of its own, `experts.base_layer.lora_A` inside `experts.lora_A`) and
    the adapter name after `lora_A`/`lora_B`, so peft's saved names, its in-model names and
    plain transformers names all fit. Two tensors under one name are refused.
    """
    adapters = tuple(getattr(model, "peft_config", {}) or ())
    targets: dict[str, list[torch.Tensor]] = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        found = targets.setdefault(_normalise_name(name, adapters), [])
        if found and all(t is not tensor for t in found):
            raise ValueError(
                f"update_weights: two tensors of the engine's model match the name {name!r}; "
                "its names cannot be told apart"
            )
        found.append(tensor)
    copied = 0
    with torch.no_grad():
        for name, tensor in named_tensors:
            key = _normalise_name(name, adapters)
            if key not in targets:
                raise KeyError(
                    f"update_weights: no tensor named {name!r} in the engine's model "
                    f"(looked for {key!r}); send names from model.named_parameters() "
                    "or peft's get_peft_model_state_dict()"
                )
            for target in targets[key]:
                if target.shape != tensor.shape:
                    raise ValueError(
                        f"update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                        f"the engine's model expects {tuple(target.shape)}"
                    )
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            copied += 1
    return copied


def _normalise_name(name: str, adapters: tuple[str, ...]) -> str:
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix) :], True
    while (plain := _BASE_LAYER.sub(".", name)) != name:
        name = plain
    for adapter in adapters:
        name = re.sub(rf"\.({_LORA_SEGMENTS})\.{re.escape(adapter)}(?=\.|$)", r".\1", name)
    return name


def _same_device(a: torch.device, b: torch.device) -> bool:
    """ "cuda" names the current CUDA device, so it matches "cuda:0" there."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or (a.index is not None and b.index is not None):
        return a.index == b.index or a.type == "cpu"
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (
        b.index if b.index is not None else current
    )


def _copy(c: Completion) -> Completion:
    return dataclasses.replace(c, ids=list(c.ids), logprobs=list(c.logprobs))


def _hf_model(model):
    """The transformers model inside a peft wrapper (whose generation_config generate reads)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def eos_token_ids(model, tokenizer) -> set[int]:
    """The model's generation eos ids, else its config's, else the tokenizer's."""
    inner = _hf_model(model)
    for eos in (
        inner.generation_config.eos_token_id,
        inner.config.eos_token_id,
        tokenizer.eos_token_id,
    ):
        if eos is not None:
            return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
    return set()


def _pad_id(model, tokenizer) -> int:
    for candidate in (
        tokenizer.pad_token_id,
        _hf_model(model).generation_config.pad_token_id,
        tokenizer.eos_token_id,
    ):
        if candidate is not None:
            return int(candidate)
    raise ValueError("the tokenizer has neither a pad nor an eos token; set tokenizer.pad_token")


@contextmanager
def _generation_mode(model) -> Iterator[None]:
    """Eval mode, gradient checkpointing off; every module's flags restored afterwards."""
    modules = list(model.modules())
    training = [m.training for m in modules]
    checkpointing = [
        (m, m.gradient_checkpointing)
        for m in modules
        if getattr(m, "gradient_checkpointing", None) is True
    ]
    model.eval()
    for module, _ in checkpointing:
        module.gradient_checkpointing = False
    try:
        yield
    finally:
        for module, flag in checkpointing:
            module.gradient_checkpointing = flag
        for module, flag in zip(modules, training):
            module.training = flag
