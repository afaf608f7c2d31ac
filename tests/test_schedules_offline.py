"""Offline tuning (tvm_ext.schedules.offline): candidates of a build-only search exported here,
timed where they run with TVM's runtime alone (tvm_ext.runtime.candidate_batch, what the GPU
bundle runs), and brought back into the tuning database, whose best record the build applies.
The round trip runs on llvm (the same code path as CUDA); the CUDA export compiles with nvcc and
runs nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tvm

from tvm_ext import driver, pipeline
from tvm_ext.errors import InputError
from tvm_ext.models import get_model
from tvm_ext.runtime.candidate_batch import MEASUREMENTS_FILE, read_batch
from tvm_ext.runtime.kernel_timing import kernel_module
from tvm_ext.schedules import coverage, import_measurements, kernel_times

TRIALS = 2


def _quiet(line: str) -> None:
    pass


def _measure_with_the_runtime_alone(batch_dir: str) -> dict:
    code = ("import json, tvm\n"
            "from tvm_ext.runtime.candidate_batch import measure_batch\n"
            f"print(json.dumps(measure_batch({batch_dir!r}, tvm.cpu())))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "TVM_USE_RUNTIME_LIB": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_round_trip_on_llvm(tmp_path):
    model = get_model("mlp", "tiny")
    target = tvm.target.Target({"kind": "llvm"})
    work_dir, batch_dir = str(tmp_path / "db"), str(tmp_path / "batch")
    exported = driver.export_tuning_batch(model.mod, target, work_dir, batch_dir, TRIALS,
                                          trials_per_iter=TRIALS, library=False, log=_quiet)
    assert exported.candidates >= TRIALS and not exported.failed
    batch = read_batch(batch_dir)
    assert len(batch["candidates"]) == exported.candidates and batch["target_key"] == "llvm"

    measured = _measure_with_the_runtime_alone(batch_dir)
    assert measured["batch"] == batch["id"]
    rows = measured["candidates"]
    assert all(r["seconds"] and min(r["seconds"]) > 0 for r in rows)

    done = import_measurements(batch_dir, os.path.join(batch_dir, MEASUREMENTS_FILE), work_dir)
    assert done.imported == len(rows) and not done.already_imported

    # Each tuned kernel's record is its fastest candidate, and the build applies it.
    staged = pipeline.module_at_schedule_phase(model.mod, target, library=False)
    times = kernel_times(staged, target, work_dir)
    for task in {r["task"] for r in rows}:
        mine = [r["seconds"] for r in rows if r["task"] == task]
        best = min(mine, key=lambda s: float(np.mean(s)))
        assert times[task] == pytest.approx(sorted(best)[len(best) // 2])
    tuned, _ = coverage(staged, target, work_dir)
    assert set(tuned) == {r["task"] for r in rows}
    args = model.random_arguments(0)
    plain = driver.run(driver.build(model, target, library=False), args, tvm.cpu(), repeat=0)
    with_db = driver.run(driver.build(model, target, tune_db=work_dir, library=False), args,
                         tvm.cpu(), repeat=0)
    driver.compare(with_db.outputs, plain.outputs, rtol=1e-5, atol=1e-6)

    # Once only; and a new export leaves out what was measured.
    assert import_measurements(batch_dir, measured, work_dir).already_imported
    again = driver.export_tuning_batch(model.mod, target, work_dir, str(tmp_path / "b2"),
                                       TRIALS, library=False, log=_quiet)
    assert again.candidates == 0
    other = dict(measured, batch="0" * 16)
    with pytest.raises(InputError, match="of batch"):
        import_measurements(batch_dir, other, work_dir)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc to compile CUDA with")
def test_cuda_export_compiles_the_candidates_without_a_gpu(tmp_path):
    target = driver.resolve_target("cuda")
    batch_dir = str(tmp_path / "batch")
    exported = driver.export_tuning_batch(get_model("mlp", "tiny").mod, target,
                                          str(tmp_path / "db"), batch_dir, TRIALS,
                                          trials_per_iter=TRIALS, library=False, log=_quiet)
    assert exported.candidates >= 1 and not exported.tuning.timed
    batch = read_batch(batch_dir)
    assert batch["target_key"] == "cuda-sm_90"
    library = os.path.join(batch_dir, batch["library"])
    data = open(library, "rb").read()
    assert data.count(b"\x7fELF") >= 2 and b".nv.info" in data  # cubins, compiled by nvcc
    module = tvm.runtime.load_module(library)  # through TVM's CUDA runtime (no-device stub)
    for cand in batch["candidates"]:
        assert kernel_module(module, cand["function"]) is not None
