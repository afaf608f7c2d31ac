"""Tuning with MetaSchedule + XGBoost: a tiny run through compile.py, reuse of its database (no
re-tuning, the same kernels), interruption, and build-only tuning for CUDA without a GPU.

Budgets are a handful of trials on zoo `tiny` models: these check the mechanics, not speed
(benchmarks/tuning.py measures the speed-up). They tune with `--no-library`, so that the GEMMs
are kernels to tune rather than library calls.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import tvm

from tvm_ext import cli, driver, pipeline, schedules
from tvm_ext.models import get_model
from tvm_ext.schedules.apply_tuning_database import TUNED_ATTR, kernel_workload
from tvm_ext.schedules.cost_model import COST_MODEL_FILE
from tvm_ext.schedules.database import RECORD_FILE, WORKLOAD_FILE, best_seconds, open_database
from tvm_ext.schedules.default_times import load_default_times, workload_key

TRIALS = 6


def _db_files(db_dir):
    return {name: open(os.path.join(db_dir, name), "rb").read()
            for name in (WORKLOAD_FILE, RECORD_FILE)}


@pytest.fixture(scope="module")
def llvm():
    return driver.resolve_target("llvm")


@pytest.fixture(scope="module")
def mlp():
    return get_model("mlp", "tiny")


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """compile.py mlp --tune-trials 6 --tune-db DIR --run --check: the first (tuning) call."""
    work = tmp_path_factory.mktemp("tune")
    report = work / "first.json"
    status = cli.main(["mlp", "--no-library", "--tune-trials", str(TRIALS), "--tune-db",
                       str(work / "db"),
                       "--check", "--report", str(report)])
    assert status == 0
    return str(work / "db"), json.loads(report.read_text())


def test_compile_tunes_stores_and_applies(tuned, mlp, llvm, capsys):
    work_dir, report = tuned
    tuning = report["tuning"]
    assert tuning["timed"]
    assert tuning["trials_before"] == 0 and tuning["trials_run"] >= TRIALS
    db_dir = schedules.database_dir(work_dir, llvm)
    records = open(os.path.join(db_dir, RECORD_FILE)).read().splitlines()
    assert len(records) == tuning["trials_run"]  # one line per trial, appended as it goes
    assert any(t["best_s"] for t in tuning["tasks"])
    # The build applied the records that beat their kernel's default schedule, and only those
    # (and --check passed: tuned outputs match a plain build).
    assert report["check"]["ok"]
    scheduled = pipeline.scheduled_module(mlp.mod, llvm, work_dir, library=False)
    applied = [gv.name_hint for gv, f in scheduled.functions.items()
               if isinstance(f, tvm.tirx.PrimFunc) and f.attrs.get(TUNED_ATTR, False)]
    assert sorted(applied) == sorted(tuning["kernels_tuned"])
    staged = pipeline.module_at_schedule_phase(mlp.mod, llvm, library=False)
    db = open_database(db_dir, create=False)
    compared = load_default_times(db_dir)
    for gv, func in staged.functions.items():
        workload = kernel_workload(func) if isinstance(func, tvm.tirx.PrimFunc) else None
        if workload is not None and best_seconds(db, workload) is not None:
            pair = compared[workload_key(workload)]
            assert (gv.name_hint in applied) == (pair["record_s"] < pair["default_s"])
    assert len(compared) == sum(t["best_s"] is not None for t in tuning["tasks"])


def test_second_call_tunes_nothing_and_builds_the_same_kernels(tuned, mlp, llvm, tmp_path):
    work_dir, first = tuned
    db_dir = schedules.database_dir(work_dir, llvm)
    files = _db_files(db_dir)
    kernels = pipeline.scheduled_module(mlp.mod, llvm, work_dir, library=False)
    report = tmp_path / "second.json"
    assert cli.main(["mlp", "--no-library", "--tune-trials", str(TRIALS), "--tune-db", work_dir,
                     "--report", str(report)]) == 0
    second = json.loads(report.read_text())["tuning"]
    assert second["trials_run"] == 0
    assert second["trials_before"] == first["tuning"]["trials_run"]
    assert _db_files(db_dir) == files
    assert second["kernels_tuned"] == first["tuning"]["kernels_tuned"]
    tvm.ir.assert_structural_equal(
        pipeline.scheduled_module(mlp.mod, llvm, work_dir, library=False), kernels)


# In the sweep: test_second_call_tunes_nothing_and_builds_the_same_kernels and the interrupted
# tuning run's test resume a database the same way; every line it covers is covered.
@pytest.mark.sweep
def test_a_larger_budget_tunes_the_difference(tuned, mlp, llvm, tmp_path):
    work_dir = str(tmp_path / "db")
    shutil.copytree(tuned[0], work_dir)
    before = tuned[1]["tuning"]["trials_run"]
    report = driver.tune(mlp.mod, llvm, work_dir, before + 2, trials_per_iter=2,
                         log=lambda line: None, library=False)
    assert report.trials_before == before
    assert 2 <= report.trials_run <= 4


def test_apply_only_needs_an_existing_work_dir(tmp_path, capsys):
    assert cli.main(["mlp", "--tune-db", str(tmp_path / "none")]) == 2
    assert "--tune-trials" in capsys.readouterr().err


_INTERRUPTED_RUN = textwrap.dedent("""
    import signal, sys
    # A terminal's SIGINT: the test process may ignore it, and a child inherits that.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from tvm_ext import driver, schedules
    from tvm_ext.models import get_model
    driver.tune(get_model("mlp", "tiny").mod, driver.resolve_target("llvm"), sys.argv[1],
                   500, trials_per_iter=2, library=False)
""")


# In the sweep: test_interrupts interrupts a tuning run through the CLI, and
# test_schedules_interrupt covers how the records are kept.
@pytest.mark.sweep
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_an_interrupted_run_keeps_its_records(tmp_path, mlp, llvm, sig):
    work_dir = str(tmp_path / "db")
    records = os.path.join(schedules.database_dir(work_dir, llvm), RECORD_FILE)
    # TMPDIR: a killed run cannot remove its build artifacts; keep them in tmp_path.
    proc = subprocess.Popen([sys.executable, "-c", _INTERRUPTED_RUN, work_dir],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)},
                            start_new_session=True)
    try:
        # The first record takes a compile and a measurement: minutes on a loaded 2-core box.
        deadline = time.monotonic() + 300
        while not (os.path.isfile(records) and os.path.getsize(records) > 0):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "no record within 300 s"
            time.sleep(0.2)
        os.killpg(proc.pid, sig)  # as a terminal sends it: to the builder's workers too
        # SIGINT ends the run after the search step in flight (seconds; generous for a loaded
        # machine).
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    if sig == signal.SIGINT:
        assert "stopping after the search step in flight" in out
        assert "tuning interrupted" in out and "kept in" in out and "KeyboardInterrupt" in out
        # The workers leave the signal to the run: no traceback of theirs, no candidate of the
        # step in flight stored as a build error.
        assert "popen_worker" not in out and "cannot join" not in out, out
    db = schedules.open_database(schedules.database_dir(work_dir, llvm))
    kept = len(db)
    assert kept >= 1
    assert all(float(t) < 1e9 for r in db.get_all_tuning_records() for t in r.run_secs)
    # Resuming counts what was kept: with that budget there is nothing left to tune.
    again = driver.tune(mlp.mod, llvm, work_dir, kept, log=lambda line: None, library=False)
    assert again.trials_before == kept and again.trials_run == 0


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc to compile CUDA with")
@pytest.mark.sweep  # test_schedules_offline builds CUDA candidates without a GPU
def test_cuda_without_gpu_builds_candidates_and_times_none(tmp_path, mlp, capsys):
    target = driver.resolve_target("cuda")
    work_dir = str(tmp_path / "db")
    report = driver.tune(mlp.mod, target, work_dir, 4, measure=False, trials_per_iter=2,
                         library=False)
    out = capsys.readouterr().out
    assert "NO candidate was timed" in out
    assert not report.timed and report.trials_run >= 4
    assert sum(t.built for t in report.tasks) >= 1
    assert all(t.best_s is None for t in report.tasks)
    assert os.path.isfile(os.path.join(report.database, COST_MODEL_FILE))
    # Untimed records are kept apart and never applied: the build falls back to dlight.
    assert report.database.endswith(".untimed")
    assert not os.path.exists(schedules.database_dir(work_dir, target))
    scheduled = pipeline.scheduled_module(mlp.mod, target, work_dir, library=False)
    kernels = [f for f in scheduled.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert kernels and all(f.attrs.get("tirx.is_scheduled", False) for f in kernels)  # dlight
    driver.build(mlp, target, tune_db=work_dir, library=False)  # compiles through nvcc
    again = driver.tune(mlp.mod, target, work_dir, 4, measure=False, log=lambda line: None,
                        library=False)
    assert again.trials_run == 0


def test_search_steps_end_on_the_budget():
    """MetaSchedule measures whole steps; a step size that divides what is left ends on the
    budget (a resumed run with 49 left measured 51 in steps of 16 or 12)."""
    from tvm_ext.schedules.tuning import step_size

    assert (step_size(49, 4), step_size(64, 4), step_size(2, 3), step_size(500, 5)) == \
        (7, 16, 2, 10)
    for remaining in range(1, 300):
        size = step_size(remaining, 3)
        cap = min(16, max(4, remaining // 3), remaining)
        assert (cap + 1) // 2 <= size <= cap and -remaining % size < size
