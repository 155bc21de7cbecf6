"""A served distillation teacher on real `leangrpo serve` processes (vLLM's CPU build;
`.venv-vllm`, like tests/rollout/test_vllm_servers.py): vLLM's prompt log-probs of the
sampled tokens equal the in-process teacher's packed pass (plain, shared prefix,
multi-turn) within the engine's usual tolerance, and the checks before anything loads
pass against the real server; a short distillation run with the served teacher logs the
metrics of the same run with the teacher in the trainer; one server SIGKILLed while it
scores: its share is scored by the other, the batch complete and right; both dead: one
sentence. The rules on fake servers: test_served.py.

    .venv-vllm/bin/pytest -m vllm tests/distill/test_served_vllm.py
"""

from __future__ import annotations

import secrets
import threading
import time

import pytest
import torch
from support.configs import tiny_run
from support.files import read_jsonl
from support.models import save_demo_teacher
from support.processes import kill_tree

from leangrpo.config import config_from_dict
from leangrpo.contracts import Completion, Prompt, RolloutSample, SamplingParams, Trajectory
from leangrpo.distill.check import TeacherServerError, check_teacher
from leangrpo.distill.served import ServedTeacher
from leangrpo.distill.teacher import load_teacher, teacher_logprobs
from leangrpo.model.files import check_model_files
from leangrpo.rollout.vllm.client import start_local_server
from leangrpo.rollout.vllm.settings import VLLMSettings
from leangrpo.train import Trainer
from leangrpo.train.packing import pack_samples

VOCAB = 32  # the demo model's
# the engine's usual tolerance (tests/rollout/test_vllm_servers.py: a mean absolute gap
# under 1e-3 between vLLM's log-probs and the trainer's), here per token
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """Two `leangrpo serve` processes of the demo teacher (started together), its
    directory, their URLs, processes and token (also in a file, for the config)."""
    root = tmp_path_factory.mktemp("served_teacher")
    directory = save_demo_teacher(root / "teacher")
    token = secrets.token_urlsafe(32)
    (root / "token").write_text(token)
    settings = VLLMSettings(
        mode="server",
        dtype="float32",
        enforce_eager=True,
        engine_kwargs={"distributed_executor_backend": "uni", "kv_cache_memory_bytes": 64 << 20},
    )
    started: list = [None, None]

    def start(i: int) -> None:
        started[i] = start_local_server(str(directory), settings, token=token,
                                        startup_timeout_s=900)  # fmt: skip

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert all(started), "a server did not start (see its log above)"
        yield directory, [url for _, url in started], [p for p, _ in started], root / "token"
    finally:
        for entry in started:
            if entry is not None:
                kill_tree(entry[0].pid)


def samples(seed: int, groups: int = 3, shared: bool = False) -> list[RolloutSample]:
    """Groups of two: a single-turn sample and a multi-turn one (a model turn, an
    environment reply, a model turn), of ids the demo vocabulary holds."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(2, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    out = []
    for group in range(groups):
        prompt = Prompt(group, "", ids(6 + group))
        for k in range(2):
            segments = [(7, True)] if k == 0 else [(3, True), (4, False), (5, True)]
            trajectory = None if k == 0 else Trajectory(segments, [0, 0], [])
            model = sum(n for n, m in segments if m)
            completion = Completion(ids(sum(n for n, _ in segments)), "", [-1.0] * model,
                                    "stop", 0, trajectory)  # fmt: skip
            own = prompt if shared else Prompt(group, "", ids(6 + group))
            out.append(RolloutSample(group, own, completion, advantage=0.5 - k))
    return out


def distill_config(tmp_path, distill: dict, **sections):
    return config_from_dict(
        tiny_run(tmp_path, distill=distill, rewards={"functions": []}, **sections)
    )


def served(urls, token_file) -> dict:
    return {"teacher_urls": urls, "teacher_token_file": str(token_file), "teacher_timeout_s": 300}


@pytest.mark.vllm
@pytest.mark.parametrize("shared", [False, True])
def test_vllm_prompt_logprobs_equal_the_in_process_teachers(teachers, tmp_path, shared):
    directory, urls, _, token_file = teachers
    cfg = distill_config(tmp_path, served(urls, token_file))
    check_teacher(cfg, check_model_files(cfg.model), 1)  # the real servers' reports pass
    local = load_teacher(distill_config(tmp_path, {"teacher": str(directory)}), torch.device("cpu"))
    batches = [pack_samples(samples(seed, shared=shared), shared_prefix=shared) for seed in (0, 1)]
    client = ServedTeacher(cfg.distill)
    client.start(batches, 1.0).attach()
    for mb in batches:
        want = teacher_logprobs(local, mb, SamplingParams(temperature=1.0), cfg.logprobs)
        gap = (mb.teacher_logprobs.double() - want.double()).abs()
        assert gap.max().item() < TOLERANCE, gap.max().item()
    assert all(s.served > 0 for s in client.pool.router.servers)  # spread over both
    client.close()


@pytest.mark.vllm
def test_a_run_with_the_served_teacher_logs_the_in_process_runs_metrics(teachers, tmp_path):
    """Pure distillation, 4 steps (mu 2): the same samples, losses and reverse KL as the
    run whose teacher is loaded in the trainer, within the log-probs' rounding."""
    directory, urls, _, token_file = teachers
    runs = {}
    for name, distill in (("local", {"teacher": str(directory)}),
                          ("served", served(urls, token_file))):  # fmt: skip
        cfg = distill_config(tmp_path / name, distill)
        Trainer(cfg).train()
        rows = read_jsonl(tmp_path / name / "run" / "metrics.jsonl")
        runs[name] = [r for r in rows if "loss" in r]
    assert len(runs["local"]) == len(runs["served"]) == 4
    keys = ("loss", "loss/distill/reverse_kl", "grad_norm", "loss/ratio/mean",
            "completions/mean_length")  # fmt: skip
    for local, remote in zip(runs["local"], runs["served"]):
        for key in (k for k in keys if k in local):
            assert remote[key] == pytest.approx(local[key], rel=1e-3, abs=1e-4), key


@pytest.mark.vllm
def test_a_server_killed_while_scoring_hands_its_share_over_and_none_left_is_one_sentence(
    teachers, tmp_path
):
    directory, urls, processes, token_file = teachers

    cfg = distill_config(tmp_path, served(urls, token_file))
    local = load_teacher(distill_config(tmp_path, {"teacher": str(directory)}), torch.device("cpu"))
    client = ServedTeacher(cfg.distill)
    big = [pack_samples(samples(seed, groups=40)) for seed in range(20)]
    pending = client.start(big, 1.0)
    deadline = time.monotonic() + 300  # a hang guard
    while client.pool.request(urls[1], "GET", "/health")["in_flight"] < 1:
        assert time.monotonic() < deadline, "no request reached server 1"
        time.sleep(0.005)
    kill_tree(processes[1].pid)
    pending.attach()
    router = client.pool.router
    assert router.retries >= 1 and not router.servers[1].healthy
    for mb in big:
        want = teacher_logprobs(local, mb, SamplingParams(temperature=1.0), cfg.logprobs)
        assert (mb.teacher_logprobs.double() - want.double()).abs().max().item() < TOLERANCE
    kill_tree(processes[0].pid)
    with pytest.raises(TeacherServerError) as caught:
        client.start([pack_samples(samples(99))], 1.0).attach()
    message = str(caught.value)
    assert message.startswith("distill.teacher_urls: every vLLM server failed")
    assert "\n" not in message and urls[0] in message and urls[1] in message
    client.close()
