"""StopSignals on its own: a first signal is a request, a repeat within the window is the
same one, abandonable() regions are cut short, handlers come back (no torch, in-process:
the handler under test is always the one installed before a signal is sent)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from leangrpo.stopping import REPEAT_WINDOW_S, RunStopped, StopRequested, StopSignals, abandonable


def send(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.05)  # the Python-level handler runs at the next bytecode: now


def test_a_first_signal_is_a_request_and_a_quick_repeat_the_same_request():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with StopSignals() as stop:
        assert signal.getsignal(signal.SIGTERM) == stop._on_signal
        assert stop.requested == 0
        send(signal.SIGTERM)
        assert stop.requested == signal.SIGTERM
        send(signal.SIGTERM)  # within REPEAT_WINDOW_S: a scheduler's + torchrun's copy
        send(signal.SIGINT)
        assert stop.requested == signal.SIGTERM  # the first one's
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    assert REPEAT_WINDOW_S <= 1.0  # a person's second Ctrl-C, seconds later, still counts


def test_an_abandonable_wait_is_cut_short_and_an_ordinary_one_is_not():
    with StopSignals() as stop:
        with pytest.raises(StopRequested), abandonable():
            send(signal.SIGINT)
            pytest.fail("the wait went on")
        assert stop.requested == signal.SIGINT
        with pytest.raises(StopRequested), abandonable():  # requested already: at once
            pytest.fail("entered")
    with StopSignals(abandon=False) as stop:  # torchrun: only the step boundaries count
        with abandonable():
            send(signal.SIGTERM)
        assert stop.requested == signal.SIGTERM
    with abandonable():  # no StopSignals active: nothing to do
        pass


def test_outside_the_main_thread_nothing_is_installed():
    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def run():
        with StopSignals() as stop:
            seen.append((signal.getsignal(signal.SIGTERM), stop.requested))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [(before, 0)]


def test_run_stopped_is_one_line_and_the_conventional_status(tmp_path):
    stop = RunStopped(signal.SIGTERM, 155, tmp_path / "checkpoints" / "step-155")
    assert stop.exit_code == 143 and RunStopped(signal.SIGINT, 1, tmp_path).exit_code == 130
    assert str(stop) == (
        f"stopped by SIGTERM at step 155: checkpoint saved to {tmp_path}/checkpoints/step-155; "
        "run the same command to resume"
    )
