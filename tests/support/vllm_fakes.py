"""Test doubles for the vLLM engine's server tests: no vLLM needed.

`FakeLocal` stands in for `LocalVLLM` behind the real HTTP handler: the real
`VersionGate` (so the version and run rules under test are the product's), scripted
completions, and a record of what was loaded. `FakeTeacher` adds a served distillation
teacher's scoring: a transformers model's log-probs of given ids, one plain forward per
sequence (the naive reference of what vLLM's prompt log-probs are).
"""

from __future__ import annotations

import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

from safetensors.torch import load_file

from leangrpo.contracts import Completion
from leangrpo.rollout.vllm.http import make_handler
from leangrpo.rollout.vllm.versions import VersionGate


class FakeLocal:
    """LocalVLLM's interface with the real gate; completions reverse the prompt."""

    def __init__(
        self, name: str = "fake", delay_s: float = 0.0, version: int = 0, run=None, lora_modules=None
    ):
        self.name, self.delay_s = name, delay_s
        # "ok"; "error": generation and weight loads fail (500); "hang": generation sleeps
        # until released (the client times out)
        self.behaviour = "ok"
        self.release = threading.Event()
        self.served_lora_modules = lora_modules  # what /health says it serves LoRA on
        self.gate = VersionGate(version, run)
        self.weights: dict = {}
        self.adapter_files: dict[str, bytes] = {}
        self.loaded: list[tuple] = []  # (kind, run, version) of every real load
        self.served: list[list[int]] = []
        self.seeds = None
        self.requests: list[tuple[list[int], int | None, int]] = []  # (ids, seed, max tokens)
        # routing replay: the engine returns route records (`routes` says so in /health); a
        # record is (tokens, 2 layers, top-2) of experts (t, t + 1) mod 4, or what
        # `route_records` makes of a completion
        self.routes = False
        self.route_records = None

    @property
    def version(self) -> int:
        return self.gate.version

    @property
    def held(self):
        return self.gate.held

    def generate(self, prompt_ids, params, n, version, seeds=None, *, run):
        self._misbehave()
        with self.gate.admit(version, run):
            self.seeds = seeds
            time.sleep(self.delay_s)
            self.served += prompt_ids
            for i, ids in enumerate(prompt_ids):
                self.requests.append((ids, None if seeds is None else seeds[i], params.max_new_tokens))
            return [
                [
                    self._with_routes(
                        Completion(
                            ids[::-1] + [k], self.name, [-0.5] * (len(ids) + 1), "length", version
                        )
                    )
                    for k in range(n)
                ]
                for ids in prompt_ids
            ]

    def _with_routes(self, completion: Completion) -> Completion:
        if self.routes:
            import torch

            t = torch.arange(len(completion.ids))
            record = torch.stack([t % 4, (t + 1) % 4], -1)[:, None].expand(-1, 2, -1)
            completion.routes = record.to(torch.uint8).contiguous()
            if self.route_records is not None:
                completion.routes = self.route_records(completion)
        return completion

    def _misbehave(self) -> None:
        if self.behaviour == "error":
            raise RuntimeError(f"server {self.name} is broken")
        if self.behaviour == "hang":
            self.release.wait(30)
            raise RuntimeError(f"server {self.name} hung")

    def load_weight_files(self, paths, version, *, run):
        if self.behaviour == "error":
            raise RuntimeError(f"server {self.name} cannot load weights")
        with self.gate.update(version, drain=True, run=run) as needed:
            if needed:
                for p in paths:
                    self.weights.update(load_file(p))
                self.loaded.append(("weights", run, version))

    def load_adapter(self, source: Path, version: int, *, run):
        with self.gate.update(version, drain=False, run=run) as needed:
            if needed:
                self.adapter_files = {p.name: p.read_bytes() for p in source.iterdir()}
                self.loaded.append(("adapter", run, version))

    def lora_modules(self):
        return self.served_lora_modules

    def sleep(self, level: int = 1) -> None:
        self.loaded.append(("sleep", level, None))

    def wake_up(self) -> None:
        pass


class FakeTeacher(FakeLocal):
    """A served teacher: `score` runs `model` (a transformers causal LM) on each sequence
    alone, log-softmax at temperature 1 in float64; what it scored is recorded. It can
    fail its next requests (`fail_next`) or reply wrong rows (`wrong`)."""

    def __init__(self, model, name: str = "teacher", max_model_len: int = 64):
        super().__init__(name)
        self.model, self.max_model_len = model, max_model_len
        self.scored: list[list[int]] = []
        self.fail_next = 0  # the next this many requests fail (500), then it scores again
        self.wrong = None  # rows -> the rows it replies instead (a broken server)

    def score(self, sequences, starts):
        self._misbehave()
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError(f"server {self.name} failed for a moment")
        out = self._score(sequences, starts)
        return out if self.wrong is None else self.wrong(out)

    def _score(self, sequences, starts):
        import torch

        run, version = self.held
        if run is not None:
            from leangrpo.contracts import EngineVersionError

            raise EngineVersionError(f"this server holds run {run}'s weights")
        out = []
        with self.gate.admit(version, run), torch.no_grad():
            for ids, start in zip(sequences, starts):
                logits = self.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
                logp = torch.log_softmax(logits.double(), -1)
                targets = torch.tensor(ids[start:])
                out.append(logp[start - 1 : len(ids) - 1].gather(1, targets[:, None])[:, 0].tolist())
                self.scored.append(list(ids))
        return out


class Served:
    """A real `ThreadingHTTPServer` with the real handler around a FakeLocal."""

    def __init__(self, local: FakeLocal, staging: Path, model: str = "fake", **handler_kwargs):
        self.local = local
        self.staging = staging
        staging.mkdir(parents=True, exist_ok=True)
        self.server = ThreadingHTTPServer(
            ("127.0.0.1", 0), make_handler(local, staging, model, **handler_kwargs)
        )
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
