"""ApplyTuningDatabase: schedule the kernels that a tuning work dir holds a timed record for.

Runs in the pipeline's schedule phase, before dlight. Each PrimFunc whose workload has a timed
record gets the best one (MetaSchedule's `MetaScheduleApplyDatabase`, which marks it
`tirx.is_scheduled`; this pass also marks it `tvm_ext.tuned`); the others are left as they are
and get the default schedules afterwards (dlight on GPUs, `ApplyDefaultCPUSchedules` on CPUs).
Untimed (build-only) records live elsewhere and are never applied, and neither is a record
that was no faster than the kernel's default schedule timed beside it (`default_times`), or
that an interrupted tuning run left without that comparison. A missing database applies
nothing and creates nothing.
"""

from __future__ import annotations

import tvm
from tvm import relax

from tvm_ext.ir.pass_records import LIBRARY_ATTR

from .database import best_seconds, database_dir, has_database, open_database
from .default_times import awaits_comparison, load_default_times, record_loses

TUNED_ATTR = "tvm_ext.tuned"  # on a kernel scheduled from a tuning record


def _scheduled(func: tvm.tirx.PrimFunc) -> bool:
    return func.attrs is not None and bool(func.attrs.get("tirx.is_scheduled", False))


@tvm.transform.module_pass(opt_level=0, name="ApplyTuningDatabase")
class ApplyTuningDatabase:
    """Apply the best timed records of `work_dir` for `target` (default: the current target)."""

    def __init__(self, work_dir: str, target: tvm.target.Target | None = None) -> None:
        self.work_dir = work_dir
        self.target = target

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext
                         ) -> tvm.IRModule:
        target = self.target or tvm.target.Target.current()
        if target is None:
            raise ValueError("ApplyTuningDatabase needs a target: pass one or run it inside "
                             "`with target:`")
        db_dir = database_dir(self.work_dir, target)
        if not has_database(db_dir):
            return mod
        db = open_database(db_dir, create=False)
        with target, db:
            applied = relax.transform.MetaScheduleApplyDatabase()(mod)
        defaults = load_default_times(db_dir)
        for gv, func in applied.functions.items():
            before = mod[gv] if gv in mod.functions else None
            if not (isinstance(func, tvm.tirx.PrimFunc) and not func.same_as(before)
                    and _scheduled(func)):
                continue
            if record_loses(defaults, kernel_workload(before)):
                applied[gv] = before  # the default schedules take it
            else:
                applied[gv] = func.with_attr(TUNED_ATTR, True)
        return applied


def kernel_workload(func: tvm.tirx.PrimFunc) -> tvm.IRModule:
    """A PrimFunc as MetaSchedule keys it in a database."""
    from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

    return _normalize_mod(func)


def kernel_times(
    staged: tvm.IRModule, target: tvm.target.Target, work_dir: str
) -> dict[str, float]:
    """Measured seconds per kernel name (PrimFunc name, as `DataflowGraph` ops name kernels) for
    the kernels of `staged` (a module at the schedule phase) that `work_dir` holds a timed
    record for that the build applies: a measured counterpart to the roofline estimate of a
    cost model."""
    db_dir = database_dir(work_dir, target)
    if not has_database(db_dir):
        return {}
    db = open_database(db_dir, create=False)
    defaults = load_default_times(db_dir)
    times = {}
    for gv, func in staged.functions.items():
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        workload = kernel_workload(func)
        secs = best_seconds(db, workload)
        if secs is not None and not record_loses(defaults, workload):
            times[gv.name_hint] = secs
    return times


def awaiting_comparison(staged: tvm.IRModule, target: tvm.target.Target, work_dir: str
                        ) -> list[str]:
    """Kernels of `staged` whose records wait for a tuning run that ended before comparing
    them with their default schedules (not applied until the same run finishes)."""
    db_dir = database_dir(work_dir, target)
    defaults = load_default_times(db_dir) if has_database(db_dir) else {}
    return [gv.name_hint for gv, func in staged.functions.items()
            if isinstance(func, tvm.tirx.PrimFunc)
            and awaits_comparison(defaults, kernel_workload(func))]


def coverage(staged: tvm.IRModule, target: tvm.target.Target, work_dir: str
             ) -> tuple[list[str], list[str]]:
    """(kernels a build with `tune_db=work_dir` schedules from records, kernels left to the
    default schedules), by PrimFunc name."""
    times = kernel_times(staged, target, work_dir)
    names = [gv.name_hint for gv, f in staged.functions.items()
             if isinstance(f, tvm.tirx.PrimFunc) and not _scheduled(f)
             and not (f.attrs is not None and LIBRARY_ATTR in f.attrs)]
    return [n for n in names if n in times], [n for n in names if n not in times]

