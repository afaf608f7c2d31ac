"""tvm_ext.schedules: kernel schedules. MetaSchedule tuning with its XGBoost cost model
(`tune_tasks` over the tasks of a module at the schedule phase), the tuning database and the
pass that applies it, and default GPU schedules for kernels without a record.

    report = tvm_ext.driver.tune(model.mod, target, "tune_db", trials=200)  # records on disk
    ex = tvm.compile(model.mod, target,
                     relax_pipeline=relax.get_pipeline("tvm_ext", target=target,
                                                       tune_db="tune_db"))  # apply them

Kernels without a timed record keep TVM's default schedules (dlight on GPU). For a target this
machine cannot run, `offline` exports the candidates of a build-only search as a batch to time
elsewhere and imports the measurements back (`export_batch`, `import_measurements`).
"""

from .apply_tuning_database import (
    ApplyTuningDatabase,
    awaiting_comparison,
    coverage,
    kernel_times,
    kernel_workload,
)
from .database import (
    TuningDatabaseError,
    database_dir,
    open_database,
    target_key,
)
from .default_cpu import ApplyDefaultCPUSchedules
from .default_gpu import ApplyDefaultGPUSchedules
from .offline import BatchExport, MeasurementImport, export_batch, import_measurements
from .tasks import TuningTask, extract_tasks
from .tuning import NoDeviceError, TuningReport, can_time, tune_tasks

DEFAULT_WORK_DIR = "tvm_ext_tune_db"

__all__ = [
    "DEFAULT_WORK_DIR",
    "ApplyDefaultCPUSchedules",
    "ApplyDefaultGPUSchedules",
    "ApplyTuningDatabase",
    "BatchExport",
    "MeasurementImport",
    "NoDeviceError",
    "TuningDatabaseError",
    "TuningReport",
    "TuningTask",
    "awaiting_comparison",
    "can_time",
    "coverage",
    "database_dir",
    "export_batch",
    "extract_tasks",
    "import_measurements",
    "kernel_times",
    "kernel_workload",
    "open_database",
    "target_key",
    "tune_tasks",
]
