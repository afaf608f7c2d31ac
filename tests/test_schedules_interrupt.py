"""Stopping a tuning run on a signal: the first is noted and ends the run after the step in
flight (at the stop callback); a second raises at once. The end-to-end run is in
tests/test_schedules_tuning.py (test_an_interrupted_run_keeps_its_records)."""

import os
import signal

import pytest
from tvm.s_tir import meta_schedule as ms

from tvm_ext.schedules.interrupt import Interruptible, StopOnSignal


@pytest.fixture(autouse=True)
def _default_handlers():
    """A terminal's handlers: something earlier in a test process may leave SIGINT ignored,
    which Interruptible keeps (a run under nohup must not stop on it)."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def _stop_step(stop: StopOnSignal) -> None:
    """Call `stop` as the task scheduler does after a step (through TVM's FFI)."""
    stop.apply(ms.task_scheduler.TaskScheduler.create("round-robin"), 0, [], [], [])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_the_first_signal_is_noted_and_stops_the_run_at_the_next_step(sig, capfd):
    before = signal.getsignal(sig)
    steps = []
    with pytest.raises(KeyboardInterrupt, match=signal.Signals(sig).name):
        with Interruptible() as interruptible:
            stop = StopOnSignal(interruptible)
            _stop_step(stop)  # no signal yet: the run goes on
            os.kill(os.getpid(), sig)  # handled here, in the main thread: noted, no raise
            steps.append("after the signal")
            _stop_step(stop)
            steps.append("after the stop callback")
    assert steps == ["after the signal"]
    assert interruptible.signal == sig
    assert "stopping after the search step in flight" in capfd.readouterr().err
    assert signal.getsignal(sig) is before


def test_a_second_signal_raises_at_once():
    with pytest.raises(KeyboardInterrupt):
        with Interruptible():
            os.kill(os.getpid(), signal.SIGINT)
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
            raise AssertionError("not reached: the second signal raised")


def test_an_error_after_a_signal_is_reported_as_the_interrupt():
    """A KeyboardInterrupt that crossed the C++ task scheduler comes back as another error."""
    with pytest.raises(KeyboardInterrupt) as info:
        with Interruptible():
            os.kill(os.getpid(), signal.SIGINT)
            raise RuntimeError("signal SIGINT")
    assert isinstance(info.value.__cause__, RuntimeError)


def test_a_run_without_a_signal_is_untouched():
    with Interruptible() as interruptible:
        _stop_step(StopOnSignal(interruptible))
    assert interruptible.signal is None
