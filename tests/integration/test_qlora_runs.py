"""QLoRA training runs on the demo model quantized to 4 bits (bitsandbytes, CPU).

- exact resume: a run killed right after its step-2 checkpoint and resumed ends bitwise
  equal to the straight run (the checkpoint holds the adapters and the optimizer; the
  base is loaded and re-quantized again, deterministically);
- torchrun + FSDP2 on 2 CPU ranks (gloo): the uint8 4-bit storage is sharded like any
  parameter (FSDP2 never casts a non-float parameter, and bitsandbytes re-attaches the
  quantization state, which stays on each module, replicated, when the gathered weight
  comes back): the run ends with the parameters of one process, and a resume from its
  sharded checkpoint ends bitwise equal to it (slow).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from support.configs import demo_config, tiny_run

from leangrpo.config import config_from_dict
from leangrpo.train import Trainer

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None,
    reason="QLoRA needs bitsandbytes: pip install 'leangrpo[qlora]'",
)


class _Interrupt(Exception):
    pass


class StopAfterTwo(Trainer):
    """A run killed right after its checkpoint at step 2."""

    def on_step_end(self, metrics, batch):
        super().on_step_end(metrics, batch)
        if self.step == 2:
            raise _Interrupt


def adapters(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.policy.model.named_parameters() if p.requires_grad}


def qlora(cfg: dict, quant: str = "nf4") -> dict:
    cfg["model"]["quantization"] = quant
    cfg.setdefault("lora", {}).update(enabled=True, r=4, alpha=8)
    return cfg


def test_a_qlora_run_resumes_exactly(tmp_path):
    """4 steps, mu 2 (old log-prob passes), beta 0.04 (the reference: adapters off)."""
    loss = {"mu": 2, "beta": 0.04}
    straight = Trainer(config_from_dict(qlora(tiny_run(tmp_path / "a", loss=loss))))
    initial = adapters(straight)
    straight.train()
    expected = adapters(straight)
    assert max(float((expected[k] - initial[k]).abs().max()) for k in initial) > 1e-4
    final = tmp_path / "a" / "run" / "final"
    note = json.loads((final / "quantization_config.json").read_text())
    assert note["bnb_4bit_quant_type"] == "nf4" and (final / "adapter_config.json").is_file()

    resumable = qlora(tiny_run(tmp_path / "b", loss=loss, checkpoint={"every_steps": 2}))
    with pytest.raises(_Interrupt):
        StopAfterTwo(config_from_dict(resumable)).train()
    saved = tmp_path / "b" / "run" / "checkpoints" / "step-2"
    held = [n for n in load_file(next(saved.rglob("*.safetensors"))) if "lora_" not in n]
    assert held == []  # the checkpoint holds the adapters only, never the 4-bit base
    resumed = Trainer(config_from_dict(resumable))
    assert resumed.step == 2
    resumed.train()
    got = adapters(resumed)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_the_final_adapter_of_a_bfloat16_run_reloads_to_the_trained_policy(tmp_path, monkeypatch):
    """a2_final_adapter.py and a2b_final_adapter_dtype.py: final/ loaded by hand (the base
    with the quantization note, then the adapter) repacked every 4-bit layer for
    bitsandbytes' CPU bf16 kernel (on a CPU with AVX512-BF16; switched on here for any
    CPU) and built a float32 base for a bfloat16 run. `leangrpo.model.load_final` gives
    the trained policy's logits."""
    from leangrpo.model import load_final

    cfg = qlora(tiny_run(tmp_path / "bf16", run={"max_steps": 2}))
    cfg["model"]["dtype"] = "bfloat16"
    trainer = Trainer(config_from_dict(cfg))
    trainer.train()
    ids = torch.tensor([trainer.policy.tokenizer("12+34=46")["input_ids"]])
    policy = trainer.policy.model.eval()
    policy.set_attn_implementation("sdpa")
    with torch.no_grad():
        want = policy(input_ids=ids, use_cache=False).logits.float()
    modules = pytest.importorskip("bitsandbytes.nn.modules")
    monkeypatch.setattr(modules, "has_avx512bf16", lambda: True)  # the repack, on any CPU
    model = load_final(tmp_path / "bf16" / "run" / "final")
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits.float()
    assert (got - want).abs().max().item() <= 2e-2  # bfloat16 logits; the defects: 0.57, 2.8
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16


# -- torchrun ---------------------------------------------------------------------------------


def torchrun(cfg: dict, limit_s: float = 900.0) -> str:
    """`torchrun --standalone --nproc_per_node 2 -m leangrpo train`; its log (exit 0)."""
    path = Path(cfg["run"]["output_dir"]).with_suffix(".yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "-m", "leangrpo", "train", str(path)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        log, _ = proc.communicate(timeout=limit_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, log[-4000:]
    return log


@pytest.mark.slow
def test_two_ranks_train_a_4_bit_base_like_one_process(tmp_path):
    """The demo's LoRA async run (staleness 0) on an nf4 base: 2 ranks vs 1 process, the
    same global batches, sharded checkpoints at steps 3, 6 and 9."""
    two = qlora(demo_config(tmp_path / "two", "lora_async", 2))
    one = qlora(demo_config(tmp_path / "one", "lora_async", 1))
    log = torchrun(two)
    Trainer(config_from_dict(one)).train()
    got = load_file(tmp_path / "two" / "final" / "adapter_model.safetensors")
    want = load_file(tmp_path / "one" / "final" / "adapter_model.safetensors")
    assert sorted(got) == sorted(want)
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert diff <= 1e-5, diff
    assert max(float(v.abs().max()) for k, v in want.items() if "lora_B" in k) > 1e-3
    assert (tmp_path / "two" / "final" / "quantization_config.json").is_file()
    assert "Traceback" not in log
    # resumed from the sharded step-6 checkpoint, on a base quantized again: bitwise equal
    again = qlora(demo_config(tmp_path / "again", "lora_async", 2))
    again["run"]["resume"] = str(tmp_path / "two" / "checkpoints" / "step-6")
    assert "resumed from" in torchrun(again)
    resumed = load_file(tmp_path / "again" / "final" / "adapter_model.safetensors")
    assert all(torch.equal(resumed[k], got[k]) for k in got)
