"""The kernels to tune: the module as the pipeline hands it to its schedule phase.

Tuning must see each kernel at the shapes it will be compiled at. Passes that later issues put
before the schedule phase (operator partitioning: each worker's kernels at their local shapes)
are part of `pipeline.phases`, so running the phases up to "schedule" gives the right kernels
whatever those phases are. Copies and collectives are packed calls, not PrimFuncs: never tasks.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm.s_tir import meta_schedule as ms

from tvm_ext import pipeline

SCHEDULE_PHASE = "schedule"


@dataclasses.dataclass
class TuningTask:
    """One kernel to tune; `weight` counts the calls in the module that share it."""

    name: str
    mod: tvm.IRModule  # the PrimFunc as MetaSchedule's workload ("main")
    weight: int
    flops: float

    def __repr__(self) -> str:
        return f"TuningTask({self.name!r}, weight={self.weight}, flops={self.flops:.3g})"


def run_phases(
    mod: tvm.IRModule,
    target: tvm.target.Target,
    *,
    through: str = SCHEDULE_PHASE,
    inclusive: bool = False,
    **pipeline_options,
) -> tvm.IRModule:
    """Run the tvm_ext pipeline's phases up to phase `through` (included if `inclusive`).

    `pipeline_options` are those of `pipeline.phases` (e.g. `tune_db`, `memory_planning`).
    """
    names = [name for name, _ in pipeline.phases(target, **pipeline_options)]
    if through not in names:
        raise ValueError(f"the tvm_ext pipeline has no phase {through!r}; phases: "
                         f"{', '.join(names)}")
    with target:
        for name, passes in pipeline.phases(target, **pipeline_options):
            if name == through and not inclusive:
                break
            mod = tvm.transform.Sequential(passes, name=name)(mod)
            if name == through:
                break
    return mod


def module_at_schedule_phase(
    mod: tvm.IRModule, target: tvm.target.Target, **pipeline_options
) -> tvm.IRModule:
    """The module as the pipeline's schedule phase receives it: the one to tune."""
    return run_phases(mod, target, through=SCHEDULE_PHASE, **pipeline_options)


def scheduled_module(
    mod: tvm.IRModule, target: tvm.target.Target, tune_db: str | None, **pipeline_options
) -> tvm.IRModule:
    """The module right after the schedule phase, with the records of `tune_db` applied."""
    return run_phases(mod, target, through=SCHEDULE_PHASE, inclusive=True, tune_db=tune_db,
                      **pipeline_options)


def extract_tasks(staged: tvm.IRModule, target: tvm.target.Target) -> list[TuningTask]:
    """The distinct kernels of a module at the schedule phase (already scheduled ones skipped)."""
    from tvm.s_tir.analysis import estimate_tir_flops

    tasks = []
    for task in ms.relax_integration.extract_tasks(staged, target):
        if task.mod.attrs is not None and task.mod.attrs.get("tirx.is_scheduled", False):
            continue
        workload = task.dispatched[0]
        if any(f.attrs is not None and f.attrs.get("tirx.is_scheduled", False)
               for f in workload.functions.values()):
            continue
        tasks.append(TuningTask(str(task.task_name), workload, int(task.weight),
                                float(estimate_tir_flops(workload))))
    return tasks
