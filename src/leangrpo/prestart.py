"""Worker processes started right after the cheap checks, before torch is imported.

The reward workers and the environment workers are processes of their own that spend
their first seconds importing (math-verify, transformers for tool schemas, the user's
files). Started here, by `leangrpo train` once preflight.py has passed and before it
imports the trainer, those imports run beside the trainer's own import of torch and
transformers (two cores: at the same time) instead of after it, which brings the first
step seconds sooner. No torch here.

`Prestarted(cfg)` spawns the reward pool (its constructor does not wait) and builds the
environment pool in a thread (its constructor waits for the workers to be ready, so a
broken environment file is still one line, raised when the trainer takes the pool: after
the import, before the model loads, as before). The trainer takes both
(`take_rewards`, `take_environment_pool`); `close()` ends whatever it did not take.
Under torchrun nothing is prestarted (the ranks start their workers in the trainer).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger("leangrpo")
CLOSE_WAIT_S = 1.0  # close() waits this long for an environment pool still starting


class Prestarted:
    """The reward pool and the environment pool being started; see the module docstring."""

    def __init__(self, cfg: Any):
        from leangrpo.rewards import RewardPool

        self._rewards = None
        self._env_pool = None
        self._env_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        names = []
        if cfg.environment is not None:
            names.append(f"{cfg.environment.num_workers} environment worker(s)")
            self._thread = threading.Thread(
                target=self._start_environment_pool, args=(cfg.environment,), daemon=True
            )
        if cfg.rewards.functions:
            names.append(f"{cfg.rewards.num_workers} reward worker(s)")
        if names:
            log.info("starting %s ...", " and ".join(names))
        if self._thread is not None:
            self._thread.start()
        try:
            self._rewards = RewardPool(cfg.rewards)
        except BaseException:
            self.close()
            raise

    def _start_environment_pool(self, env_cfg: Any) -> None:
        from leangrpo.environments.pool import EnvironmentPool

        try:
            pool = EnvironmentPool(env_cfg)
        except BaseException as exc:  # raised in the trainer's thread when it takes the pool
            self._env_error = exc
            return
        with self._lock:
            if self._closed:  # close() gave up waiting: nobody will take it
                pool.close()
            else:
                self._env_pool = pool

    def take_rewards(self):
        rewards, self._rewards = self._rewards, None
        return rewards

    def take_environment_pool(self):
        """The ready environment pool (waits for it), or its start-up error, raised."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        if self._env_error is not None:
            error, self._env_error = self._env_error, None
            raise error
        pool, self._env_pool = self._env_pool, None
        return pool

    def close(self) -> None:
        """End what the trainer did not take (a failure or interrupt before it did)."""
        if self._rewards is not None:
            self._rewards.close()
            self._rewards = None
        if self._thread is not None:  # still starting: an interrupt does not wait long for it
            self._thread.join(timeout=CLOSE_WAIT_S)  # (the thread closes it when it is ready)
            self._thread = None
        with self._lock:
            self._closed = True
            pool, self._env_pool = self._env_pool, None
        if pool is not None:
            pool.close()
