"""The kernels to tune, from the module as the pipeline hands it to its schedule phase
(`tvm_ext.pipeline.module_at_schedule_phase`: each worker's kernels at their local shapes after
partitioning). Copies and collectives are packed calls, not PrimFuncs: never tasks; kernels that
call a vendor library (`tvm_ext.passes.DispatchLibraryKernels`) are not tuned either.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.analysis import estimate_tir_flops

from tvm_ext.ir.pass_records import LIBRARY_ATTR


@dataclasses.dataclass
class TuningTask:
    """One kernel to tune; `weight` counts the calls in the module that share it."""

    name: str
    mod: tvm.IRModule  # the PrimFunc as MetaSchedule's workload ("main")
    weight: int
    flops: float

    def __repr__(self) -> str:
        return f"TuningTask({self.name!r}, weight={self.weight}, flops={self.flops:.3g})"


def extract_tasks(staged: tvm.IRModule, target: tvm.target.Target) -> list[TuningTask]:
    """The distinct kernels of a module at the schedule phase (already scheduled ones skipped)."""
    tasks = []
    for task in ms.relax_integration.extract_tasks(staged, target):
        if task.mod.attrs is not None and task.mod.attrs.get("tirx.is_scheduled", False):
            continue
        workload = task.dispatched[0]
        if any(f.attrs is not None and (f.attrs.get("tirx.is_scheduled", False) or
                                        LIBRARY_ATTR in f.attrs)
               for f in workload.functions.values()):
            continue
        tasks.append(TuningTask(str(task.task_name), workload, int(task.weight),
                                float(estimate_tir_flops(workload))))
    return tasks
