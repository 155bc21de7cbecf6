"""`leangrpo serve` and its client without vLLM: the real HTTP handler and `ServerPool` in
front of `FakeLocal` (the real version gate, scripted completions).

Covers: versions that identify the run (a reused server), seeds that never repeat,
adapter names and ids never reused, and the server's hardening (token, body limits,
staging cleanup, adapter archives).
"""

from __future__ import annotations

import http.client
import io
import json
import os
import socket
import tarfile
import time
from pathlib import Path

import pytest
import torch
from support.configs import DEMO_MODEL, tiny_run
from support.files import read_jsonl
from support.vllm_fakes import FakeLocal, Served

from leangrpo.contracts import Completion, EngineVersionError, Prompt, SamplingParams
from leangrpo.errors import RunError
from leangrpo.pipeline.batch import _seeded
from leangrpo.rollout.vllm.client import TOKEN_ENV, ServerPool, VLLMServerError
from leangrpo.rollout.vllm.engine import VLLMEngine, check_groups
from leangrpo.rollout.vllm.http import drop_superseded, extract_adapter, prepare_staging
from leangrpo.rollout.vllm.local import AdapterSlots
from leangrpo.rollout.vllm.server import build_parser, check_serve_args, serve_main
from leangrpo.rollout.vllm.settings import VLLMSettings
from leangrpo.rollout.vllm.versions import VersionGate
from leangrpo.seeding import SAMPLE_BITS, derive_seed, prompt_seed

TOKEN = "s3cret-token-of-32-characters-xx"
PROMPTS = [Prompt(uid=i, text="", ids=[i + 1, i + 2]) for i in range(3)]


@pytest.fixture
def served(tmp_path):
    servers: list[Served] = []

    def start(local: FakeLocal | None = None, **kwargs) -> Served:
        servers.append(Served(local or FakeLocal(), tmp_path / f"s{len(servers)}", **kwargs))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def server_engine(url: str, token: str | None = None) -> VLLMEngine:
    pool = ServerPool([url], timeout_s=10, max_retries=0, token=token)
    return VLLMEngine(pool, VLLMSettings(mode="server"))


def push(engine: VLLMEngine, version: int, value: float = 0.0) -> None:
    engine.update_weights({"w": torch.full((2,), value)}.items(), version)


# --------------------------------------------------------------------------- adapters servers serve


def test_an_adapter_on_modules_a_server_serves_no_lora_on_is_refused_before_training(served):
    """Servers say in /health what they serve LoRA on; the engine refuses (one sentence
    naming the modules) an adapter that would be served in part, before any push."""
    linears = ["down_proj", "k_proj", "o_proj", "q_proj", "v_proj"]
    a = served(FakeLocal(lora_modules=linears + ["gate_proj", "up_proj"]))
    b = served(FakeLocal(lora_modules=linears))
    pool = ServerPool([a.url, b.url], timeout_s=10, max_retries=0)
    engine = VLLMEngine(pool, VLLMSettings(mode="server"))
    assert pool.lora_modules() == linears  # what every server serves
    adapter = [
        f"base_model.model.model.layers.{i}.{m}.lora_{ab}.default.weight"
        for i in range(2) for m in ("self_attn.q_proj", "mlp.up_proj", "mlp.down_proj") for ab in "AB"
    ] + ["base_model.model.model.embed_tokens.lora_embedding_A.default"]  # fmt: skip
    with pytest.raises(RunError) as err:
        engine.check_adapter(adapter)
    message = str(err.value)
    assert message.startswith("lora.target_modules puts adapters on embed_tokens, up_proj (model.layers.0.mlp.up_proj, and 2 more), which vLLM does not serve LoRA on")  # fmt: skip
    assert "remove them from lora.target_modules" in message and "\n" not in message
    engine.check_adapter([n for n in adapter if "up_proj" not in n and "embed" not in n])
    assert a.local.loaded == b.local.loaded == []  # nothing was pushed
    off = served(FakeLocal(lora_modules=[]))  # started without LoRA
    with pytest.raises(RunError, match=r"\(it serves: none: LoRA is off on that engine\)"):
        VLLMEngine(ServerPool([off.url], max_retries=0), VLLMSettings(mode="server")).check_adapter(adapter[:2])  # fmt: skip
    silent = served(FakeLocal())  # says nothing: left to refuse at the push
    VLLMEngine(ServerPool([silent.url, a.url], max_retries=0), VLLMSettings(mode="server")).check_adapter(adapter)  # fmt: skip


# --------------------------------------------------------------------------- version identity


def test_a_reused_server_never_serves_the_previous_runs_weights(served):
    """repros/server_version.py: a server left at version 80 (or 1) by an earlier run."""
    server = served(FakeLocal(version=80, run="previousrun"))
    engine = server_engine(server.url)
    assert engine.version == -1  # not the server's 80: none of this run's weights are there
    with pytest.raises(EngineVersionError, match="has not pushed"):
        engine.generate(PROMPTS, SamplingParams(), 2, 80)
    other = ServerPool([server.url], timeout_s=10, max_retries=0)  # skips the engine's check
    with pytest.raises(EngineVersionError, match="holds run previousrun's weights"):
        other.generate([[1]], SamplingParams(), 1, 80, run=engine.run_id)

    push(engine, 0, 1.0)  # what the trainer does at start: version 0 loads over version 80
    assert server.local.loaded == [("weights", engine.run_id, 0)]
    groups = engine.generate(PROMPTS, SamplingParams(), 2, engine.version)
    assert {c.version for g in groups for c in g} == {0}  # staleness 0, not -80

    server.local.gate = VersionGate(1, "crashedrun")  # left at version 1 by a crashed run
    push(engine, 1, 2.0)
    assert server.local.loaded[-1] == ("weights", engine.run_id, 1)  # loaded, not "a retry"
    assert torch.equal(server.local.weights["w"], torch.full((2,), 2.0))


def test_versions_are_monotonic_within_a_run_and_retries_are_idempotent(served):
    server = served()
    engine = server_engine(server.url)
    push(engine, 2)
    pool = engine.backend
    run = engine.run_id
    assert pool._post_json(server.url, f"/weights/{run}/2/commit", {"num_buckets": 1}) == {
        "version": 2
    }  # a retried commit: nothing loads again
    assert server.local.loaded == [("weights", run, 2)]
    with pytest.raises(EngineVersionError, match="versions never go backwards"):
        push(engine, 1)
    assert server.local.held == (run, 2)

    second = server_engine(server.url)  # another run takes the server over
    push(second, 0)
    assert server.local.held == (second.run_id, 0)
    with pytest.raises(EngineVersionError, match="never share a `leangrpo serve`"):
        engine.generate(PROMPTS, SamplingParams(), 1, 2)


def test_engine_refuses_completions_from_other_weights():
    class Backend:  # a server that answers with whatever version it holds
        held = ("r", 3)

        def generate(self, ids, params, n, version, seeds, run):
            return [[Completion([1], "x", [-1.0], "stop", 5) for _ in range(n)] for _ in ids]

    engine = VLLMEngine(Backend(), VLLMSettings(), run_id="r")
    with pytest.raises(EngineVersionError, match=r"version\(s\) \[5\] for a request at version 3"):
        engine.generate(PROMPTS, SamplingParams(), 2, 3)
    with pytest.raises(RuntimeError, match="completions for 2 prompts"):
        check_groups([[]], 2, 1, 0)


def test_the_trainer_pushes_its_weights_to_a_reused_server_at_start(served, tmp_path):
    from leangrpo.config import config_from_dict
    from leangrpo.train import Trainer

    server = served(FakeLocal(version=80, run="previousrun"))
    cfg = tiny_run(
        tmp_path,
        run={"max_steps": 1},
        rollout={"engine": "vllm", "vllm": {"mode": "server", "urls": [server.url]}},
        loss={"mu": 1},
    )
    trainer = Trainer(config_from_dict(cfg))
    run = trainer.engines.rollout.run_id
    assert server.local.loaded == [("weights", run, 0)]  # before anything was generated
    assert not server.local.served
    trainer.train()
    assert server.local.served and server.local.held == (run, 1)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["staleness/max"] for r in rows if "staleness/max" in r] == [0.0]


# --------------------------------------------------------------------------- seeds


class SeedRecorder:
    held = ("r", 0)

    def __init__(self):
        self.samples: list[int] = []

    def generate(self, ids, params, n, version, seeds, run):
        self.samples += [s + k for s in seeds for k in range(n)]  # vLLM: child k gets seed + k
        return [[Completion([1], "x", [-1.0], "stop", version)] * n for _ in ids]


def test_vllm_seeds_never_repeat_across_batches_prompts_or_samples():
    """repros/seeds.py: consecutive batches shared 31 of 32 per-sample seeds."""
    prompts = [Prompt(i, "p", [1]) for i in range(8)]
    per_batch = []
    for batch in range(40):
        recorder = SeedRecorder()
        engine = VLLMEngine(recorder, VLLMSettings(), run_id="r")
        engine.generate(prompts, _seeded(SamplingParams(), seed=0, index=batch), 16, 0)
        per_batch.append(recorder.samples)
    every = [s for batch in per_batch for s in batch]
    assert len(every) == 40 * 8 * 16 and len(set(every)) == len(every)
    assert all(0 <= s < 2**62 for s in every)
    again = SeedRecorder()  # the same (run seed, batch): the same seeds (exact resume)
    VLLMEngine(again, VLLMSettings(), run_id="r").generate(
        prompts, _seeded(SamplingParams(), seed=0, index=7), 16, 0
    )
    assert again.samples == per_batch[7]
    assert _seeded(SamplingParams(), 1, 0).seed != _seeded(SamplingParams(), 0, 1).seed
    assert prompt_seed(derive_seed(5, 2), 3, 4) % (1 << SAMPLE_BITS) == 0
    with pytest.raises(ValueError, match="completions per prompt"):
        prompt_seed(1, 0, (1 << SAMPLE_BITS) + 1)


# --------------------------------------------------------------------------- adapters


def write_adapter_dir(path: Path, value: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (path / "adapter_model.safetensors").write_bytes(value)
    return path


def test_adapter_names_and_ids_are_unique_per_run_and_version(tmp_path):
    slots = AdapterSlots(tmp_path / "adapters")
    made = []
    for i, (run, version) in enumerate([("a", 1), ("b", 1), ("a", 2), ("c", 1), ("c", 1)]):
        slot = slots.publish(write_adapter_dir(tmp_path / f"src{i}", b"w%d" % i), run, version)
        slots.add(slot)
        made.append(slot)
        assert (slot.path / "adapter_model.safetensors").read_bytes() == b"w%d" % i
    assert len({s.name for s in made}) == 5 and len({s.int_id for s in made}) == 5
    assert [s.int_id for s in made] == sorted(s.int_id for s in made)  # never reused
    assert made[1].name.startswith("b-v1-") and made[0].name.startswith("a-v1-")
    in_use = {("a", 2)}
    gone = slots.retire(keep=1, in_use=lambda key: key in in_use)
    assert [s.key for s in gone] == [("a", 1), ("b", 1)]
    assert not made[0].path.exists() and made[2].path.exists()
    assert list(slots.slots) == [("a", 2), ("c", 1)]
    again = AdapterSlots(tmp_path / "adapters")  # a new process: earlier adapters are gone
    assert not made[4].path.exists() and not again.slots


def adapter_tar(members: list[tuple[str, bytes | None, bytes]]) -> bytes:
    """(name, symlink target or None, content) -> an uncompressed tar."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, link, data in members:
            info = tarfile.TarInfo(name)
            if link is not None:
                info.type, info.linkname = tarfile.SYMTYPE, link.decode()
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


CONFIG = ("adapter_config.json", None, b'{"r": 8}')
WEIGHTS = ("adapter_model.safetensors", None, b"tensors")


@pytest.mark.parametrize(
    ("members", "error"),
    [
        ([CONFIG, ("adapter_model.bin", None, b"pickle")], "adapter_model.bin"),
        ([CONFIG, WEIGHTS, ("../evil.safetensors", None, b"x")], "evil"),
        ([CONFIG, WEIGHTS, ("sub/adapter_model.safetensors", None, b"x")], "sub/"),
        ([CONFIG, ("adapter_model.safetensors", b"/etc/passwd", b"")], "not a regular file"),
        ([CONFIG, WEIGHTS, WEIGHTS], "once each"),
        ([WEIGHTS], "needs adapter_config.json"),
        ([("adapter_config.json", None, b"[1]"), WEIGHTS], "JSON object"),
    ],
)
def test_adapter_archives_hold_only_config_and_safetensors(tmp_path, members, error):
    with pytest.raises(ValueError, match=error):
        extract_adapter(adapter_tar(members), tmp_path)
    assert not any(tmp_path.parent.glob("evil*")) and not (tmp_path / "sub").exists()


def test_adapter_upload_refusals_reach_the_client_as_4xx(served, tmp_path):
    server = served()
    pool = ServerPool([server.url], timeout_s=10, max_retries=0)
    bad = adapter_tar([CONFIG, ("adapter_model.bin", None, b"pickle")])
    with pytest.raises(VLLMServerError, match=r"\(400\).*adapter_model.bin"):
        pool.request(server.url, "PUT", "/adapter/run1/1", bad, "application/x-tar")
    gz = io.BytesIO()
    with tarfile.open(fileobj=gz, mode="w:gz") as tar:
        tar.addfile(tarfile.TarInfo("adapter_config.json"))
    with pytest.raises(VLLMServerError, match=r"\(400\)"):
        pool.request(server.url, "PUT", "/adapter/run1/1", gz.getvalue(), "application/x-tar")
    assert server.local.loaded == []
    only_bin = tmp_path / "bin_adapter"
    only_bin.mkdir()
    (only_bin / "adapter_config.json").write_text("{}")
    (only_bin / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(FileNotFoundError, match="safe_serialization=True"):
        pool.load_adapter(only_bin, 1, run="run1")
    good = adapter_tar([CONFIG, WEIGHTS])
    pool.request(server.url, "PUT", "/adapter/run1/1", good, "application/x-tar")
    assert server.local.loaded == [("adapter", "run1", 1)]
    assert not list(server.staging.iterdir())  # the unpacked copy is gone


# --------------------------------------------------------------------------- authentication


def test_a_token_guards_every_route_and_the_client_sends_it(served, monkeypatch):
    server = served(token=TOKEN)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        status, _ = raw_request(server.url, "GET", "/health", headers=headers)
        assert status == 401
    status, _ = raw_request(server.url, "POST", "/weights/r/0/commit", b"{}", {})
    assert status == 401 and server.local.loaded == []
    with pytest.raises(VLLMServerError, match=f"rollout.vllm.token_file or \\${TOKEN_ENV}"):
        ServerPool([server.url], timeout_s=10, max_retries=0)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    engine = VLLMEngine.server([server.url], max_retries=0)  # the token from the environment
    push(engine, 0)
    assert engine.generate(PROMPTS, SamplingParams(), 1, 0)[0][0].version == 0
    engine.close()


def test_serving_beyond_loopback_needs_a_token(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    parser = build_parser()
    for host in ("0.0.0.0", "", "10.1.2.3", "trainer-host"):
        with pytest.raises(ValueError, match=f"{TOKEN_ENV}"):
            check_serve_args(parser.parse_args(["m", "--host", host]))
    assert check_serve_args(parser.parse_args(["m"])) is None  # loopback: token optional
    assert check_serve_args(parser.parse_args(["m", "--host", "::1"])) is None
    with pytest.raises(SystemExit) as exit_info:  # before vLLM is touched
        serve_main(["m", "--host", "0.0.0.0"])
    assert exit_info.value.code == 2 and "reachable from other machines" in capsys.readouterr().err
    (tmp_path / "token").write_text(TOKEN + "\n")
    args = parser.parse_args(["m", "--host", "0.0.0.0", "--token-file", str(tmp_path / "token")])
    assert check_serve_args(args) == TOKEN
    monkeypatch.setenv(TOKEN_ENV, "short")
    with pytest.raises(ValueError, match="at least 16"):
        check_serve_args(parser.parse_args(["m"]))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/nowhere/model"], "model '/nowhere/model': no such directory"),
        ([str(DEMO_MODEL), "--engine-kwargs", "{bad"], "--engine-kwargs is not valid JSON"),
        ([str(DEMO_MODEL), "--engine-kwargs", "[1]"], "--engine-kwargs must be a JSON object"),
        ([str(DEMO_MODEL), "--port", "PORT"], "cannot listen on 127.0.0.1:PORT"),
    ],
)
def test_serve_start_up_errors_are_one_line_before_the_model_loads(
    monkeypatch, capsys, args, message
):
    """Each was a traceback, the port in use only after vLLM had loaded the model."""
    import importlib.util

    import leangrpo.rollout.vllm.server as server_module

    def no_load(*a, **k):
        raise AssertionError("vLLM was started")

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(  # vLLM "installed" (the check that it is comes last)
        importlib.util, "find_spec", lambda name, *a: name == "vllm" or real_find_spec(name, *a)
    )
    monkeypatch.setattr(server_module, "LocalVLLM", no_load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        with pytest.raises(SystemExit) as exit_info:
            serve_main([a.replace("PORT", port) for a in args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert message.replace("PORT", port) in err


# --------------------------------------------------------------------------- bodies


def raw_request(url: str, method: str, path: str, body: bytes = b"", headers=None):
    """One request with exactly the headers given (urllib would fix Content-Length)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.putrequest(method, path, skip_accept_encoding=True)
    for key, value in (headers or {}).items():
        conn.putheader(key, value)
    conn.endheaders(body or None)
    reply = conn.getresponse()
    data = reply.read()
    conn.close()
    return reply.status, data


@pytest.mark.parametrize(
    ("length", "status"),
    [(None, 411), ("-1", 400), ("-5", 400), ("12abc", 400), (str(2 << 20), 413), ("1", 400)],
)
def test_body_lengths_are_checked_before_reading(served, length, status):
    server = served(max_body_bytes=1 << 20)
    headers = {} if length is None else {"Content-Length": length}
    # a negative length used to read until the client closed: this would time out
    status_got, data = raw_request(server.url, "POST", "/weights/r/0/commit", b"{", headers)
    assert status_got == status, data
    assert server.local.loaded == []


def test_chunked_and_oversized_uploads_are_refused(served, tmp_path):
    server = served(max_body_bytes=1 << 20)
    status, _ = raw_request(
        server.url, "PUT", "/weights/r/0/0", b"", {"Transfer-Encoding": "chunked"}
    )
    assert status == 411
    with socket.create_connection(server.server.server_address, timeout=10) as sock:
        sock.sendall(b"PUT /weights/r/0/0 HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\nxx")
        assert b" 413 " in sock.recv(4096).split(b"\r\n")[0] + b" "
    pool = ServerPool([server.url], timeout_s=10, max_retries=0)
    assert pool.max_body_bytes == 1 << 20
    big = tmp_path / "bucket.safetensors"
    big.write_bytes(b"\0" * ((1 << 20) + 1))
    with pytest.raises(ValueError, match="--max-body-mb"):
        pool.load_weight_files([big], 0, run="r")
    assert not list(server.staging.iterdir())


# --------------------------------------------------------------------------- staging


def stage(pool: ServerPool, url: str, run: str, version: int, index: int = 0) -> None:
    from safetensors.torch import save

    bucket = save({"w": torch.zeros(2)})
    pool.request(url, "PUT", f"/weights/{run}/{version}/{index}", bucket, "x")


def test_staging_is_emptied_at_start_superseded_or_timed_out(served, tmp_path):
    root = tmp_path / "work"
    (root / "staging" / "weights-old-v3").mkdir(parents=True)
    assert list(prepare_staging(root).iterdir()) == []  # a restarted server starts clean

    server = served(staging_timeout_s=60)
    pool = ServerPool([server.url], timeout_s=10, max_retries=0)
    stage(pool, server.url, "abandoned", 4)
    old = server.staging / "weights-abandoned-v4"
    past = time.time() - 120
    os.utime(old, (past, past))
    stage(pool, server.url, "b", 1)  # any upload sweeps uploads idle past the timeout
    assert not old.exists()

    for run, version in [("x", 9), ("b", 0), ("b", 5), ("b", 7)]:
        stage(pool, server.url, run, version)
    pool._post_json(server.url, "/weights/b/5/commit", {"num_buckets": 1})
    assert sorted(p.name for p in server.staging.iterdir()) == ["weights-b-v7"]
    with pytest.raises(EngineVersionError, match="never go backwards"):
        stage(pool, server.url, "b", 2)  # nothing older than the held version is staged
    drop_superseded(server.staging, "b", 7)
    assert list(server.staging.iterdir()) == []


def test_serve_without_vllm_installed_is_one_line(monkeypatch, capsys):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "vllm" else real_find_spec(name, *a),
    )
    with pytest.raises(SystemExit) as exit_info:
        serve_main([str(DEMO_MODEL)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert "vLLM is not installed in this environment: pip install" in err
