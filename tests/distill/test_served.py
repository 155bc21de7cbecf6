"""A served distillation teacher (distill.teacher_urls), without vLLM: the config's
refusals; the log-probs through the real client, wire and HTTP handler (fake servers
scoring with a transformers teacher, support/vllm_fakes.py `FakeTeacher`) against the
in-process teacher's packed pass, plain, shared-prefix and multi-turn; a server dying,
refusing or replying what was not asked mid-run (its share goes to another; none left:
one sentence), a server's transient failures (probed, back for the next batch; a lone
one waited for within the timeout); the checks
before anything loads, asked of each server's model. vLLM's own prompt log-probs against
the in-process teacher, and a training run: test_served_vllm.py."""

from __future__ import annotations

import json
import shutil
import socket

import pytest
import torch
from support.configs import DEMO_MODEL, tiny_run
from support.models import make_tiny_model
from support.vllm_fakes import FakeTeacher, Served

from leangrpo.config import ConfigError, config_from_dict
from leangrpo.config.distill import DistillConfig
from leangrpo.config.training import LogprobsConfig
from leangrpo.contracts import Completion, Prompt, RolloutSample, SamplingParams, Trajectory
from leangrpo.distill.check import TeacherMismatchError, TeacherServerError, check_teacher
from leangrpo.distill.served import ServedTeacher, scored_sequences
from leangrpo.distill.teacher import teacher_logprobs
from leangrpo.distributed.dealing import padding_batch
from leangrpo.model.files import check_model_files
from leangrpo.ops.attention.adapter import enable_packed_attention
from leangrpo.rollout.vllm.versions import VersionGate
from leangrpo.train.packing import pack_samples

URL = "http://127.0.0.1:8000"
# (prompt length, completion segments); True = a model turn, False = the environment's
SHAPES = [
    (4, [(5, True)]),
    (4, [(1, True)]),
    (5, [(3, True), (2, False), (4, True)]),  # multi-turn: a tool reply in between
    (5, [(2, True), (3, False), (1, True)]),
]


def tiny_teacher():
    teacher = make_tiny_model("qwen2", seed=1, dtype=torch.float64, hidden_size=48)
    enable_packed_attention(teacher, "sdpa_segments")
    return teacher.requires_grad_(False)


def make_samples(seed: int = 0, shared_prompts: bool = False) -> list[RolloutSample]:
    """SHAPES' samples, in groups of two (one prompt per group when `shared_prompts`)."""
    g = torch.Generator().manual_seed(seed)
    out, prompt = [], None
    for i, (plen, segments) in enumerate(SHAPES):
        if prompt is None or not shared_prompts or i % 2 == 0:
            prompt = Prompt(i // 2, "", torch.randint(2, 64, (plen,), generator=g).tolist())
        ids = torch.randint(2, 64, (sum(n for n, _ in segments),), generator=g).tolist()
        model_tokens = sum(n for n, m in segments if m)
        trajectory = None
        if len(segments) > 1:
            trajectory = Trajectory(segments, [0] * sum(m for _, m in segments), [])
        completion = Completion(ids, "", [-1.0] * model_tokens, "stop", 0, trajectory)
        out.append(RolloutSample(i // 2, prompt, completion, advantage=0.5 - i % 2))
    return out


def served_config(tmp_path, distill=None, **sections):
    distill = {"teacher_urls": [URL], **(distill or {})}
    return config_from_dict(tiny_run(tmp_path, distill=distill, **sections))


# -- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("distill", "sections", "expected"),
    [
        ({"teacher": "somewhere"}, {}, "and both are set"),
        ({"teacher_urls": []}, {}, "and neither is set"),
        ({"objective": "jsd"}, {}, "distill.objective: jsd needs the teacher's full"),
        ({"teacher_quantization": "nf4"}, {}, "drop distill.teacher_quantization"),
        ({"teacher_revision": "main"}, {}, "drop distill.teacher_revision"),
        ({"teacher_urls": ["127.0.0.1:8000"]}, {}, "'127.0.0.1:8000' is not a server URL"),
        ({"teacher_urls": [URL, URL + "/"]}, {}, f"names {URL} twice"),
        ({}, {"rollout": {"temperature": 0.7}}, r"rollout.temperature is 0.7"),
        (
            {},
            {"rollout": {"engine": "vllm", "vllm": {"mode": "server", "urls": [URL + "/"]}}},
            "in both distill.teacher_urls and rollout.vllm.urls",
        ),
    ],
)
def test_a_served_teacher_config_refuses_what_it_cannot_do(tmp_path, distill, sections, expected):
    with pytest.raises(ConfigError, match=expected) as caught:
        served_config(tmp_path, distill, **sections)
    assert "\n" not in str(caught.value).strip()


@pytest.mark.parametrize(("key", "value"), [("teacher_token_file", "f"), ("teacher_timeout_s", 9)])
def test_server_settings_without_servers_are_refused_and_pure_distillation_needs_no_reward(
    tmp_path, key, value
):
    with pytest.raises(ConfigError, match=f"distill.{key} applies to the servers"):
        config_from_dict(tiny_run(tmp_path, distill={"teacher": "t", key: value}))
    cfg = served_config(tmp_path, rewards={"functions": []})  # pure distillation: no reward
    assert cfg.served_teacher() and cfg.distill.teacher is None


# -- log-probs -------------------------------------------------------------------------------


@pytest.fixture
def teacher_servers(tmp_path):
    """Two fake teacher servers scoring with the same float64 transformers teacher."""
    teacher = tiny_teacher()
    servers = [Served(FakeTeacher(teacher, name), tmp_path / name) for name in ("a", "b")]
    yield teacher, servers
    for s in servers:
        s.close()


def served_teacher(servers) -> ServedTeacher:
    urls = [s.url for s in servers]
    return ServedTeacher(DistillConfig(teacher_urls=urls, teacher_timeout_s=30))


def in_process(teacher, mb) -> torch.Tensor:
    return teacher_logprobs(teacher, mb, SamplingParams(temperature=1.0), LogprobsConfig())


@pytest.mark.parametrize("shared", [False, True])
def test_served_logprobs_equal_the_in_process_teachers(teacher_servers, shared):
    """Plain and shared-prefix rows, a multi-turn sample among them (its environment
    tokens sent as context, never read back), a torchrun padding micro-batch (zeros, no
    request): the same (T,) log-probs as the local teacher's packed pass, the sequences
    spread over both servers, each scored from its first completion token."""
    teacher, servers = teacher_servers
    samples = make_samples(seed=3, shared_prompts=shared)
    mb, padding = pack_samples(samples, shared_prefix=shared), padding_batch(0)
    client = served_teacher(servers)
    client.start([mb, padding], 1.0).attach()
    torch.testing.assert_close(mb.teacher_logprobs.double(), in_process(teacher, mb).double(),
                               rtol=1e-6, atol=1e-6)  # fmt: skip
    assert torch.equal(padding.teacher_logprobs, torch.zeros(1))
    scored = [ids for s in servers for ids in s.local.scored]
    assert sorted(scored) == sorted(s.prompt.ids + s.completion.ids for s in samples)
    assert all(s.local.scored for s in servers)
    read = scored_sequences(mb)
    assert read.starts() == [len(s.prompt.ids) for s in samples]  # no prompt position scored
    client.close()


def test_a_dead_or_refusing_server_hands_its_share_over_and_none_left_is_one_sentence(
    teacher_servers,
):
    """Server a dies between batches: its share of the next batch goes to b, the batch
    complete and right; then b refuses (a trainer pushed its weights there: 409), and with
    no server left the batch fails with one sentence naming distill.teacher_urls and both
    servers' errors, its log-probs never set."""
    teacher, (a, b) = teacher_servers
    client = served_teacher([a, b])
    client.pool.patience_s = 1.0  # how long the last batch waits for a (closed) to answer
    mb = pack_samples(make_samples(seed=1))
    client.start([mb], 1.0).attach()
    assert a.local.scored and b.local.scored  # both served the first batch
    a.close()
    mb = pack_samples(make_samples(seed=2))
    client.start([mb], 1.0).attach()
    torch.testing.assert_close(mb.teacher_logprobs.double(), in_process(teacher, mb).double(),
                               rtol=1e-6, atol=1e-6)  # fmt: skip
    router = client.pool.router
    assert router.retries >= 1 and not router.servers[0].healthy and router.servers[1].healthy
    b.local.gate = VersionGate(0, "another-run")  # its weights replaced: it refuses (409)
    mb = pack_samples(make_samples(seed=3))
    with pytest.raises(TeacherServerError) as caught:
        client.start([mb], 1.0).attach()
    message = str(caught.value)
    assert message.startswith("distill.teacher_urls: every vLLM server failed") and "\n" not in message
    assert a.url in message and b.url in message and "another-run" in message
    assert mb.teacher_logprobs is None
    client.close()


# a server's reply that is not the log-probs asked for: (rows -> its rows, what the error says)
WRONG_REPLIES = {
    "the position before the start too": (lambda rows: [[-0.125] + r for r in rows],
                                          "6 log-probs for the 5 scored tokens"),
    "a row one short": (lambda rows: [r[:-1] for r in rows], "4 log-probs for the 5 scored"),
    "a sequence missing": (lambda rows: rows[:-1], "rows for"),
    "nan": (lambda rows: [[float("nan")] * len(r) for r in rows], "returned nan for token 0"),
    "-inf": (lambda rows: [r[:-1] + [float("-inf")] for r in rows], "returned -inf for token 4"),
    "positive": (lambda rows: [[5.0] * len(r) for r in rows], "returned 5.0 for token 0"),
    "not a number": (lambda rows: [[None] * len(r) for r in rows], "returned None for token 0"),
}


@pytest.mark.parametrize("wrong", list(WRONG_REPLIES))
def test_a_server_whose_reply_is_not_the_logprobs_asked_for_has_failed(teacher_servers, wrong):
    """A reply with a row longer or shorter than the tokens asked, a sequence missing, a
    value that is not finite, above 0 or not a number: that server's failure (its share
    scored by the other server, the batch right), and with no other server one sentence
    naming the server and what was wrong, nothing attached."""
    teacher, (a, b) = teacher_servers
    a.local.wrong, expected = WRONG_REPLIES[wrong]
    client = served_teacher([a, b])
    mb = pack_samples(make_samples(seed=3))
    client.start([mb], 1.0).attach()
    torch.testing.assert_close(mb.teacher_logprobs.double(), in_process(teacher, mb).double(),
                               rtol=1e-6, atol=1e-6)  # fmt: skip
    router = client.pool.router
    assert not router.servers[0].healthy and expected in router.servers[0].last_error
    client.close()
    alone = served_teacher([a])
    mb = pack_samples(make_samples(seed=3))
    with pytest.raises(TeacherServerError) as caught:
        alone.start([mb], 1.0).attach()
    message = str(caught.value)
    assert message.startswith("distill.teacher_urls: every vLLM server failed: " + a.url)
    assert expected in message and "\n" not in message
    assert mb.teacher_logprobs is None
    alone.close()


def test_a_server_that_failed_once_is_probed_and_serves_the_next_batch(teacher_servers):
    """One failed request marks a server down for that batch only: before the next batch
    it is probed (GET /health), answers, and takes its share again; a second server's
    one-off failure later is the same: the run never runs out of servers by glitches."""
    teacher, (a, b) = teacher_servers
    client = served_teacher([a, b])
    router = client.pool.router
    for batch, (failing, down) in enumerate([(a, 0), (None, None), (b, 1), (None, None)]):
        if failing is not None:
            failing.local.fail_next = 1
        before = len(a.local.scored), len(b.local.scored)
        mb = pack_samples(make_samples(seed=batch))
        client.start([mb], 1.0).attach()
        torch.testing.assert_close(mb.teacher_logprobs.double(),
                                   in_process(teacher, mb).double(), rtol=1e-6, atol=1e-6)  # fmt: skip
        scored = len(a.local.scored) - before[0], len(b.local.scored) - before[1]
        if down is None:  # both in rotation again, both scored
            assert all(s.healthy for s in router.servers) and min(scored) > 0, batch
        else:  # the other one scored the whole batch
            assert not router.servers[down].healthy and scored[1 - down] == 4, batch
    client.close()


def test_a_lone_server_is_waited_for_within_the_timeout_then_one_sentence(teacher_servers):
    """One server failing more requests in a row than its retries: the batch waits for it
    (probing its health in back-off steps) and completes when it scores again; a server
    that does not come back within the patience (distill.teacher_timeout_s) stops the
    batch with one sentence saying so."""
    teacher, (a, _) = teacher_servers
    client = served_teacher([a])
    client.pool.backoff_s = 0.01
    a.local.fail_next = client.pool.max_retries + 3  # down after its retries, then 2 more
    mb = pack_samples(make_samples(seed=5))
    client.start([mb], 1.0).attach()
    torch.testing.assert_close(mb.teacher_logprobs.double(), in_process(teacher, mb).double(),
                               rtol=1e-6, atol=1e-6)  # fmt: skip
    assert a.local.fail_next == 0 and client.pool.router.servers[0].healthy
    client.pool.patience_s = 0.5
    a.close()
    mb = pack_samples(make_samples(seed=6))
    with pytest.raises(TeacherServerError) as caught:
        client.start([mb], 1.0).attach()
    message = str(caught.value)
    assert a.url in message and "none answered within 0.5 s" in message and "\n" not in message
    client.close()


def test_a_server_refuses_a_temperature_it_cannot_score_at(teacher_servers):
    _, servers = teacher_servers
    client = served_teacher(servers)
    with pytest.raises(TeacherServerError, match="scores at temperature 1 only"):
        client.start([pack_samples(make_samples())], 0.7).attach()
    client.close()


# -- checks before anything loads ------------------------------------------------------------


def edited_teacher(tmp_path, name, edit=None):
    directory = tmp_path / name
    shutil.copytree(DEMO_MODEL, directory)
    if edit is not None:
        edit(directory)
    return directory


def swap_two_tokens(directory):
    file = directory / "tokenizer.json"
    data = json.loads(file.read_text())
    vocab = data["model"]["vocab"]
    (a, ia), (b, ib) = sorted(vocab.items(), key=lambda kv: kv[1])[5:7]
    vocab[a], vocab[b] = ib, ia
    file.write_text(json.dumps(data))


def more_rows(directory):
    file = directory / "config.json"
    config = json.loads(file.read_text())
    file.write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 8}))


def check_against(tmp_path, directory, max_model_len=64):
    """check_teacher with the served teacher of `directory` (a fake server reporting it)."""
    server = Served(FakeTeacher(None, max_model_len=max_model_len), tmp_path / "staging",
                    model=str(directory))  # fmt: skip
    try:
        cfg = config_from_dict(tiny_run(tmp_path, distill={"teacher_urls": [server.url]}))
        check_teacher(cfg, check_model_files(cfg.model), 1)
    finally:
        server.close()
    return server.url


def test_a_served_teacher_is_checked_like_a_local_one(tmp_path):
    check_against(tmp_path / "same", edited_teacher(tmp_path, "same"))  # passes
    with pytest.raises(TeacherMismatchError) as caught:
        check_against(tmp_path / "swap", edited_teacher(tmp_path, "swap", swap_two_tokens))
    message = str(caught.value)
    assert "distill.teacher_urls' http://127.0.0.1:" in message and "id 5 is" in message
    with pytest.raises(TeacherMismatchError, match="normalised over all of the teacher's rows"):
        check_against(tmp_path / "rows", edited_teacher(tmp_path, "rows", more_rows))
    with pytest.raises(TeacherMismatchError, match="--max-model-len"):
        check_against(tmp_path / "short", edited_teacher(tmp_path, "short"), max_model_len=8)


def test_a_teacher_server_that_does_not_answer_is_one_sentence(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    url = f"http://127.0.0.1:{port}"
    cfg = config_from_dict(tiny_run(tmp_path, distill={"teacher_urls": [url]}))
    with pytest.raises(TeacherServerError) as caught:
        check_teacher(cfg, check_model_files(cfg.model), 1)
    message = str(caught.value)
    assert message.startswith("distill.teacher_urls: vLLM server " + url) and "\n" not in message
    assert "distill.teacher_urls is right" in message


# -- a run -------------------------------------------------------------------------------------


def test_a_run_with_a_served_teacher_logs_the_local_teachers_metrics(tmp_path):
    """The trainer with distill.teacher_urls (a fake server scoring with the demo teacher
    through transformers): checked before anything loads, asked once per batch, and the
    same metrics as the run that loads the teacher, within the log-probs' rounding."""
    from support.files import read_jsonl
    from support.models import save_demo_teacher
    from transformers import AutoModelForCausalLM

    from leangrpo.train import Trainer

    directory = save_demo_teacher(tmp_path / "teacher")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    server = Served(FakeTeacher(model.eval()), tmp_path / "staging", model=str(directory))
    runs = {}
    try:
        for name, distill in (("local", {"teacher": str(directory)}),
                              ("served", {"teacher_urls": [server.url]})):  # fmt: skip
            sections = {"rewards": {"functions": []}, "distill": distill}
            Trainer(config_from_dict(tiny_run(tmp_path / name, **sections))).train()
            rows = read_jsonl(tmp_path / name / "run" / "metrics.jsonl")
            runs[name] = [r for r in rows if "loss" in r]
    finally:
        server.close()
    assert len(server.local.scored) == 2 * 3 * 4  # 2 batches of 3 prompts x 4 completions
    assert len(runs["local"]) == len(runs["served"]) == 4
    for local, remote in zip(runs["local"], runs["served"]):
        for key in ("loss", "loss/distill/reverse_kl", "grad_norm", "loss/ratio/mean"):
            assert remote[key] == pytest.approx(local[key], rel=1e-4, abs=1e-5), key
