"""Stopping a tuning run on Ctrl-C (SIGINT) or SIGTERM between search steps.

The first signal only takes note; `StopOnSignal`, the last measure callback of each step (after
MetaSchedule's own callbacks have stored the step's records), raises the KeyboardInterrupt
there. Raised from the handler instead, it lands wherever the main thread is: inside a Python
callback of the C++ task scheduler, whose caller may swallow it (the run goes on) or unwind a
native search half-way (a crash). A second signal raises at once, for a user who will not wait
for the step in flight. Records are on disk after every step either way, even after SIGKILL.
Under compile.py, whose handler ends the process at once (`tvm_ext.interrupts`), that handler
stays: a Ctrl-C stops the run in well under a second instead of after the step in flight.
"""

from __future__ import annotations

import os
import signal
import threading

from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback

from tvm_ext import interrupts

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _interrupt(signum: int) -> KeyboardInterrupt:
    return KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


class Interruptible:
    """Installs the handlers for the run (main thread only; a signal ignored stays ignored).
    A KeyboardInterrupt that crossed the C++ task scheduler comes back as a RuntimeError;
    leaving, the noted signal turns whatever ended the run into a KeyboardInterrupt."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.previous: dict[int, object] = {}

    def _handle(self, signum, frame):
        if self.signal is not None:
            raise _interrupt(signum)
        self.signal = signum
        os.write(2, b"tuning: stopping after the search step in flight "
                    b"(signal again to stop now)\n")

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                handler = signal.getsignal(sig)
                # A handler that ends the process where the signal lands (compile.py's) stops
                # the run at once, without unwinding the search: nothing to defer.
                if handler is not signal.SIG_IGN and not interrupts.exits_at_once(handler):
                    self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, kind, value, traceback) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.signal is not None and (kind is None or not issubclass(kind, KeyboardInterrupt)):
            raise _interrupt(self.signal) from value


@derived_object
class StopOnSignal(PyMeasureCallback):
    """Ends the run after a step once `Interruptible` has noted a signal."""

    def __init__(self, interruptible: Interruptible) -> None:
        super().__init__()
        self.interruptible = interruptible

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results,
              runner_results) -> None:
        interrupts.hook("tuning")  # (a test's: mid-run, the step's records stored)
        if self.interruptible.signal is not None:
            raise _interrupt(self.interruptible.signal)
