"""Score rollout samples with the configured reward functions in worker processes.

Generated text is untrusted and user reward code may hang, crash, leak processes or write
garbage, so nothing of it runs in the trainer's process. The pool is its own small process
manager rather than a `ProcessPoolExecutor`, because an executor cannot stop a running task:

- Workers (worker.py, started in the sandbox `rewards.sandbox` asks for by
  sandbox/process.py; one log line says which) resolve every function once and report
  ready; time limits start only then, so imports never count against them.
- `score` sends each user function one sample per call: each call runs in a box of its
  own (sandbox/box.py), so what one sample's program leaves (a process, a file) reaches
  no other sample, its siblings in the GRPO group included. The built-ins, which never
  execute model text, get one chunk per worker (at most `chunk_size` samples while a
  function's speed is unknown; never two prompts' samples in one chunk). A call is one
  function on one chunk; the calls of a scoring are shared out among the workers, each
  worker's share in one message (a round trip per scoring, not per call), and its
  supervisor runs them side by side (`rewards.calls_per_worker`), answering each as it
  ends (check.py `side_by_side`: each box then in a network namespace of its own where
  it can have one; one at a time where its boxes would share a process count). The pool waits on all workers at once.
- Failures are per call and per sample: a value that is not a finite number or None is
  that sample's failure. A list of the wrong length is the call's failure like any other
  (a program a reward runs can forge its box's reply, worker.py: no kind a box sends may
  stop the run on its own); a function that returns one on every sample is stopped by
  the systematic check. A call that raises, returns the wrong shape, dies, garbles its
  reply or runs past `timeout_s` is retried one sample per call, so a sample's reward is
  None (and counted) only when it fails on its own. The first failure of each kind per
  function is logged with its message; the rest are counted in `reward/<name>/failures`.
- Time limits: at `timeout_s` the call's box interrupts the call itself; a box still
  running a little later (box_limit_s: stuck in C code) is killed by its supervisor, and
  the call fails as timed out. A worker with calls out that sends nothing for longer
  than that and `grace_s` more is broken: its whole process tree is killed, it is
  replaced, and its calls are sent again once (the worker's failure is not theirs; a
  second time they fail). `timeout_s` bounds one function on one chunk; chunks shrink
  once a function's speed is measured (the seconds its box reports) so that a chunk
  takes about a quarter of it. The sandbox's other limits (CPU, memory, output,
  processes) fail a call the same way; each kind is counted in `reward/<kind>_failures`.
  A function that times out on every call on a prompt (its chunks, then GIVE_UP_AFTER
  samples alone) is not retried on that prompt's other samples: they fail as timed out
  too, its calls still queued at a worker are cancelled there (`reward/<name>/timeouts`
  counts a function's samples that did). Other prompts' calls still run (two looping
  samples that happen to run first must not leave the batch unscored), until at least
  half the batch's prompts are given up on with none of the function's calls answered:
  then the function is, for the batch. So such a batch costs a few timeouts per prompt
  of half the batch, not one per sample; a batch whose every sample timed out stops the
  run (train/skips.py).
- Multi-turn trajectories: rewards also get the trajectory's columns (`trajectory_columns`);
  the environment's reward terms are added to the total (weight 1) as `env/<name>`, and a
  trajectory whose environment failed is unscored. With no reward function configured
  (an environment gives the rewards) no worker is started.
- `close()` may come from another thread while `score` runs (the trainer's shutdown): it
  kills every worker's tree at once and wakes the scoring thread, which raises
  PoolClosedError; it never waits for a reward's time limit. It also runs at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import pickle
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

from leangrpo.pipeline.advantages import mean_std
from leangrpo.rewards.check import (
    did_not_start,
    exited,
    init_error,
    side_by_side,
    startup_timeout,
    worker_init,
)
from leangrpo.rewards.protocol import (
    WRONG_LENGTH,
    CallError,
    Cancelled,
    InitError,
    Loading,
    Ready,
    Reply,
    Result,
    box_limit_s,
    parse_reply,
)
from leangrpo.rewards.registry import (
    PoolClosedError,
    ResolvedReward,
    RewardFailedError,
    RewardSpecError,
    is_user_code,
    parse_specs,
)
from leangrpo.sandbox.calls import LIMIT_KINDS, TIMEOUT
from leangrpo.sandbox.frames import ProtocolError
from leangrpo.sandbox.levels import plan_for
from leangrpo.sandbox.process import OutputBudget, WorkerGone, WorkerProcess

if TYPE_CHECKING:
    from leangrpo.contracts import RolloutSample

log = logging.getLogger("leangrpo.rewards")
# Failures that say more about the moment than the function: never "the same way" (item 5)
CIRCUMSTANTIAL = ("worker died", "box died", "garbled reply", "forged reply", *LIMIT_KINDS)
# One-sample calls of a function on one prompt that time out, none of its calls on that
# prompt having returned, before that prompt's other samples are given up on; and prompts
# so given up on (at least half the batch's), none of its calls having returned, before
# the function is (`_give_up_on`)
GIVE_UP_AFTER = 2


@dataclass
class _Call:
    indices: list[int]  # sample positions in the score() call
    fn: int
    id: int = 0
    requeued: bool = False  # sent again once already, its worker having broken meanwhile


@dataclass
class _Run:
    """The state of one score() call."""

    samples: list[RolloutSample]
    values: list[list[float | None]]  # [function][sample]
    failures: list[int]
    queue: deque[_Call] = field(default_factory=deque)
    limits: dict[str, int] = field(default_factory=dict)  # samples failed at a sandbox limit
    ways: list[dict[str, str]] = field(default_factory=list)  # [function]: kind -> first detail
    timeouts: list[int] = field(default_factory=list)  # [function]: samples failed by timeout
    # [function]: prompt -> its one-sample calls that timed out
    alone_timed_out: list[dict[Any, int]] = field(default_factory=list)
    answered: list[set] = field(default_factory=list)  # [function]: prompts a call returned on
    given_up: dict[int, str] = field(default_factory=dict)  # function -> why (`_give_up_on`)
    # [function]: prompt -> why (`_give_up_on`)
    prompts_given_up: list[dict[Any, str]] = field(default_factory=list)


class RewardPool:
    """`RewardPool(cfg.rewards).score(samples)` sets `sample.rewards` and `sample.reward`."""

    def __init__(self, rewards_cfg: Any, chunk_size: int = 16):
        self.specs = parse_specs(rewards_cfg)  # the workers import; check_rewards did already
        self.timeout_s = float(rewards_cfg.timeout_s)
        self.fail_fast = bool(rewards_cfg.fail_fast)
        self.systematic = rewards_cfg.systematic_failures
        self.num_workers = int(rewards_cfg.num_workers)
        if not 0 < self.timeout_s < math.inf or self.num_workers < 1:
            raise RewardSpecError(
                f"rewards.timeout_s = {self.timeout_s} and rewards.num_workers = "
                f"{self.num_workers} must both be positive and finite"
            )
        if chunk_size < 1:
            raise ValueError(f"chunk_size = {chunk_size} must be >= 1")
        self.chunk_size = chunk_size
        self.grace_s = max(1.0, 0.25 * self.timeout_s)  # the supervisor's own slack
        # a worker with calls out answers one at least this often: each call's box is
        # killed at box_limit_s, and the next one starts at once
        self.silence_s = box_limit_s(self.timeout_s) + self.grace_s
        self.startup_timeout_s = startup_timeout(rewards_cfg)
        self._init = worker_init(self.specs, rewards_cfg, "serve")
        self._plan = plan_for(rewards_cfg, "rewards") if self.specs else None
        if self._plan is not None:
            log.info("%s", self._plan.describe())
            self._init.update(side_by_side(self._plan, self._init["parallel"]))
        self._lock = threading.RLock()  # one score() at a time; close() may re-enter
        self._state = threading.Lock()  # guards _closed against spawning new workers
        self._closed = False
        self._wake_read, self._wake_write = os.pipe()  # close() wakes a waiting score()
        self._budget = OutputBudget()
        self._logged: set[tuple[int, str]] = set()
        self._call_ids = 0
        self._calls_run = 0  # calls a box answered (not cancelled)
        self._seconds_per_sample: list[float | None] = [None] * len(self.specs)
        self._workers: list[WorkerProcess] = []
        for slot in range(self.num_workers if self.specs else 0):  # none: env rewards only
            self._workers.append(self._spawn(slot))
        _LIVE_POOLS.add(self)

    @property
    def keys(self) -> list[str]:
        return [s.key for s in self.specs]

    def score(self, samples: list[RolloutSample]) -> dict[str, float]:
        """Score in place; returns reward metrics for this call."""
        if not samples:
            return {}
        with self._lock:
            if self._closed:
                raise PoolClosedError("this RewardPool is closed")
            try:
                run = self._run_all(samples)
            finally:
                self._budget.reset()
                if self._closed:
                    self._release_all()
        self._check_systematic(run)
        metrics = _apply_and_summarise(samples, self.specs, run.values, run.failures)
        for spec, timeouts in zip(self.specs, run.timeouts):
            metrics[f"reward/{spec.key}/timeouts"] = float(timeouts)
        if self._plan is not None:
            for kind in LIMIT_KINDS:  # "failures" keys add up when streamed chunks merge
                metrics[f"reward/{kind.split()[0]}_failures"] = float(run.limits.get(kind, 0))
        return metrics

    def _check_systematic(self, run: _Run) -> None:
        """A function that failed on every sample the same way (its code, not its luck):
        stop with one sentence, or warn once (rewards.systematic_failures). The samples
        must come from 2 or more prompts: a batch of one prompt's group (a streamed chunk
        of one group, a torchrun rank's share) failing may be that prompt's data row."""
        n = len(run.samples)
        prompts = len({sample.prompt.uid for sample in run.samples})
        for fn, spec in enumerate(self.specs):
            ways = run.ways[fn]
            if prompts < 2 or run.failures[fn] < n or len(ways) != 1:
                continue
            ((kind, detail),) = ways.items()
            if kind in CIRCUMSTANTIAL:
                continue
            fix = "fix the error it raises"
            if kind in ("bad value", "bad return"):
                fix = "fix it"
            elif kind == WRONG_LENGTH:
                fix = (
                    "it is called with lists of prompts and completions and returns one "
                    "reward per completion, in order: fix it"
                )
            what = f"reward '{spec.key}' failed on all {n} samples of a batch the same way"
            what += f" ({detail})"
            if self.systematic == "stop":
                raise RewardFailedError(
                    f"{what}; {fix}, or set rewards.systematic_failures: warn to go on with "
                    "such samples unscored"
                )
            if (fn, "systematic") not in self._logged:
                self._logged.add((fn, "systematic"))
                log.warning("%s; they are unscored (rewards.systematic_failures: warn)", what)

    # ---- scheduling ---------------------------------------------------------------------

    def _run_all(self, samples: list[RolloutSample]) -> _Run:
        self._restart_busy_workers()  # left over from a call that was interrupted
        n, k = len(samples), len(self.specs)
        run = _Run(samples, [[None] * n for _ in self.specs], [0] * k)
        run.ways, run.timeouts = [{} for _ in self.specs], [0] * k
        run.alone_timed_out = [{} for _ in self.specs]
        run.answered = [set() for _ in self.specs]
        run.prompts_given_up = [{} for _ in self.specs]
        run.queue.extend(self._initial_calls(samples))
        payload = _payload(samples)
        while run.queue or any(w.calls for w in self._workers):
            self._dispatch(run, payload)
            self._wait_and_handle(run)
        return run

    def _initial_calls(self, samples: list[RolloutSample]) -> list[_Call]:
        """Per function, chunks of one prompt's samples each (a call runs in a box of its
        own, and what one sample's program leaves in it must not reach another prompt's),
        at most the size `_chunk_sizes` gives (one sample for a user function)."""
        by_prompt: dict[Any, list[int]] = {}
        for i, sample in enumerate(samples):
            by_prompt.setdefault(sample.prompt.uid, []).append(i)
        return [
            _Call(group[start : start + size], fn)
            for fn, size in enumerate(self._chunk_sizes(len(samples)))
            for group in by_prompt.values()
            for start in range(0, len(group), size)
        ]

    def _chunk_sizes(self, n: int) -> list[int]:
        """Per function: a user function gets one sample per call, so each sample's program
        runs in a box of its own (in a box it shares, a process one sample leaves kills its
        siblings' programs: they score 0 and its advantage rises). A built-in, which never
        executes model text, gets one chunk per worker, small enough that a chunk takes
        about a quarter of timeout_s at its measured speed; at most chunk_size while its
        speed is unknown (its first call). Each chunk is a round trip (its cost is in
        benchmarks/RESULTS.md, "per-step overhead")."""
        even = -(-n // self.num_workers)
        sizes = []
        for spec, per_sample in zip(self.specs, self._seconds_per_sample):
            if is_user_code(spec):
                sizes.append(1)
            elif per_sample is None:
                sizes.append(min(even, self.chunk_size))
            else:
                sizes.append(max(1, min(even, int(0.25 * self.timeout_s / per_sample))))
        return sizes

    def _record_time(self, fn: int, elapsed: float, count: int) -> None:
        per_sample = elapsed / count
        old = self._seconds_per_sample[fn]
        self._seconds_per_sample[fn] = per_sample if old is None else 0.5 * (old + per_sample)

    def _dispatch(self, run: _Run, payload: tuple) -> None:
        """The queue shared out among the workers, each ready one's share in one message
        (its supervisor runs them side by side and answers each as it ends); a worker not
        ready yet takes its share once it is."""
        prompts, completions, columns = payload
        chunks: dict[tuple[int, ...], bytes] = {}  # one pickle per chunk, whatever its functions
        for slot, worker in enumerate(self._workers):
            if not run.queue:
                return
            if not worker.ready:
                continue
            share = -(-len(run.queue) // len(self._workers))
            calls = [run.queue.popleft() for _ in range(share)]
            items = []
            for call in calls:
                self._call_ids += 1
                call.id = self._call_ids
                key = tuple(call.indices)
                if key not in chunks:
                    chunk = (
                        [prompts[i] for i in key],
                        [completions[i] for i in key],
                        {name: [col[i] for i in key] for name, col in columns.items()},
                    )
                    chunks[key] = pickle.dumps(chunk)
                items.append((call.id, call.fn, chunks[key], len(key)))
            if not worker.calls:
                self._progress(worker, time.monotonic())
            worker.calls.update((call.id, call) for call in calls)
            try:
                worker.send(("calls", items))
            except WorkerGone as e:
                self._fail_worker(slot, run, "worker died", str(e))

    def _progress(self, worker: WorkerProcess, now: float) -> None:
        """The worker answered (or was idle): its next answer is due within silence_s."""
        worker.since = now
        worker.deadline = now + self.silence_s

    def _wait_and_handle(self, run: _Run) -> None:
        """Block until a worker replies, dies, prints or passes a deadline; handle it."""
        deadlines = [w.deadline for w in self._workers if w.calls]
        deadlines += [w.started + self.startup_timeout_s for w in self._workers if not w.ready]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        handles: list[Any] = [self._wake_read]
        for w in self._workers:
            handles += w.handles()
        ready = set(wait(handles, timeout))
        if self._closed:
            raise PoolClosedError("the reward pool was closed while scoring")
        now = time.monotonic()
        for slot, worker in enumerate(list(self._workers)):
            if worker.out_fd in ready:
                worker.relay_output()
            if worker.sock in ready:
                self._read(slot, worker, run)
            elif worker.calls and now >= worker.deadline:
                message = (
                    f"its reward worker sent nothing for {self.silence_s:g} s while calls "
                    "were running (it was killed and replaced)"
                )
                self._fail_worker(slot, run, "worker died", message)
            elif not worker.ready and now - worker.started > self.startup_timeout_s:
                self.close()
                raise RewardSpecError(
                    did_not_start(self.specs, worker.loading, self.startup_timeout_s)
                )

    def _read(self, slot: int, worker: WorkerProcess, run: _Run) -> None:
        try:
            replies = worker.receive()
        except WorkerGone:
            code = worker.exit_code()
            if not worker.ready:
                self.close()
                raise RewardSpecError(exited(self.specs, worker.loading, code)) from None
            self._fail_worker(
                slot, run, "worker died", f"the worker process died (exit code {code})"
            )
            return
        except ProtocolError as e:
            self._fail_worker(slot, run, "garbled reply", str(e))
            return
        for reply in replies:
            if self._workers[slot] is not worker:
                return  # replaced: the rest came from a worker that is gone
            self._handle(slot, worker, reply, run)

    def _handle(self, slot: int, worker: WorkerProcess, reply: Reply, run: _Run) -> None:
        if isinstance(reply, Ready):
            worker.ready = True
        elif isinstance(reply, Loading):
            worker.loading = min(reply.fn, len(self.specs) - 1)
        elif isinstance(reply, InitError):
            self.close()
            raise RewardSpecError(init_error(self.specs, reply))
        else:
            self._answer(slot, worker, reply, run)

    def _answer(self, slot: int, worker: WorkerProcess, reply: Result | CallError | Cancelled,
                run: _Run) -> None:  # fmt: skip
        call = worker.calls.get(reply.task)
        if (
            call is None
            or reply.fn != call.fn
            or (isinstance(reply, Result) and len(reply.values) != len(call.indices))
        ):
            self._fail_worker(slot, run, "garbled reply", "a reply that does not fit its call")
            return
        del worker.calls[reply.task]
        self._progress(worker, time.monotonic())
        if isinstance(reply, Cancelled):
            why = _given_up(run, call) or "cancelled"
            for i in call.indices:
                self._sample_failed(run, call.fn, i, TIMEOUT, why)
            return
        self._calls_run += 1
        if isinstance(reply, Result):
            run.answered[call.fn].add(_prompt(run, call))
            self._record_time(call.fn, reply.seconds, len(call.indices))
            for i, value in zip(call.indices, reply.values):
                run.values[call.fn][i] = value
            for j, kind, msg in reply.errors:
                self._sample_failed(run, call.fn, call.indices[j], kind, msg)
        else:
            self._call_failed(run, call, reply.kind, reply.msg)

    def _call_failed(self, run: _Run, call: _Call, kind: str, msg: str) -> None:
        """Function call.fn failed on the call's whole chunk."""
        fn = call.fn
        if kind == WRONG_LENGTH:  # never re-run one sample per call, where a function
            # returning [1.0] would fit and score everything 1.0
            for i in call.indices:
                self._sample_failed(run, fn, i, kind, msg)
            return
        if len(call.indices) > 1:  # find the samples that fail on their own, first: a
            # function that times out on every call is then given up on after this chunk and
            # GIVE_UP_AFTER samples alone, not after every other prompt's chunk too
            run.queue.extendleft(_Call([i], fn) for i in reversed(call.indices))
            return
        self._sample_failed(run, fn, call.indices[0], kind, msg)
        if kind == TIMEOUT:
            uid = _prompt(run, call)
            timed_out = run.alone_timed_out[fn]
            timed_out[uid] = timed_out.get(uid, 0) + 1
            if timed_out[uid] >= GIVE_UP_AFTER and uid not in run.answered[fn]:
                self._give_up_on(run, fn, uid)

    def _give_up_on(self, run: _Run, fn: int, uid: Any) -> None:
        """Function fn timed out on every call on prompt `uid` of this batch, GIVE_UP_AFTER
        samples alone: that prompt's samples not scored yet are left unscored as timed out,
        not each retried for timeout_s. Only that prompt's: the calls of other prompts,
        which may not have started (two looping samples run first, side by side), still
        run. Once at least half the batch's prompts (and GIVE_UP_AFTER) are so given up
        on, none of the function's calls having returned, the function itself is: the
        rest of its samples fail the same way. Calls still queued here are dropped; those
        a worker holds are cancelled there (its supervisor answers each "cancelled", or
        with what it returned first)."""
        if fn in run.given_up or uid in run.prompts_given_up[fn]:
            return
        run.prompts_given_up[fn][uid] = why = (
            f"not run: {GIVE_UP_AFTER} samples of its prompt timed out alone, none scored "
            f"(at rewards.timeout_s = {self.timeout_s:g} s)"
        )
        self._cancel(run, fn, why, lambda call: _prompt(run, call) == uid)
        prompts = len({sample.prompt.uid for sample in run.samples})
        given_up = len(run.prompts_given_up[fn])
        if given_up >= max(GIVE_UP_AFTER, -(-prompts // 2)) and not run.answered[fn]:
            run.given_up[fn] = why = (
                f"not run: every call of this batch timed out ({GIVE_UP_AFTER} samples alone "
                f"of each of {given_up} prompts, at rewards.timeout_s = {self.timeout_s:g} s)"
            )
            self._cancel(run, fn, why, lambda call: True)

    def _cancel(self, run: _Run, fn: int, why: str, chosen: Any) -> None:
        """Function fn's calls that `chosen` picks fail as timed out (`why`) without a run:
        dropped from the queue, cancelled at the worker that holds them."""
        kept: deque[_Call] = deque()
        for call in run.queue:
            if call.fn != fn or not chosen(call):
                kept.append(call)
                continue
            for i in call.indices:
                self._sample_failed(run, fn, i, TIMEOUT, why)
        run.queue = kept
        for worker in self._workers:
            held = [call.id for call in worker.calls.values() if call.fn == fn and chosen(call)]
            if held:
                with contextlib.suppress(WorkerGone):  # then its calls fail with it
                    worker.send(("cancel", held))

    def _sample_failed(self, run: _Run, fn: int, i: int, kind: str, msg: str) -> None:
        key = self.specs[fn].key
        detail = msg if not kind[:1].isupper() else f"{kind}: {msg}" if msg else kind
        if self.fail_fast:
            self._restart_busy_workers()
            raise RewardFailedError(
                f"reward '{key}' failed on sample {i} (prompt uid "
                f"{run.samples[i].prompt.uid}): {detail} (rewards.fail_fast stops the run "
                "at the first failure)"
            )
        run.failures[fn] += 1
        run.timeouts[fn] += kind == TIMEOUT
        if kind in LIMIT_KINDS:
            run.limits[kind] = run.limits.get(kind, 0) + 1
        run.ways[fn].setdefault(kind, detail)
        if (fn, kind) not in self._logged:
            self._logged.add((fn, kind))
            log.warning(
                "reward '%s' failed on a sample: %s (later failures of this kind are only "
                "counted in reward/%s/failures)",
                key,
                detail,
                key,
            )

    # ---- worker lifecycle ---------------------------------------------------------------

    def _spawn(self, slot: int) -> WorkerProcess:
        label = f"reward worker {slot}"
        return WorkerProcess(self._init, label, self._budget, parse=parse_reply, plan=self._plan)

    def _fail_worker(self, slot: int, run: _Run, kind: str, msg: str) -> None:
        """The worker broke (died, garbled its channel, fell silent): replace it. Its calls
        were no call's doing (user code never runs in the process that holds the
        channel): each is queued again once; a second time, it fails as `kind`."""
        calls = list(self._workers[slot].calls.values())
        self._replace(slot)
        for call in calls:
            why = _given_up(run, call)
            if why is not None:
                for i in call.indices:
                    self._sample_failed(run, call.fn, i, TIMEOUT, why)
            elif call.requeued:
                self._call_failed(run, call, kind, msg)
            else:
                run.queue.append(_Call(call.indices, call.fn, requeued=True))

    def _replace(self, slot: int) -> None:
        with self._state:
            if self._closed:
                raise PoolClosedError("the reward pool was closed while scoring")
            self._workers[slot].kill()
            self._workers[slot] = self._spawn(slot)

    def _restart_busy_workers(self) -> None:
        for slot, worker in enumerate(self._workers):
            if worker.calls:
                self._replace(slot)

    def close(self) -> None:
        """Kill every worker's tree now; a score() running in another thread raises
        PoolClosedError. Returns without waiting on any reward's time limit."""
        with self._state:
            first, self._closed = not self._closed, True
            workers = list(self._workers)
        if first:
            with contextlib.suppress(OSError):
                os.write(self._wake_write, b"x")
        for worker in workers:
            worker.terminate()
        if self._lock.acquire(timeout=5.0):  # the scoring thread leaves at once when woken
            try:
                self._release_all()
            finally:
                self._lock.release()
        _LIVE_POOLS.discard(self)

    def _release_all(self) -> None:
        for worker in self._workers:
            worker.kill()
        self._workers = []
        for fd in (self._wake_read, self._wake_write):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_read = self._wake_write = -1

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if hasattr(self, "_state"):
                self.close()


_LIVE_POOLS: weakref.WeakSet[RewardPool] = weakref.WeakSet()


@atexit.register
def _close_live_pools() -> None:
    for pool in list(_LIVE_POOLS):
        pool.close()


def _prompt(run: _Run, call: _Call) -> Any:
    """The prompt of a call's samples (a chunk never mixes prompts)."""
    return run.samples[call.indices[0]].prompt.uid


def _given_up(run: _Run, call: _Call) -> str | None:
    """Why a call is not run (its function or its prompt given up on), or None."""
    return run.given_up.get(call.fn) or run.prompts_given_up[call.fn].get(_prompt(run, call))


def _payload(samples: list[RolloutSample]) -> tuple[list[str], list[str], dict[str, list]]:
    """Prompts, completions and every data column as aligned lists (missing -> None);
    with multi-turn trajectories also their columns (`trajectory_columns`)."""
    names = dict.fromkeys(name for s in samples for name in s.prompt.columns)
    columns = {name: [s.prompt.columns.get(name) for s in samples] for name in names}
    if any(s.completion.trajectory is not None for s in samples):
        columns.update(trajectory_columns(samples))
    return [s.prompt.text for s in samples], [s.completion.text for s in samples], columns


def trajectory_columns(samples: list[RolloutSample]) -> dict[str, list]:
    """What a reward sees of a multi-turn trajectory (a data column of the same name is
    overridden): `messages` (the whole conversation: the start, each model turn's raw text
    and the environment's replies), `num_turns`, `tool_calls` ({"name", "arguments"} each)
    and `env_rewards` (the environment's reward terms); `completions` holds the last model
    turn's text. None for a single-turn sample."""
    trajectories = [s.completion.trajectory for s in samples]
    return {
        "messages": [t and t.messages for t in trajectories],
        "num_turns": [t and sum(is_model for _, is_model in t.segments) for t in trajectories],
        "tool_calls": [t and t.tool_calls for t in trajectories],
        "env_rewards": [t and t.rewards for t in trajectories],
    }


def _apply_and_summarise(
    samples: list[RolloutSample],
    specs: list[ResolvedReward],
    values: list[list],
    failures: list[int],
) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for spec, fn_values, fn_failures in zip(specs, values, failures):
        scored = [v for v in fn_values if v is not None]
        if scored:
            metrics[f"reward/{spec.key}/mean"] = mean_std(scored)[0]
        metrics[f"reward/{spec.key}/failures"] = float(fn_failures)
    overflowed = 0
    for i, sample in enumerate(samples):
        sample.rewards = {spec.key: values[f][i] for f, spec in enumerate(specs)}
        weighted = [(spec.weight, sample.rewards[spec.key]) for spec in specs if spec.weight != 0]
        trajectory = sample.completion.trajectory
        if trajectory is not None:  # the environment's reward terms, weight 1
            for name, value in trajectory.rewards.items():
                sample.rewards[f"env/{name}"] = value
                weighted.append((1.0, value))
        total = None
        failed_environment = trajectory is not None and trajectory.error is not None
        if all(v is not None for _, v in weighted) and not failed_environment:
            total = float(sum(w * v for w, v in weighted))
            if not math.isfinite(total):  # weights times huge values
                total, overflowed = None, overflowed + 1
        sample.reward = total
    if overflowed:
        log.warning("%d weighted total rewards overflowed the float range: unscored", overflowed)
    env_terms = sorted({k for s in samples for k in s.rewards if k.startswith("env/")})
    for key in env_terms:
        scored = [s.rewards[key] for s in samples if s.rewards.get(key) is not None]
        metrics[f"reward/{key}/mean"] = mean_std(scored)[0]
    totals = [s.reward for s in samples if s.reward is not None]
    if totals:
        metrics["reward/mean"], metrics["reward/std"] = mean_std(totals)
    metrics["reward/failures"] = float(sum(failures))
    metrics["reward/unscored"] = float(len(samples) - len(totals))
    return metrics
