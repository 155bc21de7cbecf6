"""What rules out one copy of the weights (colocated vLLM sharing the policy's tensors,
sharing.py) before vLLM starts, without torch or vLLM: the start-up
(`start_shared_vllm`) and `leangrpo plan` ask the same questions here, so the plan never
counts one copy for a run that keeps two for a reason known in advance.

- The config (`Config.vllm_share_blocker`): parallel shards, quantized serving, QLoRA, hub
  code, a worker in another process, rollout.vllm.dtype against an explicit model.dtype,
  async full fine-tuning.
- rollout.vllm.dtype against the trainer's dtype as it resolves it (model.dtype 'auto':
  float32 on CPU; on a GPU bfloat16 or float16, which only the device tells).
- The checkpoint: vLLM's tensors are checked against its safetensors before the policy
  uses them, so a model held only as pytorch_model.bin keeps two copies (a hub id whose
  files are not cached yet is not known here: vLLM downloads them, and the start-up
  checks then).

Left to the start-up, once vLLM runs (views.py, sharing.py): the installed vLLM's
version, its engine core and worker in this process, and a layout the views can express.
"""

from __future__ import annotations

from typing import Any

from leangrpo.model.files import local_safetensors


def share_blocker(cfg: Any, trainer_dtype: str | None) -> tuple[str, str] | None:
    """(why, what would allow it) when sharing is ruled out before vLLM starts; None when
    nothing known here rules it out. `trainer_dtype`: the policy's dtype name ('float32',
    'bfloat16', 'float16'), None where it is not known (`trainer_dtype_name`)."""
    blocker = cfg.vllm_share_blocker()
    if blocker is not None:
        return blocker
    v = cfg.rollout.vllm
    if v.mode != "colocate" or cfg.rollout.engine != "vllm":
        return None
    wanted = v.weight_dtype()
    if wanted is not None and trainer_dtype is not None and wanted != trainer_dtype:
        return (
            f"rollout.vllm.dtype ({v.dtype}) differs from the trainer's dtype ({trainer_dtype})",
            "rollout.vllm.dtype: auto",
        )
    if local_safetensors(cfg.model) == []:
        return (
            f"{cfg.model.name_or_path} holds no .safetensors checkpoint to check vLLM's tensors against",
            "the model saved as safetensors (save_pretrained(path, safe_serialization=True))",
        )
    return None


def trainer_dtype_name(model_dtype: str, device_type: str) -> str | None:
    """model.dtype as the trainer resolves it (model/policy.py `resolve_dtype`) on a device
    of `device_type`, without torch; None for 'auto' on a GPU (bfloat16 where supported,
    else float16: only the device tells)."""
    if model_dtype != "auto":
        return model_dtype
    return "float32" if device_type == "cpu" else None
