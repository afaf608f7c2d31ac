"""Ctrl-C in a compile.py run (`tvm_ext.interrupts`): one line, exit status 130, no partial or
changed file, at each phase the run goes through. Interrupted deterministically: the test hook
(`TVM_EXT_INTERRUPT_AT=<phase>`) makes the process send itself SIGINT there, inside TVM's
callbacks where the phase runs in them (codegen starts in a pass of the pipeline, tuning's in a
measure callback of MetaSchedule's C++ task scheduler)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from tvm_ext import interrupts
from tvm_ext.schedules.database import RECORD_FILE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "compile.py")


def _terminal_signals() -> None:
    """A terminal's SIGINT in the child: a test process run in the background ignores it, and
    a child inherits that (which ExitOnSignal rightly keeps, as under nohup)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(autouse=True)
def _default_handlers():
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, saved)


def _compile(tmp_path, phase: str, *options: str) -> subprocess.CompletedProcess:
    env = {**os.environ, interrupts.HOOK_ENV: phase, "TMPDIR": str(tmp_path)}
    return subprocess.run([sys.executable, SCRIPT, "mlp", "--output", str(tmp_path / "m.so"),
                           "--report", str(tmp_path / "r.json"), *options],
                          capture_output=True, text=True, env=env, timeout=600,
                          preexec_fn=_terminal_signals)


def _files(tmp_path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}


@pytest.mark.parametrize("phase, options", [
    ("planning", ["--device-memory", "50%", "--swap-time-budget", "1"]),
    ("build", []),
    ("codegen", ["--device-memory", "50%", "--swap-time-budget", "1"]),
    ("writing", ["--device-memory", "50%", "--swap-time-budget", "1"]),
])
def test_an_interrupt_at_each_phase_ends_the_run_in_one_line(tmp_path, phase, options):
    """Earlier outputs stay as they were; nothing half written is left beside them."""
    (tmp_path / "m.so").write_bytes(b"an earlier export")
    (tmp_path / "m.so.swap.json").write_text("{}")
    before = _files(tmp_path)
    done = _compile(tmp_path, phase, *options)
    assert done.returncode == 130, done.stderr[-3000:]
    err = done.stderr.strip().splitlines()
    assert err == [f"interrupted by SIGINT during {phase}: stopped, no file left half written"]
    assert _files(tmp_path) == before


def test_an_interrupted_tuning_run_keeps_its_records_and_applies_none(tmp_path):
    """Ended in the middle of the search (after its first step): the records so far are kept;
    no worker says anything; none is applied before a run of the same command compares it
    with the default schedule."""
    from tvm_ext.schedules.default_times import load_default_times

    db = tmp_path / "db"
    options = ["--tune-trials", "8", "--tune-db", str(db), "--no-library"]
    done = _compile(tmp_path, "tuning", *options)
    assert done.returncode == 130, done.stderr[-3000:]
    (line,) = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert line == (f"interrupted by SIGINT during tuning: stopped, no file left half written; "
                    f"the tuning records so far are kept in {db}; the same command resumes")
    assert re.search(r"trial +\d/8 ", done.stdout), done.stdout  # one step of the budget
    (db_dir,) = [p for p in db.iterdir() if p.is_dir()]
    records = (db_dir / RECORD_FILE).read_text().splitlines()
    assert records and all(json.loads(r) for r in records)
    assert all(set(pair) == {"pending"} for pair in load_default_times(str(db_dir)).values())
    applied = subprocess.run([sys.executable, SCRIPT, "mlp", "--tune-db", str(db),
                              "--no-library"], capture_output=True, text=True, timeout=600)
    assert applied.returncode == 0, applied.stderr[-3000:]
    assert "tuning  0 of" in applied.stdout and "until an interrupted tuning run" in \
        applied.stdout


_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from tvm_ext import interrupts
    temp = sys.argv[1]
    with interrupts.ExitOnSignal(), interrupts.phase("writing"):
        with interrupts.writing(temp):
            open(temp, "w").write("half")
            with interrupts.critical():
                os.kill(os.getpid(), signal.SIGINT)
                print("renamed", flush=True)  # the signal waits for the critical block
            print("not reached", flush=True)
""")


def test_a_signal_waits_for_the_renames_then_removes_what_was_being_written(tmp_path):
    temp = tmp_path / "m.so.tmp"
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(temp)], capture_output=True,
                          text=True, timeout=120, preexec_fn=_terminal_signals)
    assert done.returncode == 130 and done.stdout.split() == ["renamed"]
    assert done.stderr.strip().endswith("interrupted by SIGINT during writing: stopped, no "
                                        "file left half written")
    assert not temp.exists()


def test_a_signal_ignored_stays_ignored():
    saved = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupts.ExitOnSignal():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, saved)


def test_tuning_leaves_a_handler_that_exits_at_once_in_place():
    from tvm_ext.schedules.interrupt import Interruptible

    with interrupts.ExitOnSignal():
        handler = signal.getsignal(signal.SIGINT)
        assert interrupts.exits_at_once(handler)
        with Interruptible():
            assert signal.getsignal(signal.SIGINT) is handler
    assert not interrupts.exits_at_once(signal.default_int_handler)
