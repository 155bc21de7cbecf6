"""The teacher's checks before anything loads, its loading (full precision and quantized),
the config rules of the distill section, and a distillation run's exact resume inside a
batch (the teacher's log-probs kept with the batch in progress)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from support.configs import DEMO_MODEL, tiny_run
from support.models import save_demo_teacher
from support.steps import policy_and_optimizer, step_config, step_samples

from leangrpo.config import ConfigError, config_from_dict
from leangrpo.contracts import RolloutBatch
from leangrpo.distill.check import TeacherMismatchError, check_teacher, first_difference
from leangrpo.model.files import check_model_files
from leangrpo.train import Trainer
from leangrpo.train.inflight import BatchInProgress
from leangrpo.train.planning import plan_steps


def demo_teacher(tmp_path: Path, seed: int = 7) -> Path:
    return save_demo_teacher(tmp_path / f"teacher-{seed}", seed)


def edit_tokenizer(directory: Path, edit) -> None:
    file = directory / "tokenizer.json"
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data))


def distill_config(tmp_path: Path, teacher: Path, **sections):
    return config_from_dict(
        tiny_run(
            tmp_path, distill={"teacher": str(teacher), **sections.pop("distill", {})}, **sections
        )
    )


# -- before anything loads ------------------------------------------------------------------


def test_a_teacher_of_another_tokenizer_is_refused_naming_the_first_differing_token(tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(DEMO_MODEL, teacher)
    vocab = json.loads((teacher / "tokenizer.json").read_text())["model"]["vocab"]
    (a, ia), (b, ib) = sorted(vocab.items(), key=lambda kv: kv[1])[5:7]

    def swap(data):
        data["model"]["vocab"][a], data["model"]["vocab"][b] = ib, ia

    edit_tokenizer(teacher, swap)
    cfg = distill_config(tmp_path, teacher)
    with pytest.raises(TeacherMismatchError) as caught:
        check_teacher(cfg, check_model_files(cfg.model), 1)
    message = str(caught.value)
    assert f"id {ia} is {a!r} for the policy and {b!r} for the teacher" in message
    assert message.count(".") >= 1 and "\n" not in message


def test_an_added_token_counts_and_the_same_tokenizer_passes(tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(DEMO_MODEL, teacher)
    cfg = distill_config(tmp_path, teacher)
    check_teacher(cfg, check_model_files(cfg.model), 1)  # same files: passes

    def add(data):
        top = max(data["model"]["vocab"].values()) + 1
        data.setdefault("added_tokens", []).append(
            {"id": top, "content": "<extra>", "special": True, "single_word": False,
             "lstrip": False, "rstrip": False, "normalized": False}
        )  # fmt: skip

    edit_tokenizer(teacher, add)
    with pytest.raises(TeacherMismatchError, match="'<extra>' for the teacher"):
        check_teacher(cfg, check_model_files(cfg.model), 1)


def edit_json(file: Path, **values) -> None:
    file.write_text(json.dumps({**json.loads(file.read_text()), **values}))


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (
            {"generation_config.json": {"eos_token_id": 5}, "config.json": {"eos_token_id": 5}},
            "another eos token id than the policy .*: 1 for the policy and 5 for the teacher",
        ),
        ({"config.json": {"bos_token_id": 3}}, "another bos token id .*none for the policy and 3"),
        ({"tokenizer_config.json": {"pad_token": "<unk>"}}, "another pad token id .*: 0 for the"),
    ],
)
def test_a_teacher_ending_beginning_or_padding_with_other_ids_is_refused(
    tmp_path, files, expected
):
    """Same id -> token map, other special ids: the teacher would read the policy's end of
    sequence as an ordinary token (one sentence naming which id differs)."""
    teacher = tmp_path / "teacher"
    shutil.copytree(DEMO_MODEL, teacher)
    for name, values in files.items():
        edit_json(teacher / name, **values)
    cfg = distill_config(tmp_path, teacher)
    with pytest.raises(TeacherMismatchError, match=expected) as caught:
        check_teacher(cfg, check_model_files(cfg.model), 1)
    assert "\n" not in str(caught.value)


def test_a_teacher_of_another_chat_template_is_refused_when_prompts_use_it(tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(DEMO_MODEL, teacher)
    edit_json(teacher / "tokenizer_config.json", chat_template="{{ messages[0]['content'] }}!")
    templated = distill_config(tmp_path, teacher, data={"chat_template": True})
    with pytest.raises(TeacherMismatchError, match="another chat template than the policy"):
        check_teacher(templated, check_model_files(templated.model), 1)
    raw = distill_config(tmp_path, teacher)  # raw prompt text: no template is used
    assert raw.data.chat_template is False
    check_teacher(raw, check_model_files(raw.model), 1)


def test_a_teacher_with_fewer_vocabulary_rows_is_refused(tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(DEMO_MODEL, teacher)
    config = json.loads((teacher / "config.json").read_text())
    rows = config["vocab_size"]
    policy = tmp_path / "policy"
    shutil.copytree(DEMO_MODEL, policy)
    (policy / "config.json").write_text(json.dumps({**config, "vocab_size": rows + 8}))
    cfg = distill_config(tmp_path, teacher, model={"name_or_path": str(policy)})
    with pytest.raises(TeacherMismatchError, match=f"has {rows} vocabulary rows"):
        check_teacher(cfg, check_model_files(cfg.model), 1)


def test_a_teacher_of_a_shorter_context_than_the_runs_sequences_is_refused(tmp_path):
    """The demo's context is 64 positions, so prompts may take 64 - max_new_tokens and
    sequences reach 64 tokens: a 32-position teacher is refused (preflight), unless
    data.max_prompt_tokens keeps the sequences within its 32."""
    from leangrpo.preflight import check_inputs

    teacher = tmp_path / "teacher"
    shutil.copytree(DEMO_MODEL, teacher)
    config = json.loads((teacher / "config.json").read_text())
    (teacher / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32}))
    cfg = distill_config(tmp_path, teacher)
    with pytest.raises(TeacherMismatchError) as caught:
        check_inputs(cfg, warn=False)
    message = str(caught.value)
    assert "attends to 32 positions" in message and "reach 64 tokens" in message
    assert "data.max_prompt_tokens to at most 26" in message and "\n" not in message
    with pytest.raises(TeacherMismatchError, match="the policy's context of 64 positions"):
        check_teacher(cfg, check_model_files(cfg.model), 1)  # no prompt limit given
    check_inputs(distill_config(tmp_path, teacher, data={"max_prompt_tokens": 26}), warn=False)


def test_a_teacher_whose_heads_the_context_group_cannot_split_is_refused(tmp_path, monkeypatch):
    """context_parallel_size 2 splits the demo policy's 2 heads, not a 3-head teacher's:
    preflight refuses it from config.json before anything loads, naming distill.teacher,
    and the torchrun set-up checks the loaded teacher's attention as it checks the
    policy's (shard_on_mesh, before any sharding)."""
    from types import SimpleNamespace

    from support.models import make_tiny_model

    from leangrpo.distributed.mesh import ContextParallelError, ParallelMesh
    from leangrpo.distributed.strategy import shard_on_mesh
    from leangrpo.ops.attention.adapter import enable_packed_attention
    from leangrpo.preflight import check_inputs

    teacher = tmp_path / "teacher"
    shutil.copytree(DEMO_MODEL, teacher)
    config = json.loads((teacher / "config.json").read_text())
    assert config["num_attention_heads"] % 2 == 0  # the policy splits
    three = {**config, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16}
    (teacher / "config.json").write_text(json.dumps(three))
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = distill_config(tmp_path, teacher, distributed={"context_parallel_size": 2})
    with pytest.raises(ConfigError) as caught:
        check_inputs(cfg, warn=False)
    message = str(caught.value)
    assert "teacher's 3 attention heads" in message and "distill.teacher" in message
    assert "\n" not in message

    def loaded(heads: int):
        model = make_tiny_model("qwen2", num_attention_heads=heads, num_key_value_heads=1)
        enable_packed_attention(model, "sdpa_segments")
        return model

    policy = SimpleNamespace(model=loaded(4), teacher=loaded(3))
    with pytest.raises(ContextParallelError, match=r"\(distill.teacher\) cannot be context"):
        shard_on_mesh(policy, dist_cfg=None, ctx=SimpleNamespace(rank=0),
                      mesh=ParallelMesh(1, 2, 0, 0), engine_copy=False)  # fmt: skip


def test_a_missing_teacher_is_named_as_distill_teacher(tmp_path):
    cfg = distill_config(tmp_path, tmp_path / "nowhere")
    with pytest.raises(TeacherMismatchError, match="distill.teacher"):
        check_teacher(cfg, check_model_files(cfg.model), 1)


def test_first_difference_names_a_missing_id():
    assert first_difference({0: "a", 1: "b"}, {0: "a", 1: "b"}) is None
    assert first_difference({0: "a", 1: "b"}, {0: "a"}) == (
        "id 1 is 'b' for the policy and absent for the teacher"
    )


def test_the_checks_import_no_torch():
    import subprocess

    code = (
        "import sys; import leangrpo.distill.check, leangrpo.preflight; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# -- config rules -----------------------------------------------------------------------------


def test_pure_distillation_needs_no_reward_function(tmp_path):
    cfg = distill_config(tmp_path, tmp_path, rewards={"functions": []})
    assert cfg.rewards.functions == [] and cfg.distill.objective == "sampled"
    with pytest.raises(ConfigError, match="at least 1 item"):
        config_from_dict(tiny_run(tmp_path, rewards={"functions": []}))


def test_pure_distillation_alone_may_sample_one_completion_per_prompt(tmp_path):
    one = {"rollout": {"num_generations": 1, "prompts_per_batch": 3, "max_new_tokens": 6}}
    cfg = distill_config(tmp_path, tmp_path, rewards={"functions": []}, **one)
    assert cfg.rollout.num_generations == 1
    weighted = {"functions": [{"name": "math", "weight": 0.0}, {"name": "format", "weight": 0.5}]}
    unweighted = {"functions": [{"name": "math", "weight": 0.0}]}
    assert distill_config(tmp_path, tmp_path, rewards=unweighted, **one).rewards.functions
    for refused in (
        lambda: distill_config(tmp_path, tmp_path, rewards=weighted, **one),  # mixed: GRPO's part
        lambda: config_from_dict(tiny_run(tmp_path, **one)),  # GRPO alone
    ):
        with pytest.raises(ConfigError, match=r"'rollout.num_generations' = 1 .* pure distillation"):
            refused()


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"rollout": {"top_k": 5}}, r"rollout.top_k \(5\)"),
        ({"rollout": {"min_p": 0.1}}, "rollout.min_p"),
        (
            {"rewards": {"functions": []}, "pipeline": {"reroll": {"enabled": True}}},
            "pipeline.reroll.enabled",
        ),
        (
            {"rewards": {"functions": []}, "pipeline": {"replay": {"enabled": True}}},
            "pipeline.replay.enabled",
        ),
        # mixed distillation (a weighted reward): flat groups still carry the teacher's signal
        ({"pipeline": {"reroll": {"enabled": True}}}, "pipeline.reroll.enabled"),
        ({"pipeline": {"replay": {"enabled": True}}}, "pipeline.replay.enabled"),
        ({"distill": {"weight": 0}}, "distill.weight"),
        ({"distill": {"discount": 1.5}}, "distill.discount"),
        ({"distill": {"teacher_quantization": "fp4"}}, "distill.teacher_quantization"),
        ({"distill": {"objective": "jsd", "discount": 0.5}}, r"distill.discount \(0.5\)"),
        ({"distill": {"jsd_beta": 0.5}}, "distill.jsd_beta only applies"),
        ({"distill": {"objective": "jsd", "jsd_beta": 1.5}}, "distill.jsd_beta"),
        ({"distill": {"objective": "kl"}}, "distill.objective"),
    ],
)
def test_the_distill_section_refuses_what_it_cannot_do(tmp_path, sections, expected):
    with pytest.raises(ConfigError, match=expected):
        distill_config(tmp_path, tmp_path, **sections)


# -- loading --------------------------------------------------------------------------------


def test_the_teacher_loads_frozen_and_a_quantized_one_scores_close(tmp_path):
    pytest.importorskip("bitsandbytes")
    from leangrpo.distill.teacher import load_teacher, teacher_logprobs
    from leangrpo.train.packing import pack_samples

    teacher_dir = demo_teacher(tmp_path)
    cfg = distill_config(tmp_path, teacher_dir)
    full = load_teacher(cfg, torch.device("cpu"))
    assert not full.training and not any(p.requires_grad for p in full.parameters())
    quantized = load_teacher(
        distill_config(tmp_path, teacher_dir, distill={"teacher_quantization": "nf4"}),
        torch.device("cpu"),
    )
    import bitsandbytes as bnb

    assert any(isinstance(m, bnb.nn.Linear4bit) for m in quantized.modules())
    samples = step_samples([1.0, -1.0, 0.5, -0.5])
    rows = full.config.vocab_size  # the demo's vocabulary is smaller than step_samples' ids
    for s in samples:
        s.prompt.ids = [i % rows for i in s.prompt.ids]
        s.completion.ids = [i % rows for i in s.completion.ids]
    mb = pack_samples(samples)
    sampling = cfg.rollout.sampling_params()
    a = teacher_logprobs(full, mb, sampling, cfg.logprobs)
    b = teacher_logprobs(quantized, mb, sampling, cfg.logprobs)
    assert torch.isfinite(b).all() and not torch.equal(a, b)
    # what transformers + bitsandbytes give for the same nf4 load, one plain forward each
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from leangrpo.model.quantization import prepare_quantized

    bnb_cfg = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )  # fmt: skip
    plain = AutoModelForCausalLM.from_pretrained(
        teacher_dir, dtype=torch.float32, quantization_config=bnb_cfg, device_map={"": "cpu"}
    )
    prepare_quantized(plain, torch.device("cpu"))
    want = []
    with torch.no_grad():
        for s in samples:
            logits = plain(torch.tensor([s.prompt.ids + s.completion.ids])).logits[0]
            logp = torch.log_softmax(logits.float() / sampling.temperature, -1)
            p = len(s.prompt.ids)
            want.append(logp[p - 1 : -1].gather(1, torch.tensor(s.completion.ids)[:, None])[:, 0])
    torch.testing.assert_close(b, torch.cat(want), rtol=1e-4, atol=1e-4)


def test_teacher_rows_past_the_policys_vocabulary_do_not_shift_its_logprobs(tmp_path):
    """A teacher with 16 more vocabulary rows than the policy, trained ones (copies of
    real rows, so they would take mass), scores exactly as the same teacher without them:
    its log-softmax runs over the policy's rows only."""
    from transformers import AutoModelForCausalLM

    from leangrpo.distill.teacher import load_teacher, teacher_logprobs
    from leangrpo.train.packing import pack_samples

    same = demo_teacher(tmp_path)
    wide = tmp_path / "wide"
    shutil.copytree(same, wide)
    model = AutoModelForCausalLM.from_pretrained(same, dtype=torch.float32)
    rows = model.config.vocab_size
    model.resize_token_embeddings(rows + 16, mean_resizing=False)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[rows:] = head[2:18]
    model.save_pretrained(wide)
    samples = step_samples([1.0, -1.0])
    for s in samples:
        s.prompt.ids = [i % rows for i in s.prompt.ids]
        s.completion.ids = [i % rows for i in s.completion.ids]
    mb = pack_samples(samples)
    scored, kept = [], []
    for teacher in (same, wide):
        cfg = distill_config(tmp_path, teacher)
        check_teacher(cfg, check_model_files(cfg.model), 1)  # more rows pass the check
        loaded = load_teacher(cfg, torch.device("cpu"))
        kept.append(loaded.get_output_embeddings().weight.shape[0])
        scored.append(teacher_logprobs(loaded, mb, cfg.rollout.sampling_params(), cfg.logprobs))
    torch.testing.assert_close(scored[1], scored[0], rtol=0, atol=1e-6)
    assert kept == [rows, rows]


def test_a_teacher_staged_in_host_memory_is_probed_there_for_the_devices_backend(monkeypatch):
    """Under torchrun the teacher is probed in host memory before FSDP moves it to the
    GPU: the backend stays the one chosen for the GPU (here a flash kernel, which cannot
    run on the CPU), and the probe runs with a kernel that runs where the model is."""
    from support.models import make_tiny_model

    from leangrpo.ops.attention import adapter

    real = adapter.register_packed_attention

    def register(backend="auto", device_type=None):  # as on a GPU: flash_varlen chosen
        assert device_type == "cuda"
        name = real(backend, "cpu")
        adapter._STATE.backend = "flash_varlen"
        return name

    monkeypatch.setattr(adapter._STATE, "backend", adapter._STATE.backend)  # restored after
    monkeypatch.setattr(adapter, "register_packed_attention", register)
    model = make_tiny_model(  # bf16: what a GPU run loads, which flash_varlen takes
        "qwen2", num_attention_heads=4, num_key_value_heads=2, dtype=torch.bfloat16
    )
    assert adapter.enable_packed_attention(model, "auto", "cuda") == "flash_varlen"
    support = adapter.packed_support(model)
    assert support.packed_kwargs and not support.padded_view
    assert support.context_layers == model.config.num_hidden_layers


# -- resume ---------------------------------------------------------------------------------


def test_the_teacher_logprobs_are_kept_with_the_batch_in_progress():
    policy, _ = policy_and_optimizer()
    cfg = step_config(train={"steps_per_generation": 2})
    samples = step_samples([1.0, -1.0, 0.5, -0.5, 0.25, -0.25])
    for s in samples:
        s.reward = s.advantage
    steps = plan_steps(samples, cfg, policy)
    for mb in (mb for step in steps for mb in step.micro_batches):
        mb.teacher_logprobs = torch.randn(mb.num_completion_tokens)
    work = BatchInProgress(RolloutBatch(samples, 2), steps, iterations=2)
    work.take()
    resumed = BatchInProgress.from_state(work.state_dict(), cfg, policy)
    for old, new in zip(steps, resumed.steps):
        for a, b in zip(old.micro_batches, new.micro_batches):
            assert torch.equal(a.teacher_logprobs, b.teacher_logprobs)


class _Interrupt(Exception):
    pass


class StopAt(Trainer):
    stop_at = 3

    def on_step_end(self, metrics, batch):
        super().on_step_end(metrics, batch)
        if self.step == self.stop_at:
            raise _Interrupt


def trained(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.policy.model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["sampled", "jsd"])
def test_a_distillation_run_resumes_bitwise_inside_a_batch(tmp_path, objective):
    """mu 2: step 3 is the first iteration of the second batch; a crash there resumes
    with the batch's saved teacher (and old) log-probs, never recomputed (jsd: the
    teacher's forward runs in each step, nothing of it is saved), and ends with exactly
    the weights of the run that went straight through."""
    teacher = demo_teacher(tmp_path)
    distill = {"discount": 0.5} if objective == "sampled" else {"objective": "jsd", "jsd_beta": 0.5}
    sections = dict(
        rewards={"functions": []},
        distill=distill,
        checkpoint={"every_steps": 1, "keep_last": 2, "save_final_model": False},
        train={"lr_scheduler": "constant", "micro_batch_tokens": 40},
    )
    straight = Trainer(distill_config(tmp_path / "a", teacher, **sections))
    before = trained(straight)
    straight.train()
    moved = max((trained(straight)[n] - before[n]).abs().max().item() for n in before)
    assert moved > 1e-4
    cfg = distill_config(tmp_path / "b", teacher, **sections)
    with pytest.raises(_Interrupt):
        StopAt(cfg).train()
    resumed = Trainer(cfg)
    assert resumed.step == 3 and resumed.inflight is not None and resumed.inflight.done == 1
    saved = resumed.inflight.steps[0].micro_batches[0].teacher_logprobs
    assert (saved is not None) == (objective == "sampled")
    resumed.train()
    final, want = trained(resumed), trained(straight)
    assert all(torch.equal(final[n], want[n]) for n in want)


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["sampled", "jsd"])
def test_pure_distillation_trains_on_groups_of_one(tmp_path, objective):
    """rollout.num_generations 1: every group is one completion (no GRPO baseline, the
    reward advantage 0), and the teacher's signal alone moves the weights, on every
    completion of the batch."""
    distill = {"objective": objective} if objective == "jsd" else {}
    cfg = distill_config(
        tmp_path, demo_teacher(tmp_path), distill=distill, rewards={"functions": []},
        rollout={"num_generations": 1, "prompts_per_batch": 5, "max_new_tokens": 6},
        loss={"mu": 1}, checkpoint={"every_steps": 0, "save_final_model": False},
        run={"output_dir": str(tmp_path / "run"), "seed": 3, "max_steps": 2, "device": "cpu"},
    )  # fmt: skip
    trainer = Trainer(cfg)
    before = trained(trainer)
    trainer.train()
    after = trained(trainer)
    assert max((after[n] - before[n]).abs().max().item() for n in before) > 1e-4
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss/sequences" in r]
    assert [r["loss/sequences"] for r in steps] == [5.0, 5.0]
    signal = "loss/distill/jsd" if objective == "jsd" else "loss/distill/reverse_kl"
    assert all(r[signal] != 0.0 for r in steps)
