"""What each tuned kernel costs without its record: the default schedule's time, measured when
the kernel is tuned and kept beside its records, so that `ApplyTuningDatabase` applies a record
only where it beats the schedule the build would give the kernel anyway (a tuned build is never
slower than an untuned one because of a record; a short search often finds nothing better than
a good default schedule).

Kept in `default_times.json` in the database directory: workload hash -> seconds, timed as
MetaSchedule's runner times candidates (`EVALUATOR`). Kernels with no measured default (records
imported from another machine) get their records applied as before.
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np
import tvm
import tvm_ffi

from tvm_ext.ir.targets import is_cpu, is_gpu, vm_devices
from tvm_ext.runtime.candidate_batch import EVALUATOR
from tvm_ext.runtime.kernel_timing import kernel_arguments, kernel_params, time_kernel

from .default_cpu import ApplyDefaultCPUSchedules
from .default_gpu import ApplyDefaultGPUSchedules

DEFAULT_TIMES_FILE = "default_times.json"


def workload_key(mod: tvm.IRModule) -> str:
    """The key of a kernel's workload (`kernel_workload`): its structural hash."""
    return str(tvm_ffi.structural_hash(mod))


def load_default_times(db_dir: str) -> dict[str, float]:
    """Workload key -> seconds of its default schedule ({} when none were measured)."""
    path = os.path.join(db_dir, DEFAULT_TIMES_FILE)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {str(k): float(v) for k, v in json.load(f).items()}


def _save(db_dir: str, times: dict[str, float]) -> None:
    """Written whole or not at all: a temporary file renamed over the old one."""
    fd, tmp = tempfile.mkstemp(dir=db_dir, prefix=".default_times.")
    with os.fdopen(fd, "w") as f:
        json.dump(times, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(db_dir, DEFAULT_TIMES_FILE))


def default_schedule_seconds(workload: tvm.IRModule, target: tvm.target.Target) -> float:
    """Median seconds per call of the workload's `main` under the default schedules of
    `target` (those the pipeline applies to a kernel without a record)."""
    rules = ApplyDefaultGPUSchedules() if is_gpu(target) else ApplyDefaultCPUSchedules()
    with target:
        scheduled = rules(workload)
        lib = tvm.compile(scheduled, target)
    params = kernel_params(workload["main"])
    device = vm_devices(target)[0]
    args = kernel_arguments(params, device, np.random.default_rng(0))
    runs = time_kernel(lib.mod, "main", args, device,
                       number=EVALUATOR["number"], repeat=EVALUATOR["repeat"],
                       min_repeat_ms=EVALUATOR["min_repeat_ms"])
    return float(np.median(runs))


def measure_default_times(workloads: list[tvm.IRModule], target: tvm.target.Target,
                          db_dir: str) -> dict[str, float]:
    """Measure (once per kernel) and record the default-schedule time of each workload; returns
    every time recorded in `db_dir`. A kernel the default rules cannot compile is skipped."""
    if not (is_cpu(target) or is_gpu(target)):
        return load_default_times(db_dir)
    times = load_default_times(db_dir)
    new = {}
    for workload in workloads:
        key = workload_key(workload)
        if key in times or key in new:
            continue
        try:
            new[key] = default_schedule_seconds(workload, target)
        except RuntimeError:  # TVM cannot compile or run it (its errors are RuntimeErrors)
            continue  # no default to compare with: its records apply as they are
    if new:
        times.update(new)
        _save(db_dir, times)
    return times
