"""The `sandbox` sub-section of `environment` and `rewards`: how their workers are confined.

One class for both sections, so environment/tool workers and reward workers can be set
apart (a reward that needs a GPU runs at `process`, the tools stay at `namespace`). What
each level protects against is docs/sandbox.md ("What each level protects against"); the code is
src/leangrpo/sandbox/.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from leangrpo.config.base import Section

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SandboxConfig(Section):
    """How this section's workers are confined: their sandbox and its limits."""

    level: Literal["auto", "namespace", "process"] = Field(
        "auto",
        description="'namespace': a Linux sandbox (own user, PID, IPC, mount and network namespaces; the whole filesystem read-only but one scratch directory; the trainer invisible); 'process': a hardened worker process (own session, allow-listed environment, no capabilities, the trainer non-dumpable; the filesystem and signals to the trainer are not fenced); 'auto': namespace where this machine can start one, else process (the log says which and why). 'namespace' where it cannot start is refused at start-up.",
    )
    allow_network: bool = Field(
        False,
        description="Let the workers reach the network (namespace level: they share the trainer's network namespace; without it they have only their own loopback). The process level never fences the network.",
    )
    max_processes: int = Field(
        64,
        ge=1,
        le=4096,
        description="Processes and threads one reward call or trajectory (its box) may run at once (the box's own few not counted); a call that cannot start one more fails with a message. Enforced by a pids cgroup per box (root) or RLIMIT_NPROC in the worker's user namespace (namespace level); elsewhere the log says it is not.",
    )
    max_output_bytes: int = Field(
        1 << 20,
        ge=1024,
        le=1 << 30,
        description="Bytes one call (and the processes it starts) may print to stdout/stderr; past it the call is stopped and fails with a message. The first 64 KiB of each call's output are relayed to the log.",
    )
    scratch_mb: int = Field(
        256,
        ge=1,
        le=1 << 20,
        description="Size (MiB) of each reward call's or trajectory's writable scratch directory, its HOME and TMPDIR, fresh for each and removed at its end; namespace level: a tmpfs (and the same again for a private /dev/shm), counted in its memory cgroup, the only place it can write (its working directory stays the trainer's, read-only); process level: a temporary directory, not size-limited.",
    )
    pass_env: list[str] = Field(
        default_factory=list,
        description="Names of the trainer's environment variables the workers also get; they get only PATH, LANG, LC_*, TZ, LD_LIBRARY_PATH, thread counts, HF cache and offline settings and the like, never tokens or keys unless listed here.",
    )

    @field_validator("pass_env")
    @classmethod
    def _names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not ENV_NAME.match(name):
                raise ValueError(f"{name!r} is not an environment variable name")
        return value
