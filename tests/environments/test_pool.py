"""Environment workers (environments/pool.py, worker.py): sessions pinned to workers, one
item per trajectory, limits per call; environments and tools that fail, hang or exit end
their own trajectory (or become a tool's error message), never the trainer; set-up
failures are one line."""

from __future__ import annotations

import time

import pytest
from support.hostile_tools import hermes

from leangrpo.config.environment import EnvironmentConfig
from leangrpo.environments.pool import EnvironmentPool, PoolClosed
from leangrpo.environments.registry import EnvironmentSpecError

USER = [{"role": "user", "content": "1+2="}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


def pool_for(name: str, **fields) -> EnvironmentPool:
    # limits many times what a call here takes, on a loaded machine too (a test whose limit
    # must fire gives its own, against an environment or tool that sleeps far longer)
    fields = {"num_workers": 1, "timeout_s": 10.0, "tool_timeout_s": 5.0, **fields}
    return EnvironmentPool(EnvironmentConfig(name=name, **fields))


def test_a_trajectory_is_reset_stepped_and_finished_in_its_session():
    with pool_for("support.environments:Again", kwargs={"turns": 2}, num_workers=2) as pool:
        keys = pool.new_sessions(3)
        resets = pool.reset([(k, USER, {"answer": "3"}, 7) for k in keys])
        assert [o.ok for o in resets] == [{"messages": None}] * 3
        first = pool.step([(k, f"turn of {k}", 0) for k in keys])
        for k, o in zip(keys, first):
            assert o.ok["reply"] == [{"role": "user", "content": "again"}] and not o.ok["done"]
            assert o.ok["rewards"] == {"per_turn": 0.25}
            assert o.ok["metrics"] == {"chars": len(f"turn of {k}")}
        second = pool.step([(k, "x", 1) for k in keys[:2]])  # one trajectory ended earlier
        assert [o.ok["done"] for o in second] == [True, True]
        ends = pool.finish([(keys[0], "stop"), (keys[1], "stop"), (keys[2], "length")])
        assert [o.ok["rewards"] for o in ends] == [{"final": 1.0}, {"final": 1.0}, {"final": 0.0}]
        gone = pool.step([(keys[0], "x", 2)])[0]  # finish ended the session
        assert gone.ok is None and "no such trajectory" in gone.error


def test_the_tools_environment_answers_calls_with_tool_messages_and_counts_them():
    tools = ["support.environments:add", "support.environments:nap", "support.environments:divide"]
    with pool_for("tools", tools=tools) as pool:
        assert [t["function"]["name"] for t in pool.tools] == ["add", "nap", "divide"]
        assert pool.tools[0]["function"]["parameters"]["required"] == ["a", "b"]
        assert pool.replies == ["tool"]
        keys = pool.new_sessions(5)
        pool.reset([(k, USER, {}, 0) for k in keys])
        t0 = time.monotonic()
        out = pool.step(
            [
                (keys[0], CALL, 0),
                (keys[1], "3", 0),  # no call: the answer
                (keys[2], '<tool_call>{"name": "nap", "arguments": {"seconds": 60}}</tool_call>', 0),
                (keys[3], '<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>'
                          '<tool_call>{"name": "mul", "arguments": {}}</tool_call><tool_call>{"na', 0),
                (keys[4], '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', 0),
            ]
        )  # fmt: skip
        assert time.monotonic() - t0 < 30  # the tool napping 60 s was stopped at its limit
        assert out[0].ok["reply"] == [{"role": "tool", "name": "add", "content": "3"}]
        assert out[0].ok["calls"] == [{"name": "add", "arguments": {"a": 1, "b": 2}}]
        assert out[0].ok["counts"] == {"tool_calls": 1, "tool_calls/add": 1}
        assert out[1].ok["done"] and out[1].ok["reply"] == []
        assert out[2].ok["reply"][0]["content"] == "error: the tool timed out after 5 s"
        assert out[2].ok["counts"]["tool_errors/nap"] == 1 and not out[2].ok["done"]
        assert [m["content"] for m in out[3].ok["reply"]] == [
            "error: unclosed <tool_call> block",
            "error: ZeroDivisionError: division by zero",
            "error: unknown tool 'mul'; tools: add, nap, divide",
        ]
        assert out[3].ok["counts"]["tool_errors"] == 3 and out[3].ok["counts"]["parse_errors"] == 1
        assert out[3].ok["counts"]["tool_errors/<unknown>"] == 1  # not a metric named by the model
        assert "missing 1 required positional argument: 'b'" in out[4].ok["reply"][0]["content"]
        again = pool.step([(keys[2], CALL, 1)])[0]  # the worker and the session live on
        assert again.ok["reply"][0]["content"] == "3"


def test_malformed_calls_and_a_failing_parser_become_tool_messages_and_the_trajectory_goes_on():
    """Model-written calls json rejects with ValueError or RecursionError, or holding NaN,
    and a pluggable parser raising on a turn: each is an `error: ...` tool message, counted
    (the item does not fail, the session lives on)."""
    bad = {
        "big int": '{"a": ' + "9" * 5000 + ', "b": 1}',
        "deep": '{"a": ' + "[" * 20000 + "]" * 20000 + "}",
        "NaN": '{"a": NaN, "b": 1}',
    }
    with pool_for("tools", tools=["support.environments:add"]) as pool:
        keys = pool.new_sessions(len(bad))
        pool.reset([(k, USER, {}, 0) for k in keys])
        turns = [f'<tool_call>{{"name": "add", "arguments": {a}}}</tool_call>' for a in bad.values()]
        out = pool.step([(k, text, 0) for k, text in zip(keys, turns)])
        for o in out:
            assert o.error is None and not o.ok["done"]
            assert o.ok["reply"][0]["content"].startswith("error: tool call ")
            assert o.ok["counts"] == {"tool_errors": 1, "parse_errors": 1}
        assert [o.ok["reply"][0]["content"] for o in pool.step([(keys[0], CALL, 1)])] == ["3"]
    with pool_for("tools", tools=["support.environments:add"], tool_parser="support.environments:picky_parser") as pool:
        (key,) = pool.new_sessions(1)
        pool.reset([(key, USER, {}, 0)])
        (out,) = pool.step([(key, "boom", 0)])
        assert out.ok["reply"] == [{"role": "tool", "content": "error: the tool parser failed on this turn: picky_parser: ValueError: cannot read boom"}]  # fmt: skip
        assert out.ok["counts"]["parse_errors"] == 1 and not out.ok["done"]


def test_an_environment_that_times_out_or_raises_ends_only_its_trajectory():
    with pool_for("support.environments:Slow", timeout_s=0.5) as pool:
        (key,) = pool.new_sessions(1)
        pool.reset([(key, USER, {}, 0)])
        t0 = time.monotonic()
        (out,) = pool.step([(key, "x", 0)])
        assert time.monotonic() - t0 < 20  # Slow.step sleeps 30 s
        assert out.ok is None and "Slow.step: timeout: timed out after 0.5 s" in out.error
    with pool_for("support.environments:BadReset") as pool:
        outs = pool.reset([(k, USER, {"answer": "7"}, 0) for k in pool.new_sessions(2)])
        assert all(o.ok is None and "ValueError: no puzzle for 7" in o.error for o in outs)


def test_a_trajectory_whose_process_dies_fails_alone():
    """Each trajectory is a box of its own: one that exits ends only itself; the worker
    and the other trajectories it holds go on."""
    with pool_for("support.environments:ExitInStep", num_workers=2) as pool:
        keys = pool.new_sessions(4)  # workers 0 and 1 hold keys 0, 2 and 1, 3
        answers = ["3", "4", "5", "6"]  # the trajectory of key 0 exits in its step
        pool.reset([(k, USER, {"answer": a}, 0) for k, a in zip(keys, answers)])
        workers = [w.pid for w in pool._workers]
        out = pool.step([(k, "x", 0) for k in keys])
        assert out[0].ok is None and "the call's process died (exit code 7)" in out[0].error
        assert out[2].ok["done"]  # its neighbour on the same worker
        assert out[1].ok["done"] and out[3].ok["done"]  # the other worker's
        assert [w.pid for w in pool._workers] == workers  # no worker replaced
        fresh = pool.new_sessions(1)[0]
        assert pool.reset([(fresh, USER, {"answer": "1"}, 0)])[0].ok == {"messages": None}


@pytest.mark.parametrize(
    ("name", "fields", "expected"),
    [
        ("support.environments:Nothing", {}, "has no attribute 'Nothing'"),
        ("support.no_such_module:Env", {}, "module 'support.no_such_module' not found"),
        ("support.environments:NeedsArgument", {}, "building it with environment.kwargs failed"),
        ("tools", {"tools": ["support.environments:undocumented"]}, "tool undocumented cannot be offered to the model"),
        ("support.environments:Again", {"tool_parser": "support.environments:missing"}, "environment.tool_parser = 'support.environments:missing'"),
        ("support.environments:NotAnEnvironment", {}, "environment.name = 'support.environments:NotAnEnvironment' is the class NotAnEnvironment, not a subclass of leangrpo.environments.Environment; subclass it"),
        ("support.environments:add", {}, "is a function, not a subclass of leangrpo.environments.Environment"),
        ("tools", {"tools": ["support.environments:Adder"]}, "environment.tools[0] = 'support.environments:Adder' is the class Adder, not a function"),
        ("tools", {"tools": ["support.environments:__doc__"]}, "environment.tools[0] = 'support.environments:__doc__': 'support.environments:__doc__' is a str, not a function"),
        ("tools", {"tools": ["support.environments:add", "support.environments:divide", "DUP:add"]}, "environment.tools[2] = 'DUP:add' and environment.tools[0] = 'support.environments:add' are both named 'add'; the model calls tools by name"),
        ("support.environments:AddTwice", {"tools": ["support.environments:add"]}, "environment.tools[0] = 'support.environments:add' and AddTwice.tools[0] are both named 'add'; the model calls tools by name"),
    ],
)  # fmt: skip
def test_set_up_failures_are_one_line(name, fields, expected, tmp_path):
    """Each way an environment, a tool or the parser cannot be used is one sentence: a
    class that is not an Environment (it failed later with an AttributeError), a class or
    any other non-function given as a tool (a class was offered as one), two tools with
    one name (one silently shadowed the other)."""
    dup = tmp_path / "dup.py"
    dup.write_text('def add(a: int) -> int:\n    """Add.\n\n    Args:\n        a: A.\n    """\n    return a\n')
    if "tools" in fields:
        fields = {**fields, "tools": [t.replace("DUP", str(dup)) for t in fields["tools"]]}
    with pytest.raises(EnvironmentSpecError) as info:
        pool_for(name, **fields)
    assert expected.replace("DUP", str(dup)) in str(info.value)
    assert "\n" not in str(info.value)


def test_reward_terms_are_reported_and_an_undeclared_one_fails_its_call():
    with pool_for("tools", tools=["support.environments:add"]) as pool:
        assert pool.reward_terms == ()  # the tool loop gives none
    with pool_for("support.environments:Again") as pool:
        assert pool.reward_terms is None  # it does not say
    with pool_for("support.environments:Scores") as pool:
        assert pool.reward_terms == ("score",)
        keys = pool.new_sessions(2)
        pool.reset([(k, USER, {}, 0) for k in keys])
        good, bad = pool.step([(keys[0], "x", 0), (keys[1], "bonus", 0)])
        assert good.ok["rewards"] == {"score": 1.0}
        assert bad.ok is None
        assert "Scores.step returned the reward term 'bonus', which its reward_terms ('score',) do not list" in bad.error


def test_an_environment_file_that_exits_or_hangs_at_import(tmp_path):
    exits = tmp_path / "exits.py"
    exits.write_text("import os\nos._exit(3)\n")
    with pytest.raises(EnvironmentSpecError, match=r"ended the environment worker \(exit code 3\)"):
        pool_for(f"{exits}:Env")
    hangs = tmp_path / "hangs.py"
    hangs.write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(EnvironmentSpecError, match="did not finish importing it within 1 s"):
        pool_for(f"{hangs}:Env", startup_timeout_s=1.0)


def test_close_stops_an_operation_in_another_thread_at_once():
    import threading

    pool = pool_for("support.environments:Slow", timeout_s=60.0)
    (key,) = pool.new_sessions(1)
    pool.reset([(key, USER, {}, 0)])
    errors = []

    def step():
        try:
            pool.step([(key, "x", 0)])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    thread = threading.Thread(target=step)
    thread.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    pool.close()
    thread.join(25)
    assert not thread.is_alive() and time.monotonic() - t0 < 20  # Slow.step sleeps 30 s
    assert errors and "closed" in str(errors[0])


def test_calls_queue_per_worker_and_the_workers_answer_concurrently():
    """submit / poll: an item answered on one worker comes back while another worker is
    still busy; a worker's items are answered in the order they were queued."""
    with pool_for("support.environments:Sleeps", num_workers=2) as pool, pool.exclusive():
        keys = pool.new_sessions(3)  # keys[0] and keys[2] share a worker
        tickets = {}
        for k in keys:
            tickets[pool.submit("reset", (k, USER, {}, 0))] = ("reset", k)
        order = []
        while pool.in_flight():
            order += [tickets[t] for t, _ in pool.poll(None)]
        slow, fast, after = keys[0], keys[1], keys[2]
        steps = {pool.submit("step", (slow, "1.0", 0)): slow}
        steps[pool.submit("step", (fast, "0", 0))] = fast
        steps[pool.submit("step", (after, "0", 0))] = after  # queued behind the slow one
        answered = []
        while pool.in_flight():
            answered += [(steps[t], o.ok["metrics"]["slept"]) for t, o in pool.poll(None)]
        assert answered[0] == (fast, 0.0)  # back while its neighbour's step sleeps
        assert answered[1:] == [(slow, 1.0), (after, 0.0)]  # one worker: in order
        assert pool.poll(0.0) == [] and pool.in_flight() == 0


def test_a_pool_closed_between_calls_of_a_generation_stops_it():
    """Closed (shutdown, another thread) while a generation call holds the pool with
    nothing in flight (its engine generating): its next submit raises, and so does a poll
    of what it had submitted; no failed outcome ever comes back (the driver would make
    'error' trajectories of them, a batch that looks real)."""
    import threading

    pool = pool_for("support.environments:Again", kwargs={"turns": 3})
    keys = pool.new_sessions(2)
    with pytest.raises(PoolClosed), pool.exclusive():
        pool.submit("reset", (keys[0], USER, {"answer": "3"}, 7))
        while pool.in_flight():
            pool.poll(None)
        closing = threading.Thread(target=pool.close)
        closing.start()
        closing.join()
        pool.submit("step", (keys[0], "turn", 0))
    with pytest.raises(PoolClosed):
        pool.poll(0.0)


def test_leaving_with_calls_in_flight_replaces_the_workers_that_held_them():
    with pool_for("support.environments:Sleeps", num_workers=2) as pool:
        keys = pool.new_sessions(2)
        pool.reset([(k, USER, {}, 0) for k in keys])
        old = list(pool._workers)
        with pytest.raises(RuntimeError, match="stop"), pool.exclusive():
            pool.submit("step", (keys[0], "30", 0))
            raise RuntimeError("stop")  # an error in the rollout, the step still running
        assert pool._workers[keys[0] % 2] is not old[keys[0] % 2]  # replaced, not waited for
        assert pool._workers[keys[1] % 2] is old[keys[1] % 2]
        (gone,) = pool.step([(keys[0], "0", 1)])  # its session went with its worker
        assert gone.ok is None and "no such trajectory" in gone.error
        (kept,) = pool.step([(keys[1], "0", 0)])
        assert kept.ok["done"]


def test_a_tool_file_imports_a_module_beside_it(tmp_path):
    """A `path/to/file.py:function` tool runs with its folder on its import path."""
    (tmp_path / "arith.py").write_text("def plus(a, b):\n    return a + b\n")
    (tmp_path / "mytools.py").write_text(
        "import arith\n\n"
        "def add(a: int, b: int) -> int:\n"
        '    """Add two integers.\n\n    Args:\n        a: the first\n        b: the second\n    """\n'
        "    return arith.plus(a, b)\n"
    )
    with pool_for("tools", tools=[f"{tmp_path / 'mytools.py'}:add"], startup_timeout_s=30) as pool:
        key = pool.new_sessions(1)[0]
        pool.reset([(key, USER, {}, 0)])
        out = pool.step([(key, CALL, 0)])[0]
        assert out.error is None, out.error
        assert out.ok["reply"][0]["content"] == "3"


# -- issue 27: results and replies of any size, output, processes, calls per turn -----------


def live_with(tag: str) -> list[int]:
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["status"] != psutil.STATUS_ZOMBIE and any(tag in a for a in cmdline):
            found.append(proc.pid)
    return found


def test_an_oversized_tool_result_is_cut_for_the_model_and_fails_nothing_else():
    """A 5 MB result used to be a reply frame over the limit: the worker was killed and
    every trajectory on it failed (big_output.py)."""
    tools = ["support.environments:add", "support.hostile_tools:big"]
    with pool_for("tools", tools=tools) as pool:
        keys = pool.new_sessions(4)
        pool.reset([(k, USER, {}, 0) for k in keys])
        out = pool.step([(keys[0], CALL, 0), (keys[1], hermes("big", mb=5), 0), (keys[2], CALL, 0)])
        assert [o.error for o in out] == [None, None, None]
        text = out[1].ok["reply"][0]["content"]
        assert text == "x" * 8000 + (
            "\n[truncated: the tool returned 5242880 characters; only the first 8000 are shown]"
        )
        assert out[1].ok["counts"]["tool_truncated"] == 1 and "tool_errors" not in out[1].ok["counts"]
        assert out[0].ok["reply"][0]["content"] == out[2].ok["reply"][0]["content"] == "3"
        later = pool.step([(keys[3], CALL, 0)])[0]  # a session of the same worker lives on
        assert later.error is None and later.ok["reply"][0]["content"] == "3"


def test_an_environment_reply_too_large_for_a_frame_fails_only_its_trajectory():
    with pool_for("support.environments:BigReply") as pool:
        keys = pool.new_sessions(2)
        pool.reset([(k, USER, {}, 0) for k in keys])
        out = pool.step([(keys[0], "big", 0), (keys[1], "small", 0)])
        assert out[0].ok is None and "over the 4194304 the trainer accepts" in out[0].error
        assert out[1].error is None and out[1].ok["done"]


def test_a_leftover_process_flooding_the_output_does_not_hang_the_pool():
    """The trainer relayed worker output until the pipe ran dry, which a process writing
    without pause never lets happen: the pool never came back to its deadlines or replies
    (printer_hang.py). A step with such a printer behind it, and the next, return."""
    import threading

    tools = ["support.environments:add", "support.hostile_tools:printer",
             "support.hostile_tools:pipe_flood"]  # fmt: skip
    pool = pool_for("tools", tools=tools, timeout_s=1.0, tool_timeout_s=1.0)
    keys = pool.new_sessions(3)
    pool.reset([(k, USER, {}, 0) for k in keys])
    done: dict[str, object] = {}

    def steps() -> None:
        done["printer"] = pool.step([(keys[0], hermes("printer", lines=1), 0)])[0]
        done["flood"] = pool.step([(keys[1], hermes("pipe_flood"), 0)])[0]  # floods from now on
        done["after"] = pool.step([(keys[2], CALL, 0)])[0]

    thread = threading.Thread(target=steps, daemon=True)
    thread.start()
    thread.join(30)  # the item budget is 2 x 1 + 16 x 1 + 1 = 19 s; these take well under
    hung = thread.is_alive()
    pool.close()  # frees a hung step, and kills the flood
    thread.join(10)
    assert not hung, f"the pool hung relaying output (done: {sorted(done)})"
    printed = done["printer"].ok["reply"][0]["content"]  # `yes` may fill 1 MiB before it returns
    assert printed in ("started", "error: the tool printed more than 1048576 bytes")
    assert done["after"].error is None and done["after"].ok["reply"][0]["content"] == "3"
    assert live_with("spam from a leftover printer") == []


def test_processes_end_with_the_tool_call_or_with_the_trajectory():
    """A tool's processes used to outlive the call and the trajectory (leaked_process.py);
    an environment's own helper lives as long as its trajectory."""
    tag = f"3000.{time.monotonic_ns() % 10**9}"
    with pool_for("tools", tools=["support.hostile_tools:leave_processes"]) as pool:
        (key,) = pool.new_sessions(1)
        pool.reset([(key, USER, {}, 0)])
        (out,) = pool.step([(key, hermes("leave_processes", tag=tag), 0)])
        assert out.ok["reply"][0]["content"] == "left"
        assert live_with(tag) == []  # the sleeper and the daemon that left its session
    helper = f"3001.{time.monotonic_ns() % 10**9}"
    with pool_for("support.environments:KeepsProcess") as pool:
        (key,) = pool.new_sessions(1)
        pool.reset([(key, USER, {"tag": helper}, 0)])
        steps = [pool.step([(key, "x", turn)])[0] for turn in (0, 1)]
        assert [s.ok["metrics"]["alive"] for s in steps] == [1.0, 1.0]
        assert len(live_with(helper)) == 1
        pool.finish([(key, "stop")])
        assert live_with(helper) == []


def test_a_tool_does_not_see_the_trainers_secrets_or_reach_it(monkeypatch):
    """Workers inherited the trainer's whole environment and could signal it and read
    /proc/<trainer>/environ (isolation.py)."""
    import json
    import os

    monkeypatch.setenv("HF_TOKEN", "hf_secret_for_the_test")  # the user's own comes back
    tools = ["support.hostile_tools:read_env", "support.hostile_tools:attack"]
    with pool_for("tools", tools=tools) as pool:
        keys = pool.new_sessions(2)
        pool.reset([(k, USER, {}, 0) for k in keys])
        out = pool.step([(keys[0], hermes("read_env", name="HF_TOKEN"), 0),
                         (keys[1], hermes("attack", pid=os.getpid(), signals=False), 0)])  # fmt: skip
    assert out[0].ok["reply"][0]["content"] == "null"
    found = json.loads(out[1].ok["reply"][0]["content"])
    assert found["environ"].startswith(("FileNotFoundError", "PermissionError"))
    assert found["mem"].startswith(("FileNotFoundError", "PermissionError"))


def test_an_environment_that_raises_max_tool_calls_gets_the_time_for_them():
    """The pool budgeted a step for the base class's 16 calls: a ToolEnvironment allowing 40
    was killed as stuck on a legal turn (many_calls.py). 40 calls of 0.15 s = 6 s, over the
    old 2 x 0.5 + 16 x 0.2 + 1 = 5.2 s budget, within the new 2 x 0.5 + 40 x 0.2 + 1."""
    with pool_for("support.environments:ManyCalls", timeout_s=0.5, tool_timeout_s=0.2) as pool:
        keys = pool.new_sessions(2)
        pool.reset([(k, USER, {}, 0) for k in keys])
        out = pool.step([(keys[0], hermes("nap", seconds=0.15) * 40, 0), (keys[1], "done", 0)])
        assert [o.error for o in out] == [None, None]
        assert [m["content"] for m in out[0].ok["reply"]] == ["awake"] * 40
        assert pool.max_tool_calls == 40 and pool.item_budget_s == pytest.approx(10.0)
    with pytest.raises(EnvironmentSpecError, match="max_tool_calls = 1000000000 must be an integer from 0 to 4096"):
        pool_for("support.environments:EndlessCalls")


def test_an_environment_without_tools_is_not_budgeted_time_for_tool_calls():
    """A plain Environment offering no tool makes no tool call: its items' budget is the
    parser and the step under timeout_s and the grace (2 x 1 + 1 = 3 s), not the 16 calls
    of the base class x tool_timeout_s (163 s at tool_timeout_s 10) before a stuck worker
    is killed. With a configured tool it may call 16 per turn again."""
    with pool_for("support.environments:Again", timeout_s=1.0, tool_timeout_s=10.0) as pool:
        assert pool.max_tool_calls == 0 and pool.item_budget_s == pytest.approx(3.0)
    tools = ["support.hostile_tools:read_env"]
    with pool_for("support.environments:Again", timeout_s=1.0, tool_timeout_s=10.0, tools=tools) as pool:
        assert pool.max_tool_calls == 16 and pool.item_budget_s == pytest.approx(163.0)
