"""The steps behind `scripts/compile.py`, as plain functions that tests and benchmarks share:
targets and builds (`build`), running and checking (`run`), tuning (`tune`), partitioned builds
(`partitioned`), training across steps (`training`) and kernel measurement
(`measure_kernels`)."""

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
from .measure_kernels import measure_kernels
from .partitioned import PartitionedBuild, build_partitioned, run_partitioned_build
from .run import CheckResult, RunResult, compare, flatten_outputs, run
from .training import PartitionedTrainingSession, StepResult, TrainingSession
from .tune import tune

__all__ = [
    "CheckResult",
    "PartitionedBuild",
    "PartitionedTrainingSession",
    "RunResult",
    "StepResult",
    "TrainingSession",
    "build",
    "build_partitioned",
    "build_reference",
    "compare",
    "device_of",
    "export",
    "flatten_outputs",
    "fused_graph",
    "measure_kernels",
    "partition_problem",
    "resolve_target",
    "run",
    "run_partitioned_build",
    "tune",
]
