"""What the trajectories of a batch did, as flat metrics (`multiturn/*`, `eval/multiturn/*`).

Per trajectory means unless the name says otherwise: `turns` (and `turns_max`),
`tool_calls`, `tool_errors`, `parse_errors`, `tool_truncated` (results cut to
environment.max_tool_result_chars), per tool `tool_calls/<tool>` and `tool_errors/<tool>`,
per sandbox limit a tool call reached `tool_limit/<kind>` (timeout, cpu, memory, output,
process), `model_tokens`, `env_tokens`, `turn_<k>_length` (model tokens of
turn k, over the trajectories that reached it); `env_errors` counts the trajectories an
environment (or the rendering) failed, `env_s` sums the seconds the environments took,
`finish/<reason>` is the fraction that ended so, and `env/<name>` is the mean over the
trajectories that reported it of an environment's own metric (itself the mean of its
reports within the trajectory). Single-turn samples give nothing.
"""

from __future__ import annotations

from collections import defaultdict

from leangrpo.contracts import RolloutSample

COUNTED = ("tool_calls", "tool_errors", "parse_errors", "tool_truncated", "model_tokens", "env_tokens")
PER_TOOL = ("tool_calls/", "tool_errors/", "tool_limit/")
FINISH_REASONS = ("stop", "length", "max_turns", "error")


def trajectory_metrics(samples: list[RolloutSample], prefix: str = "multiturn") -> dict[str, float]:
    trajectories = [s for s in samples if s.completion.trajectory is not None]
    if not trajectories:
        return {}
    n = len(trajectories)
    stats = [s.completion.trajectory.stats for s in trajectories]
    turns = [st.get("turns", 0.0) for st in stats]
    out = {
        f"{prefix}/turns": sum(turns) / n,
        f"{prefix}/turns_max": max(turns),
        f"{prefix}/env_errors": float(sum(s.completion.trajectory.error is not None for s in trajectories)),
        f"{prefix}/env_s": sum(st.get("env_s", 0.0) for st in stats),
        f"{prefix}/control_tokens_stripped": sum(st.get("control_tokens_stripped", 0.0) for st in stats),
    }  # fmt: skip
    for name in COUNTED:
        out[f"{prefix}/{name}"] = sum(st.get(name, 0.0) for st in stats) / n
    tools = sorted({k for st in stats for k in st if k.startswith(PER_TOOL)})
    for name in tools:
        out[f"{prefix}/{name}"] = sum(st.get(name, 0.0) for st in stats) / n
    for reason in FINISH_REASONS:
        share = sum(s.completion.finish_reason == reason for s in trajectories) / n
        out[f"{prefix}/finish/{reason}"] = share
    lengths: dict[int, list[int]] = defaultdict(list)
    for s in trajectories:
        model_turns = [length for length, is_model in s.completion.trajectory.segments if is_model]
        for k, length in enumerate(model_turns):
            lengths[k].append(length)
    for k in sorted(lengths):
        out[f"{prefix}/turn_{k}_length"] = sum(lengths[k]) / len(lengths[k])
    env_metrics: dict[str, list[float]] = defaultdict(list)
    for s in trajectories:
        for name, value in s.completion.trajectory.metrics.items():
            env_metrics[name].append(value)
    for name in sorted(env_metrics):
        out[f"{prefix}/env/{name}"] = sum(env_metrics[name]) / len(env_metrics[name])
    return out
