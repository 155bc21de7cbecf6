"""RewardPool against hostile reward code: odd values, a garbled or malicious channel,
closed descriptors, KeyboardInterrupt, prints, leaked processes, close() while scoring.
(What the sandbox keeps from reward and tool code alike: tests/sandbox/.)"""

from __future__ import annotations

import ast
import logging
import math
import os
import textwrap
import threading
import time

import psutil
import pytest
from support.configs import rewards_section

from leangrpo.contracts import Completion, Prompt, RolloutSample
from leangrpo.rewards import PoolClosedError, RewardPool

HOSTILE_CODE = textwrap.dedent(
    """
    import os, pickle, signal, struct, subprocess, time
    import numpy as np

    MARK = os.environ["LEANGRPO_TEST_MARK"]

    def numpy_array(prompts, completions, **columns):
        return np.arange(len(completions), dtype=np.float32)

    def mixed(prompts, completions, **columns):
        table = {"np32": np.float32(0.5), "np0d": np.array(2.0), "none": None, "int": 3,
                 "str": "high", "nan": float("nan"), "list": [1.0], "big": 10 ** 400}
        return [table.get(c, 1.0) for c in completions]

    def huge(prompts, completions, **columns):
        return [1e200 if len(c) % 2 else -1e200 for c in completions]

    def mutator(prompts, completions, level, **columns):
        n = len(completions)
        completions[0] = "changed"; prompts.clear(); level.append(99)
        completions.append("extra")  # its own copy: the values still count per sample
        return [1.0] * n

    def reader(prompts, completions, level, **columns):  # runs after mutator in one task
        intact = len(prompts) == len(completions) == len(level) and "changed" not in completions
        return [1.0 if intact else 0.0] * len(completions)

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {os.environ['LEANGRPO_TEST_PWNED']}",))

    def channel_attack(prompts, completions, **columns):
        payload = pickle.dumps(Evil())
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            try:
                kind = os.readlink(f"/proc/self/fd/{name}")
                if "garbage" in completions[0]:
                    os.write(fd, b"\\x80\\x04garbage\\xff\\n" * 3)
                elif kind.startswith("socket:"):
                    os.write(fd, struct.pack("!i", len(payload)) + payload)  # pickle channel
                    os.write(fd, b"LGRW" + struct.pack(">I", len(payload)) + payload)  # ours
            except OSError:
                pass
        return [1.0] * len(completions)

    def unruly(prompts, completions, **columns):
        if "close" in completions:
            os.closerange(0, 65536)
        if "interrupt" in completions:
            raise KeyboardInterrupt
        print("hello from the reward", len(completions))
        os.system("echo from a shell")
        return [1.0] * len(completions)

    def spawner(prompts, completions, **columns):
        how = completions[0]
        tag = MARK + {"soft": "1", "hard": "2", "background": "3"}[how]  # a valid sleep time
        if how == "hard":  # deaf to the worker's own time limit: the trainer kills it
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
        subprocess.Popen(["sleep", tag])
        os.system(f"sleep {tag} &")
        pid = os.fork()
        if pid == 0:  # a daemon: double fork and setsid, out of the worker's process group
            os.setsid()
            if os.fork() == 0:
                os.execvp("sleep", ["sleep", tag])
            os._exit(0)
        os.waitpid(pid, 0)
        if how != "background":
            os.system(f"sleep {tag}")  # blocks until the time limit
        return [1.0] * len(completions)

    def descriptors(prompts, completions, **columns):
        held = {}
        for name in os.listdir("/proc/self/fd"):
            try:
                held[int(name)] = os.readlink(f"/proc/self/fd/{name}")
            except OSError:  # the listing's own descriptor, closed by now
                pass
        print("held", sorted(held.items()))
        return [float(len(held))] * len(completions)

    def late_import(prompts, completions, **columns):  # a heavy import inside the call
        import slow_module_for_leangrpo_tests as slow
        return [slow.VALUE] * len(completions)

    def mute(prompts, completions, **columns):  # closes its stdout/stderr, lives on
        os.closerange(1, 3)
        time.sleep(0.5)
        return [1.0] * len(completions)

    def hog(prompts, completions, **columns):
        if "alloc" in completions:
            block = bytearray(2 << 30)  # 2 GiB of address space
        if "spin" in completions:
            while True:
                pass
        return [1.0] * len(completions)

    def sleeper(prompts, completions, **columns):
        time.sleep(60)
        return [1.0] * len(completions)

    def loopback(prompts, completions, **columns):  # listens, or connects, on 127.0.0.1
        import socket
        port = 47000 + int(MARK.rsplit(".", 1)[1]) % 1000
        end = time.time() + 4
        if completions[0] == "listen":
            s = socket.socket()
            s.bind(("127.0.0.1", port)); s.listen(4); s.settimeout(4)
            try:
                s.accept()[0].sendall(b"hello")
            except OSError:
                pass
            return [0.0]
        while time.time() < end:
            try:
                return [float(socket.create_connection(("127.0.0.1", port), 1).recv(5) == b"hello")]
            except OSError:
                time.sleep(0.05)
        return [0.0]

    def forger(prompts, completions, **columns):  # sends its box's reply itself
        import gc, json
        if completions[0].startswith("{"):
            conn = next(o for o in gc.get_objects() if type(o).__name__ == "BoxConn")
            conn.send(json.loads(completions[0]))
            time.sleep(30)  # the supervisor takes the first frame and ends the box
        time.sleep(0.5)  # honest calls overlap the forged one
        return [1.0] * len(completions)
    """
)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile") / "hostile_rewards.py"
    path.write_text(HOSTILE_CODE)
    return path


@pytest.fixture(autouse=True)
def marks(tmp_path, monkeypatch):
    mark = f"1000.{os.getpid()}{time.monotonic_ns() % 10**6}"  # unique, and a valid sleep time
    monkeypatch.setenv("LEANGRPO_TEST_MARK", mark)
    monkeypatch.setenv("LEANGRPO_TEST_PWNED", str(tmp_path / "pwned"))
    return mark


PASSED = ["LEANGRPO_TEST_MARK", "LEANGRPO_TEST_PWNED"]  # the workers get no other test variable


def cfg(path, *names, **fields):
    """The functions `names` of the file at `path`; one worker, 5 s unless given."""
    fields.setdefault("sandbox", {"pass_env": PASSED})
    return rewards_section(*(f"{path}:{n}" for n in names), **fields)


def make_samples(texts, prompt=None):
    """One prompt per sample, or all of prompt `prompt` (one call: calls never mix prompts)."""
    return [
        RolloutSample(
            group_id=0,
            prompt=Prompt(
                uid=i if prompt is None else prompt, text=f"q{i}", ids=[1], columns={"level": i}
            ),  # fmt: skip
            completion=Completion(ids=[1], text=t, logprobs=[0.0], finish_reason="stop", version=0),
        )
        for i, t in enumerate(texts)
    ]


def test_values_are_checked_per_sample_and_inputs_are_private(hostile):
    texts = ["np32", "np0d", "none", "int", "str", "nan", "list", "big", "plain"]
    names = ("numpy_array", "mixed", "huge", "mutator", "reader")
    with RewardPool(cfg(hostile, *names)) as pool:
        samples = make_samples(texts, prompt=0)
        metrics = pool.score(samples)
    table = {key: [s.rewards[key] for s in samples] for key in pool.keys}
    assert table["numpy_array"] == [0.0] * 9  # a call per sample: 0 in each
    assert table["mixed"] == [0.5, 2.0, None, 3.0, None, None, None, None, 1.0]
    assert table["huge"] == [-1e200] * 3 + [1e200] * 3 + [-1e200, 1e200, 1e200]
    assert table["mutator"] == [1.0] * 9  # checked against the count it was given
    assert table["reader"] == [1.0] * 9  # the mutator's changes did not reach it
    assert metrics["reward/mixed/failures"] == 4.0  # str, nan, list, big; None is no failure
    assert metrics["reward/numpy_array/failures"] == 0.0
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["reward/huge/mean"] == pytest.approx(1e200 / 9)


def test_garbage_and_pickles_on_the_channel_are_counted_never_unpickled(hostile, tmp_path):
    with RewardPool(cfg(hostile, "channel_attack")) as pool:
        samples = make_samples(["garbage", "pickle"])
        metrics = pool.score(samples)
        assert [s.reward for s in samples] == [None, None]
        assert metrics["reward/channel_attack/failures"] == 2.0
        assert not (tmp_path / "pwned").exists()  # the trainer never unpickled the payload


def test_closed_descriptors_and_keyboard_interrupt_are_one_line_failures(hostile, caplog, capfd):
    texts = ["ok", "close", "interrupt", "interrupt"]
    with (
        caplog.at_level(logging.INFO, logger="leangrpo.rewards"),
        RewardPool(cfg(hostile, "unruly", num_workers=1)) as pool,
    ):
        samples = make_samples(texts)
        metrics = pool.score(samples)
    assert [s.reward for s in samples] == [1.0, None, None, None]
    assert metrics["reward/unruly/failures"] == 3.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # the first failure of each kind, the rest only counted
    assert any("the call's process died" in w for w in warnings)
    assert any("KeyboardInterrupt" in w for w in warnings)
    relayed = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert "[reward worker 0] hello from the reward 1" in relayed
    assert "[reward worker 0] from a shell" in relayed
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "hello from the reward" not in out + err


def test_a_worker_holds_only_its_channel_and_output(hostile, caplog):
    """A call's box holds 0: /dev/null; 1 and 2: its output pipe (the supervisor counts and
    relays what comes through it); above 100, close-on-exec: its socket to the supervisor.
    Nothing else: not the trainer's channel, not another box's descriptors (the zygote
    forks boxes in batches, each holding the others' until it closes them)."""
    with caplog.at_level(logging.INFO), RewardPool(cfg(hostile, "descriptors")) as pool:
        samples = make_samples(["a"])
        pool.score(samples)
    (line,) = [r.getMessage() for r in caplog.records if "held" in r.getMessage()]
    held = dict(ast.literal_eval(line.partition("held ")[2]))
    assert samples[0].reward == 4.0 and held[0] == "/dev/null"
    assert held[1] == held[2] and held[1].startswith("pipe:")  # relayed to the log
    high = sorted(fd for fd in held if fd > 2)
    assert len(high) == 1 and min(high) >= 100 and held[high[0]].startswith("socket:")


def test_a_call_timed_out_mid_import_leaves_nothing_to_the_next_call(hostile, caplog, monkeypatch):
    """Each call is a box forked from the zygote: a module half-imported by a stopped call
    is gone with its box; the worker lives on and the next call imports it afresh."""
    slow = hostile.parent / "slow_module_for_leangrpo_tests.py"
    slow.write_text("import time\nVALUE = 1.0\ntime.sleep(30)\n")
    monkeypatch.syspath_prepend(str(hostile.parent))  # the workers inherit sys.path
    with (
        caplog.at_level(logging.WARNING),
        RewardPool(cfg(hostile, "late_import", timeout_s=1.0)) as pool,
    ):
        first = pool._workers[0].pid
        samples = make_samples(["a"])
        pool.score(samples)
        assert samples[0].reward is None
        slow.write_text("VALUE = 2.0\n")
        again = make_samples(["a"])
        pool.score(again)
        assert again[0].reward == 2.0 and pool._workers[0].pid == first
    (message,) = [r.getMessage() for r in caplog.records if "late_import" in r.getMessage()]
    assert "timed out after 1 s while importing slow_module_for_leangrpo_tests" in message


def test_a_worker_closing_its_output_does_not_spin_the_pool(hostile, monkeypatch):
    with RewardPool(cfg(hostile, "mute")) as pool:
        waits = []
        wait_once = pool._wait_and_handle
        monkeypatch.setattr(pool, "_wait_and_handle", lambda run: waits.append(1) or wait_once(run))
        for _ in range(2):
            samples = make_samples(["a"])
            pool.score(samples)
            assert samples[0].reward == 1.0
    assert len(waits) < 50  # a wake-up per event, not a busy loop on the closed pipe


def _left(mark):
    """Live processes whose command line holds `mark`."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["status"] != psutil.STATUS_ZOMBIE and any(mark in a for a in cmdline):
            found.append((proc.pid, cmdline))
    return found


def test_processes_a_reward_starts_die_with_its_call_or_worker(hostile, marks):
    with RewardPool(cfg(hostile, "spawner", timeout_s=5.0)) as pool:  # "background" returns at once
        samples = make_samples(["background"])
        pool.score(samples)  # returns at once: what it started ends with the call (issue 27)
        assert samples[0].reward == 1.0 and _left(marks + "3") == []
        pool.score(make_samples(["soft"]))  # the worker's own limit kills what the call started
        assert _left(marks + "1") == []
        pool.score(make_samples(["hard"]))  # the trainer kills the worker's whole tree
        assert _left(marks + "2") == []
    assert _left(marks) == []


def test_close_during_a_sleeping_reward_returns_promptly(hostile):
    pool = RewardPool(cfg(hostile, "sleeper", timeout_s=30.0))
    raised: list[BaseException] = []

    def score() -> None:
        try:
            pool.score(make_samples(["a"]))
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=score)
    thread.start()
    for _ in range(200):  # until the call is in flight
        if pool._workers and pool._workers[0].task is not None:
            break
        time.sleep(0.05)
    t0 = time.monotonic()
    pool.close()
    thread.join(timeout=25.0)
    assert time.monotonic() - t0 < 20.0  # a liveness bound: the pool's timeout is 30 s
    assert not thread.is_alive() and isinstance(raised[0], PoolClosedError)


def test_memory_and_cpu_limits_fail_the_call(hostile, caplog):
    limits = {"memory_limit_mb": 1024, "cpu_time_limit_s": 1.0}
    with (
        caplog.at_level(logging.WARNING),
        RewardPool(cfg(hostile, "hog", timeout_s=120.0, **limits)) as pool,
    ):
        samples = make_samples(["alloc", "spin", "fine"])
        metrics = pool.score(samples)
    assert [s.reward for s in samples] == [None, None, 1.0]
    assert metrics["reward/hog/failures"] == 2.0
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "MemoryError" in text and "used its CPU time after 1 s" in text


FORGED = {
    "count": {"t": "result", "values": [0.0, 0.0], "errors": []},
    "wrong length": {"t": "error", "kind": "wrong length", "msg": "returned 7 values"},
    "timeout": {"t": "error", "kind": "timeout", "msg": "timed out after 5 s"},
    "box died": {"t": "error", "kind": "box died", "msg": "not this box's to say"},
    "errors": {"t": "result", "values": [1.0], "errors": [[3, "timeout", "x"]]},
}


@pytest.mark.parametrize("forgery", sorted(FORGED))
def test_a_forged_reply_fails_its_own_call_only_never_its_neighbours(hostile, forgery):
    """The program a reward runs sends its box's reply itself: a count that does not fit
    the call, a kind the pool acts on ("wrong length" once stopped the run, "timeout"
    counts toward giving the function up), errors at no sample of the call. Its own
    sample fails (counted as nothing the supervisor did not see); the calls beside it in
    the worker, and the run, go on."""
    import json

    texts = ["honest", json.dumps(FORGED[forgery]), "honest", "honest", "honest"]
    with RewardPool(cfg(hostile, "forger", timeout_s=20.0, calls_per_worker=2)) as pool:
        samples = make_samples(texts)
        metrics = pool.score(samples)
        assert [s.reward for s in samples] == [1.0, None, 1.0, 1.0, 1.0]
        assert metrics["reward/forger/failures"] == 1.0
        assert metrics["reward/forger/timeouts"] == 0.0
        again = make_samples(["honest", "honest"])
        pool.score(again)  # the worker is still whole
        assert [s.reward for s in again] == [1.0, 1.0]


def test_calls_side_by_side_do_not_share_a_loopback(hostile):
    """Two prompts' calls run side by side in one worker: one listens on 127.0.0.1, the
    other connects there. Each box has a network namespace of its own (or the worker runs
    them one at a time): the connect finds nobody."""
    with RewardPool(cfg(hostile, "loopback", timeout_s=20.0, calls_per_worker=2)) as pool:
        samples = make_samples(["listen", "connect"])
        pool.score(samples)
    assert [s.reward for s in samples] == [0.0, 0.0]
