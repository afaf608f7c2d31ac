"""Ctrl-C (SIGINT) and SIGTERM in a command-line run: one line, exit status 128 + the signal
(130 for Ctrl-C), no partial file.

`ExitOnSignal` ends the process where the signal lands (`os._exit`) instead of raising a
KeyboardInterrupt. Raised, the interrupt surfaces wherever the main thread is, most of a
compile inside a Python callback that TVM's C++ called (a pass, an expression visitor, a tuning
callback): unwinding a half-done native state crashed with a segmentation fault, and elsewhere
it printed a raw traceback. Nothing that must survive is lost by not unwinding: a file is
written under a temporary name that `writing` registers (removed here) and renamed in place
inside `critical` (a signal then waits for the renames to end, so a module and its sidecar
change together); tuning records are on disk after every search step.

`phase(name)` names what the run is doing, for that line, and is where a test interrupts a
run deterministically: with `TVM_EXT_INTERRUPT_AT=<name>` in the environment the process sends
itself SIGINT as the phase starts (the phases compile.py goes through: loading, planning,
tuning, build, codegen, writing, running).

Plain Python (no TVM): every layer may mark its phases.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

HOOK_ENV = "TVM_EXT_INTERRUPT_AT"
_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_phase = ["starting"]
_notes: list[str | None] = [None]
_temps: list[str] = []
_critical = [0]
_pending: list[int] = []


def current_phase() -> str:
    return _phase[-1]


def hook(name: str) -> None:
    """The test hook: SIGINT to this process where `TVM_EXT_INTERRUPT_AT` is `name`."""
    if os.environ.get(HOOK_ENV) == name:
        os.kill(os.getpid(), signal.SIGINT)


def enter(name: str) -> None:
    """The run now does `name` (until the enclosing `phase` ends); the test hook fires here."""
    _phase[-1] = name
    hook(name)


@contextlib.contextmanager
def phase(name: str, note: str | None = None, *, hooked: bool = True) -> Iterator[None]:
    """The run does `name` inside the block; `note`: what the line adds if it ends there (what
    was kept, how to resume); `hooked`: the test hook fires as it starts (else the block fires
    it where it should)."""
    _phase.append(name)
    _notes.append(note)
    try:
        if hooked:
            hook(name)
        yield
    finally:
        _phase.pop()
        _notes.pop()


@contextlib.contextmanager
def writing(*temps: str) -> Iterator[None]:
    """`temps` (files being written, to be renamed into place) are removed if the process is
    ended inside the block."""
    _temps.extend(temps)
    try:
        yield
    finally:
        for temp in temps:
            _temps.remove(temp)


@contextlib.contextmanager
def critical() -> Iterator[None]:
    """A signal arriving inside the block ends the process at its end."""
    _critical[0] += 1
    try:
        yield
    finally:
        _critical[0] -= 1
        if not _critical[0] and _pending:
            _exit(_pending[0])


def exits_at_once(handler) -> bool:
    """Whether `handler` (from `signal.getsignal`) ends the process where the signal lands:
    code that would defer a signal to a safe point has no need to."""
    return isinstance(getattr(handler, "__self__", None), ExitOnSignal)


class ExitOnSignal:
    """Installs the handlers for the block (main thread only; a signal ignored, as under
    nohup, stays ignored)."""

    def __init__(self) -> None:
        self.previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if _critical[0]:
            _pending.append(signum)
            return
        _exit(signum)

    def __enter__(self) -> ExitOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _exit(signum: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    for temp in list(_temps):
        with contextlib.suppress(OSError):
            os.remove(temp)
    note = next((n for n in reversed(_notes) if n), None)
    line = (f"interrupted by {signal.Signals(signum).name} during {current_phase()}: stopped, "
            "no file left half written" + (f"; {note}" if note else ""))
    try:  # sys.stderr: the terminal's even where descriptor 2 holds TVM's log (cli.tvm_log)
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except Exception:  # a closed or odd stream: the descriptor, as a last resort
        os.write(2, (line + "\n").encode())
    os._exit(128 + signum)
