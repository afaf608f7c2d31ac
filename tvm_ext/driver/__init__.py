"""The steps behind `scripts/compile.py`, as plain functions that tests and benchmarks share:
targets and builds (`build`), running and checking (`run`), tuning (`tune`), partitioned builds
(`partitioned`), training across steps (`training`), planning swaps (`swap_planning`), kernel
measurement (`measure_kernels`) and measured swapped runs (`measure_swap`)."""

from __future__ import annotations

from .build import (
    build,
    build_reference,
    device_of,
    export,
    fused_graph,
    partition_problem,
    resolve_target,
)
from .copy_cpu import dedicated_copy_cpu
from .measure_kernels import measure_kernels
from .measure_swap import (
    MeasuredRun,
    StandIn,
    measure_run,
    measure_runtime_costs,
    stand_in,
    timeline_of,
    unswapped_call,
)
from .partitioned import PartitionedBuild, build_partitioned, run_partitioned_build
from .run import CheckResult, RunResult, compare, flatten_outputs, run
from .swap_planning import SwapPlanning, check_swap_budget, plan_swap
from .training import PartitionedTrainingSession, StepResult, TrainingSession
from .tune import export_tuning_batch, tune

__all__ = [
    "CheckResult",
    "MeasuredRun",
    "PartitionedBuild",
    "PartitionedTrainingSession",
    "RunResult",
    "StandIn",
    "StepResult",
    "SwapPlanning",
    "TrainingSession",
    "build",
    "build_partitioned",
    "build_reference",
    "check_swap_budget",
    "compare",
    "dedicated_copy_cpu",
    "device_of",
    "export",
    "export_tuning_batch",
    "flatten_outputs",
    "fused_graph",
    "measure_kernels",
    "measure_run",
    "measure_runtime_costs",
    "partition_problem",
    "plan_swap",
    "resolve_target",
    "run",
    "run_partitioned_build",
    "stand_in",
    "timeline_of",
    "tune",
    "unswapped_call",
]
