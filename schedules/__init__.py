"""tvm_ext.schedules: kernel tuning with MetaSchedule and its XGBoost cost model.

    report = tune(model.mod, target, "tune_db", trials=200)       # tune, records appended to disk
    ex = tvm.compile(model.mod, target,
                     relax_pipeline=relax.get_pipeline("tvm_ext", target=target,
                                                       tune_db="tune_db"))  # apply them

Tuning sees the module as the pipeline's schedule phase will (`module_at_schedule_phase`);
kernels without a timed record keep TVM's default schedules (dlight on GPU).
"""

from .apply_tuning_database import ApplyTuningDatabase, coverage, kernel_times, kernel_workload
from .database import (
    TuningDatabaseError,
    database_dir,
    open_database,
    target_key,
)
from .tasks import (
    TuningTask,
    extract_tasks,
    module_at_schedule_phase,
    run_phases,
    scheduled_module,
)
from .tuning import NoDeviceError, TuningReport, can_time, tune, tune_tasks

DEFAULT_WORK_DIR = "tvm_ext_tune_db"

__all__ = [
    "DEFAULT_WORK_DIR",
    "ApplyTuningDatabase",
    "NoDeviceError",
    "TuningDatabaseError",
    "TuningReport",
    "TuningTask",
    "can_time",
    "coverage",
    "database_dir",
    "extract_tasks",
    "kernel_times",
    "kernel_workload",
    "module_at_schedule_phase",
    "open_database",
    "run_phases",
    "scheduled_module",
    "target_key",
    "tune",
    "tune_tasks",
]
