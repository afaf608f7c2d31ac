"""Whether a kernel's best tuning record beats its default schedule, decided by timing the two
side by side when the kernel is tuned, so that `ApplyTuningDatabase` applies a record only where
it is faster than the schedule the build would give the kernel anyway (a tuned build is not
slower for its records: a short search often finds nothing better than a good default, and a
record's time from the search, taken among other candidates on a busy machine, is not a fair
comparison with a default timed at another moment).

Kept in `default_times.json` in the database directory: workload hash -> {"default_s",
"record_s"}, the medians of interleaved rounds of the two compiled kernels, timed as
MetaSchedule's runner times candidates (`EVALUATOR`), re-measured whenever tuning ran for the
kernel. Kernels with no comparison (records imported from another machine) get their records
applied as before. A tuning run marks its kernels {"pending": 1} as it starts (`mark_pending`)
and compares them as it ends: the records of a run that ended before (interrupted) are not
applied until a run of the same command finishes, so the rule holds after an interruption too.
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np
import tvm
import tvm_ffi
from tvm.s_tir import Schedule

from tvm_ext.ir.targets import is_cpu, is_gpu, vm_devices
from tvm_ext.runtime.candidate_batch import EVALUATOR
from tvm_ext.runtime.kernel_timing import kernel_arguments, kernel_params, time_kernel

from .database import best_seconds
from .default_cpu import ApplyDefaultCPUSchedules
from .default_gpu import ApplyDefaultGPUSchedules
from .measure import build_candidate

DEFAULT_TIMES_FILE = "default_times.json"


def workload_key(mod: tvm.IRModule) -> str:
    """The key of a kernel's workload (`kernel_workload`): its structural hash."""
    return str(tvm_ffi.structural_hash(mod))


def load_default_times(db_dir: str) -> dict[str, dict[str, float]]:
    """Workload key -> {"default_s", "record_s"} ({} when nothing was compared)."""
    path = os.path.join(db_dir, DEFAULT_TIMES_FILE)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {str(k): {n: float(x) for n, x in v.items()} for k, v in json.load(f).items()}


PENDING = "pending"


def record_loses(times: dict[str, dict[str, float]], workload: tvm.IRModule) -> bool:
    """Whether the best record of `workload` was measured no faster than its default schedule,
    or is still to be compared with it (its tuning run did not finish)."""
    pair = times.get(workload_key(workload))
    return pair is not None and (PENDING in pair or pair["record_s"] >= pair["default_s"])


def awaits_comparison(times: dict[str, dict[str, float]], workload: tvm.IRModule) -> bool:
    """Whether a tuning run of `workload` ended before comparing its record with the default."""
    return PENDING in times.get(workload_key(workload), {})


def mark_pending(workloads: list[tvm.IRModule], db_dir: str) -> None:
    """As a tuning run starts: its kernels' records wait for the comparison at its end."""
    times = load_default_times(db_dir)
    for workload in workloads:
        times[workload_key(workload)] = {PENDING: 1.0}
    _save(db_dir, times)


def _save(db_dir: str, times: dict) -> None:
    """Written whole or not at all: a temporary file renamed over the old one."""
    fd, tmp = tempfile.mkstemp(dir=db_dir, prefix=".default_times.")
    with os.fdopen(fd, "w") as f:
        json.dump(times, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(db_dir, DEFAULT_TIMES_FILE))


def _compiled(scheduled: tvm.IRModule, target: tvm.target.Target):
    with target:
        return tvm.compile(scheduled, target).mod


def _best_record_schedule(workload: tvm.IRModule, db) -> tvm.IRModule:
    """The workload scheduled by its best record."""
    (best,) = db.get_top_k(db.commit_workload(workload), 1)
    sch = Schedule(workload)
    best.trace.apply_to_schedule(sch, remove_postproc=False)
    return sch.mod


def compare_with_default(workload: tvm.IRModule, target: tvm.target.Target, db,
                         rounds: int = 5) -> dict[str, float]:
    """{"default_s", "record_s"}: median seconds per call of the workload's `main` under the
    default schedules of `target` and under its best record in `db`, timed in `rounds`
    alternating rounds on the same arguments."""
    rules = ApplyDefaultGPUSchedules() if is_gpu(target) else ApplyDefaultCPUSchedules()
    record = build_candidate(_best_record_schedule(workload, db), target, None)  # as tuning did
    with target:  # (on a copy: the rules update the module they are given)
        default = _compiled(rules(workload.clone()), target)
    device = vm_devices(target)[0]
    args = kernel_arguments(kernel_params(workload["main"]), device, np.random.default_rng(0))
    runs: dict[str, list[float]] = {"default_s": [], "record_s": []}
    for _ in range(rounds):
        for name, lib in (("default_s", default), ("record_s", record)):
            runs[name] += time_kernel(lib, "main", args, device, number=EVALUATOR["number"],
                                      repeat=1, min_repeat_ms=EVALUATOR["min_repeat_ms"])
    return {name: float(np.median(r)) for name, r in runs.items()}


def measure_default_times(workloads: list[tvm.IRModule], target: tvm.target.Target,
                          db_dir: str, db) -> dict[str, dict[str, float]]:
    """Compare each workload's best record in `db` with its default schedule (see the module
    docstring) and record the result in `db_dir`; returns every comparison recorded there. A
    kernel without a timed record, or that TVM cannot compile either way, is left out."""
    times = load_default_times(db_dir)
    if not (is_cpu(target) or is_gpu(target)):  # no default schedules to compare with
        for workload in workloads:
            times.pop(workload_key(workload), None)
        _save(db_dir, times)
        return times
    for workload in workloads:
        if best_seconds(db, workload) is None:  # no timed record: nothing to compare
            times.pop(workload_key(workload), None)
            continue
        try:
            times[workload_key(workload)] = compare_with_default(workload, target, db)
        except RuntimeError:  # TVM cannot compile or run it (its errors are RuntimeErrors)
            times.pop(workload_key(workload), None)  # applied, as a record never compared
            continue
    _save(db_dir, times)
    return times
