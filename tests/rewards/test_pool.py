"""RewardPool: scoring in worker processes, failure isolation, time limits, fail_fast,
wrong-length returns and systematic failures stopping the run, close."""

from __future__ import annotations

import math
import re
import textwrap
import threading
import time

import pytest
from support.configs import rewards_section

from leangrpo.contracts import Completion, Prompt, RolloutSample
from leangrpo.errors import is_user_error
from leangrpo.rewards import RewardError, RewardFailedError, RewardPool, RewardSpecError

USER_CODE = textwrap.dedent(
    """
    import signal
    import time

    def flaky(prompts, completions, **columns):
        for c in completions:
            if "boom" in c:
                raise ValueError("boom here")
        return [1.0] * len(completions)

    def slow(prompts, completions, **columns):  # interruptible: the worker's own limit stops it
        if any("sleep" in c for c in completions):
            time.sleep(60)
        return [0.5] * len(completions)

    def stuck(prompts, completions, **columns):  # deaf to the soft limit: must be killed
        if any("stuck" in c for c in completions):
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
            time.sleep(60)
        return [0.25] * len(completions)

    def bad_type(prompts, completions, **columns):
        return ["high" if "bad" in c else 1.0 for c in completions]

    def wrong_length(prompts, completions, **columns):
        return [1.0] * (len(completions) + 1)

    def strings(prompts, completions, **columns):
        return ["yes" for c in completions]

    def nans(prompts, completions, **columns):
        return [float("nan") for c in completions]

    def scalar(prompts, completions, **columns):
        return 1.0

    def needs_column(prompts, completions, **columns):
        return [float(a == c) for a, c in zip(columns["solution"], completions)]

    def strings_or_keyerror(prompts, completions, **columns):
        if len(completions) == 1 and completions[0] == "a":
            raise KeyError("solution")
        return ["yes" for c in completions]

    def echo_level(prompts, completions, level, scale=1.0, **columns):
        return [scale * lv for lv in level]

    def meet(prompts, completions, meeting, **columns):  # scores only beside its partner
        import os
        mine = os.path.join(meeting[0], completions[0])
        partner = os.path.join(meeting[0], "b" if completions[0] == "a" else "a")
        open(mine, "w").close()
        deadline = time.monotonic() + 30  # a hang guard: alone, it never meets
        while not os.path.exists(partner) and time.monotonic() < deadline:
            time.sleep(0.01)
        print("met" if os.path.exists(partner) else "alone", completions[0], "x" * 5000)
        return [float(os.path.exists(partner))]

    def nap(prompts, completions, **columns):
        time.sleep(1.0)
        return [0.75] * len(completions)
    """
)


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "user_rewards.py"
    path.write_text(USER_CODE)
    return path


def cfg(*functions, timeout_s=5.0, num_workers=2, fail_fast=False, **fields):
    """functions: (name, weight, kwargs) triples; the time limit is many times what a
    call here takes, on a loaded machine too (the slow ones sleep 60 s)."""
    return rewards_section(
        *functions, timeout_s=timeout_s, num_workers=num_workers, fail_fast=fail_fast, **fields
    )


def make_samples(texts, answer="42", prompt=None):
    """One prompt per sample, or all of prompt `prompt` (one call: calls never mix prompts)."""
    return [
        RolloutSample(
            group_id=i // 2 if prompt is None else prompt,
            prompt=Prompt(
                uid=i if prompt is None else prompt,
                text=f"question {i}",
                ids=[1],
                columns={"answer": answer, "level": i},
            ),
            completion=Completion(ids=[1], text=t, logprobs=[0.0], finish_reason="stop", version=0),
        )
        for i, t in enumerate(texts)
    ]


def test_pool_isolates_errors_and_time_limits(user_module):
    f = f"{user_module}:"
    functions = [
        ("length", 1.0, {"target": 5}),
        (f + "flaky", 1.0, {}),
        (f + "slow", 0.5, {}),
        (f + "stuck", 0.0, {}),  # weight 0: reported, but its None does not unscore a sample
        (f + "bad_type", 0.0, {}),
    ]
    texts = ["so 42", "boom!", "sleep", "stuck", "bad 4", "far too long"]  # 5 chars but the last
    with RewardPool(cfg(*functions)) as pool:
        samples = make_samples(texts)
        metrics = pool.score(samples)
        table = [[s.rewards[k] for k in pool.keys] for s in samples]
        assert table == [
            [1.0, 1.0, 0.5, 0.25, 1.0],
            [1.0, None, 0.5, 0.25, 1.0],
            [1.0, 1.0, None, 0.25, 1.0],
            [1.0, 1.0, 0.5, None, 1.0],
            [1.0, 1.0, 0.5, 0.25, None],
            [0.0, 1.0, 0.5, 0.25, 1.0],
        ]
        totals = [s.reward for s in samples]
        assert totals == [2.25, None, None, 2.25, 2.25, 1.25]
        scored = [2.25, 2.25, 2.25, 1.25]
        mean = sum(scored) / 4
        assert metrics["reward/mean"] == pytest.approx(mean)
        assert metrics["reward/std"] == pytest.approx(
            math.sqrt(sum((r - mean) ** 2 for r in scored) / 4)
        )
        assert metrics["reward/length/mean"] == pytest.approx(5 / 6)
        assert metrics["reward/slow/mean"] == pytest.approx(0.5)
        for key in ("flaky", "slow", "stuck", "bad_type"):
            assert metrics[f"reward/{key}/failures"] == 1.0
        assert metrics["reward/length/failures"] == 0.0
        assert metrics["reward/failures"] == 4.0 and metrics["reward/unscored"] == 2.0

        again = make_samples(["so 42", "yes 4"])  # the killed worker was replaced
        metrics = pool.score(again)
        assert [s.reward for s in again] == [2.25, 2.25]
        assert metrics["reward/failures"] == 0.0
        procs = [w.proc for w in pool._workers]
    assert all(p.poll() is not None for p in procs)  # closed: no worker left running


def test_columns_kwargs_and_module_form(user_module, monkeypatch):
    monkeypatch.syspath_prepend(str(user_module.parent))  # the worker inherits sys.path
    functions = [
        ("user_rewards:echo_level", 1.0, {"scale": 2.0}),
        ("format", 1.0, {"pattern": r"^\d+$", "mode": "fullmatch"}),
        ("math", 1.0, {}),
    ]
    pool = RewardPool(cfg(*functions, timeout_s=5.0, num_workers=1))
    try:
        samples = make_samples(["42", "x", r"\boxed{41}"])
        pool.score(samples)
        assert [s.rewards for s in samples] == [
            {"echo_level": 0.0, "format": 1.0, "math": 1.0},
            {"echo_level": 2.0, "format": 0.0, "math": 0.0},
            {"echo_level": 4.0, "format": 0.0, "math": 0.0},
        ]
        pool._seconds_per_sample = [pool.timeout_s, None, None]  # 1 timeout per sample ...
        assert pool._chunk_sizes(64) == [1, 16, 16]  # ... is sent one sample per call
        pool._seconds_per_sample = [pool.timeout_s, 1e-4, None]  # a measured fast function
        assert pool._chunk_sizes(64) == [1, 64, 16]  # ... one round trip per worker
    finally:
        pool.close()
    with pytest.raises(RewardError, match="closed"):
        pool.score(samples)


def test_fail_fast_is_one_sentence_naming_function_sample_and_error(user_module):
    f = f"{user_module}:"
    functions = [(f + "flaky", 1.0, {}), (f + "bad_type", 1.0, {})]
    with RewardPool(cfg(*functions, timeout_s=5.0, fail_fast=True)) as pool:
        with pytest.raises(RewardFailedError) as err:
            pool.score(make_samples(["ok", "ok", "boom", "ok"]))
        text = str(err.value)
        assert re.match(
            r"reward 'flaky' failed on sample 2 \(prompt uid 2\): ValueError: boom here", text
        )
        assert is_user_error(err.value) and "\n" not in text  # the CLI's one line
        with pytest.raises(
            RewardFailedError,
            match=r"reward 'bad_type' failed on sample 1 .*: returned 'high' \(str\)",
        ):
            pool.score(make_samples(["ok", "bad"]))
        samples = make_samples(["ok", "fine"])
        pool.score(samples)  # still usable after raising
        assert [s.reward for s in samples] == [2.0, 2.0]


def test_a_list_of_the_wrong_length_fails_its_call_and_stops_the_run_when_systematic(
    user_module,
):
    """A user function's calls hold one sample each (its own box): `[1.0]` fits them, a
    list of two does not. A box's reply can be forged by the program a reward runs, so no
    reply stops the run on its own: each such call fails (counted), and a function that
    does it on every sample of 2 or more prompts is stopped after the batch."""
    name = "wrong_length"
    with RewardPool(cfg((f"{user_module}:{name}", 1.0, {}), timeout_s=5.0, num_workers=1)) as pool:
        samples = make_samples(["a", "b"], prompt=0)  # one prompt: maybe its data row
        assert pool.score(samples)[f"reward/{name}/failures"] == 2.0
        with pytest.raises(RewardFailedError) as err:
            pool.score(make_samples(["a", "b", "c", "d"]))
        text = str(err.value)
        assert text.startswith(
            f"reward '{name}' failed on all 4 samples of a batch the same way (returned 2 "
            "values for 1 samples; return a list of 1)"
        ), text
        assert "returns one reward per completion" in text and "\n" not in text
        assert is_user_error(err.value)


SYSTEMATIC = {  # function -> what the sentence names
    "strings": r"\(returned 'yes' \(str\); return a float or None per sample\); fix it",
    "nans": r"\(returned nan; rewards must be finite \(or None\)\); fix it",
    "scalar": r"\(returned a float for 1 samples; return a list of 1\); fix it",
    "needs_column": r"\(KeyError: 'solution'\); fix the error it raises",
}


@pytest.mark.parametrize("name", sorted(SYSTEMATIC))
def test_a_function_failing_on_every_sample_the_same_way_stops_after_that_batch(
    user_module, name
):
    pool = RewardPool(cfg((f"{user_module}:{name}", 1.0, {}), timeout_s=5.0))
    with pool, pytest.raises(RewardFailedError) as err:
        pool.score(make_samples(["a", "b", "c"]))
    text = str(err.value)
    assert text.startswith(f"reward '{name}' failed on all 3 samples of a batch the same way ")
    assert re.search(SYSTEMATIC[name], text), text
    assert text.endswith("or set rewards.systematic_failures: warn to go on with such samples unscored")


def test_systematic_failures_warn_leaves_samples_unscored_and_says_so_once(user_module, caplog):
    import logging

    functions = [(f"{user_module}:strings", 1.0, {}), ("length", 1.0, {"target": 1})]
    pool = RewardPool(cfg(*functions, timeout_s=5.0, systematic_failures="warn"))
    with pool, caplog.at_level(logging.WARNING, logger="leangrpo.rewards"):
        for _ in range(2):
            samples = make_samples(["a", "b"])
            metrics = pool.score(samples)
            assert [s.reward for s in samples] == [None, None]
            assert metrics["reward/strings/failures"] == 2.0
    said = [r.getMessage() for r in caplog.records if "the same way" in r.getMessage()]
    assert said == [
        "reward 'strings' failed on all 2 samples of a batch the same way (returned 'yes' "
        "(str); return a float or None per sample); they are unscored "
        "(rewards.systematic_failures: warn)"
    ]


def test_failures_of_several_ways_or_of_the_moment_do_not_stop_the_run(user_module):
    """Mixed failures (the chunk's bad values, then a KeyError on one sample), a single
    sample, and timeouts on every sample: unscored samples, no stop."""
    f = f"{user_module}:"
    with RewardPool(cfg((f + "strings_or_keyerror", 1.0, {}), timeout_s=5.0)) as pool:
        samples = make_samples(["a", "b"])
        pool.score(samples)  # per sample: KeyError on "a", a string on "b"
        assert [s.reward for s in samples] == [None, None]
    with RewardPool(cfg((f + "strings", 1.0, {}), timeout_s=5.0)) as pool:
        samples = make_samples(["a"])
        pool.score(samples)
        assert samples[0].reward is None
    with RewardPool(cfg((f + "slow", 1.0, {}), timeout_s=0.5)) as pool:
        samples = make_samples(["sleep", "sleep"])
        metrics = pool.score(samples)
        assert [s.reward for s in samples] == [None, None] and metrics["reward/failures"] == 2


def test_a_scorings_calls_reach_a_worker_in_one_message_and_run_side_by_side(
    user_module, tmp_path, caplog
):
    """Issue 36's cost: a call per prompt was a round trip of its own, one box after the
    other. Now one message carries a worker's share of a scoring, its supervisor runs the
    calls side by side, each in its box (two calls that score only while both run: `meet`),
    and answers each as it ends: the one that times out fails alone. Their output reaches
    the log in whole lines."""
    f = f"{user_module}:"
    functions = [(f + "meet", 1.0, {}), (f + "slow", 1.0, {})]
    config = cfg(*functions, timeout_s=60.0, num_workers=1, calls_per_worker=2,
                 sandbox={"level": "process"})  # fmt: skip
    samples = make_samples(["a", "b"])
    for sample in samples:
        sample.prompt.columns["meeting"] = str(tmp_path)
    with caplog.at_level("INFO", logger="leangrpo.rewards"), RewardPool(config) as pool:
        worker = pool._workers[0]
        sent: list = []
        send = worker.send
        worker.send = lambda message: (sent.append(message[0]), send(message))[1]
        metrics = pool.score(samples)
    assert sent == ["calls"] and pool._calls_run == 4  # 2 functions x 2 prompts, one message
    assert [s.rewards for s in samples] == [{"meet": 1.0, "slow": 0.5}] * 2, metrics
    lines = [r.getMessage() for r in caplog.records if "met " in r.getMessage()]
    assert sorted(line.split()[4] for line in lines) == ["a", "b"], lines  # whole lines
    with RewardPool(cfg((f + "slow", 1.0, {}), timeout_s=0.5, num_workers=1,
                        calls_per_worker=2)) as pool:  # fmt: skip
        samples = make_samples(["sleep", "a", "b", "c"])
        metrics = pool.score(samples)
    assert [s.reward for s in samples] == [None, 0.5, 0.5, 0.5]
    assert metrics["reward/slow/timeouts"] == 1 and metrics["reward/slow/failures"] == 1


def test_a_worker_that_breaks_mid_scoring_sends_its_calls_again_once(user_module):
    """The supervisor runs no user code, so a worker that breaks while its calls run (here:
    killed from outside) is not their doing: they are sent again, to its replacement. A
    call whose worker breaks a second time fails as "worker died"."""
    f = f"{user_module}:nap"

    def kill_workers(pool: RewardPool, times: int) -> threading.Thread:
        def run() -> None:
            killed: set[int] = set()
            deadline = time.monotonic() + 120  # a hang guard
            while len(killed) < times and time.monotonic() < deadline:
                worker = pool._workers[0] if pool._workers else None
                if worker is not None and worker.calls and worker.pid not in killed:
                    time.sleep(0.2)  # its calls are running in their boxes
                    killed.add(worker.pid)
                    worker.terminate()
                time.sleep(0.01)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    with RewardPool(cfg((f, 1.0, {}), timeout_s=30.0, num_workers=1)) as pool:
        first = pool._workers[0].pid
        samples = make_samples(["a", "b"])
        killer = kill_workers(pool, 1)
        metrics = pool.score(samples)
        killer.join()
        assert pool._workers[0].pid != first
        assert [s.reward for s in samples] == [0.75, 0.75] and metrics["reward/failures"] == 0
        samples = make_samples(["a", "b"])
        killer = kill_workers(pool, 2)
        metrics = pool.score(samples)
        killer.join()
    assert [s.reward for s in samples] == [None, None] and metrics["reward/nap/failures"] == 2


def test_a_function_that_times_out_on_every_call_is_not_retried_sample_by_sample(user_module):
    """bad_reward_always_timeout_slow.sh: a chunk that timed out was retried one sample per
    call, each its own timeout (17 calls of timeout_s for 16 samples), on every batch. Now
    after 2 samples alone time out (a user function's calls hold one sample each), none of
    its calls having returned, the rest fail as timed out without a call; a slow sample
    among fast ones is still found."""
    f = f"{user_module}:slow"
    one_at_a_time = {"num_workers": 1, "calls_per_worker": 1}
    with RewardPool(cfg((f, 1.0, {}), timeout_s=0.5, **one_at_a_time)) as pool:
        samples = make_samples(["sleep"] * 16, prompt=0)
        metrics = pool.score(samples)
        assert pool._calls_run == 2  # 2 samples alone (not 16): the rest cancelled
    assert all(s.reward is None for s in samples)
    assert metrics["reward/slow/timeouts"] == 16 and metrics["reward/slow/failures"] == 16
    with RewardPool(cfg((f, 1.0, {}), timeout_s=0.5, num_workers=1)) as pool:
        samples = make_samples(["sleep", "a", "b", "c", "d"])
        metrics = pool.score(samples)
    assert [s.reward for s in samples] == [None, 0.5, 0.5, 0.5, 0.5]
    assert metrics["reward/slow/timeouts"] == 1


def test_a_function_timing_out_on_every_prompt_is_given_up_on_after_half_the_prompts(
    user_module,
):
    """With 4 prompts' samples queued, the function is given up on after 2 calls on each
    of 2 prompts (a user function's calls hold one sample each), not one per sample."""
    f = f"{user_module}:slow"
    samples = [s for p in range(4) for s in make_samples(["sleep"] * 4, prompt=p)]
    with RewardPool(cfg((f, 1.0, {}), timeout_s=0.5, num_workers=1, calls_per_worker=1)) as pool:
        metrics = pool.score(samples)
        assert pool._calls_run == 4
    assert all(s.reward is None for s in samples)
    assert metrics["reward/slow/timeouts"] == 16


@pytest.mark.parametrize("same_prompt", [True, False])
def test_two_looping_samples_leave_the_other_prompts_scored(user_module, same_prompt):
    """Two samples that time out, run first and side by side, were taken for a function
    that always times out: the pool gave it up for the batch and cancelled the other
    prompts' calls, which never started. They are a prompt's own: the rest are scored."""
    loopers = (
        make_samples(["sleep", "sleep"], prompt=98)
        if same_prompt
        else make_samples(["sleep"], prompt=98) + make_samples(["sleep"], prompt=99)
    )
    samples = loopers + make_samples(["a", "b", "c", "d"])
    config = cfg((f"{user_module}:slow", 1.0, {}), timeout_s=0.5, num_workers=1,
                 calls_per_worker=2)  # fmt: skip
    with RewardPool(config) as pool:
        metrics = pool.score(samples)
    assert [s.reward for s in samples] == [None, None, 0.5, 0.5, 0.5, 0.5]
    assert metrics["reward/slow/timeouts"] == 2


def test_startup_timeout_bounds_a_built_in_workers_start_too():
    """rewards.startup_timeout_s 'had no effect on a built-in': it bounds the wait for a
    worker that scoring needs (math's: a sandboxed process and math-verify's warm-up, far
    over 10 ms), and its sentence named "importing module ''" for a built-in."""
    from leangrpo.rewards import RewardSpecError

    quick = cfg(("math", 1.0, {}), num_workers=1, startup_timeout_s=0.01)
    with RewardPool(quick) as pool, pytest.raises(RewardSpecError) as err:
        pool.score(make_samples(["42", "41"]))
    message = str(err.value)
    assert message.startswith("rewards.functions[0].name = 'math': starting its worker")
    assert "did not finish within 0.01 s; raise rewards.startup_timeout_s" in message
    assert "module ''" not in message


def test_one_prompts_group_failing_the_same_way_does_not_stop_the_run(user_module):
    """A scoring batch of one prompt's group (a streamed chunk of one group, a torchrun
    rank's share) failing alike may be that prompt's data row, not the function: its
    samples are unscored and the run goes on; two prompts failing alike stop it."""
    f = f"{user_module}:needs_column"

    def group(uid, size=3):
        return [
            RolloutSample(
                group_id=uid,
                prompt=Prompt(uid=uid, text="q", ids=[1], columns={"answer": "42"}),
                completion=Completion(
                    ids=[1], text="a", logprobs=[0.0], finish_reason="stop", version=0
                ),
            )
            for _ in range(size)
        ]

    with RewardPool(cfg((f, 1.0, {}), timeout_s=5.0)) as pool:
        samples = group(7)
        metrics = pool.score(samples)
        assert [s.reward for s in samples] == [None] * 3
        assert metrics["reward/needs_column/failures"] == 3.0
        with pytest.raises(RewardFailedError, match="failed on all 6 samples of a batch"):
            pool.score(group(8) + group(9))


def test_bad_names_fail_before_any_worker_starts_or_at_worker_start_up(monkeypatch):
    import leangrpo.rewards.pool as pool_module

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker was started")

    with monkeypatch.context() as m:
        m.setattr(pool_module, "WorkerProcess", no_workers)
        with pytest.raises(RewardSpecError, match=r"rewards.functions\[0\].name = 'no name'"):
            RewardPool(cfg(("no name", 1.0, {})))
    pool = RewardPool(cfg(("nope_xyz:fn", 1.0, {}), num_workers=1))  # found by importing
    with pytest.raises(
        RewardSpecError,
        match=r"rewards.functions\[0\].name = 'nope_xyz:fn': module 'nope_xyz' not found",
    ):
        pool.score(make_samples(["a"]))
    assert pool._closed


def test_a_reward_file_imports_a_module_beside_it(tmp_path):
    """The file's own folder is on its import path in the check and in the scoring worker
    (as under `python file.py`): `import helper` works, without PYTHONPATH."""
    folder = tmp_path / "my_rewards"
    folder.mkdir()
    (folder / "scoring_helper.py").write_text("def score(text):\n    return float(len(text))\n")
    (folder / "reward.py").write_text(
        "import scoring_helper\n\n"
        "def by_length(prompts, completions, **columns):\n"
        "    return [scoring_helper.score(c) for c in completions]\n"
    )
    from leangrpo.rewards import check_rewards

    name = f"{folder / 'reward.py'}:by_length"
    assert [s.key for s in check_rewards(rewards_section(name))] == ["by_length"]
    with RewardPool(cfg((name, 1.0, {}), timeout_s=5.0, num_workers=1)) as pool:
        samples = make_samples(["ab", "abcd"])
        pool.score(samples)
    assert [s.reward for s in samples] == [2.0, 4.0]
