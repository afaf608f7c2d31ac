"""Progress of a tuning run: one line per measured batch, and the per-task tallies the report
is made of (MetaSchedule's own tables go to the work dir's logs)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback

from .tasks import TuningTask


@dataclasses.dataclass
class TaskProgress:
    name: str
    weight: int
    trials_before: int  # candidates already in the database when the run started
    best_s: float | None  # best measured time (database included), None if never timed
    trials: int = 0  # candidates measured in this run
    built: int = 0
    build_errors: int = 0
    run_errors: int = 0
    timed: int = 0


@derived_object
class ProgressCallback(PyMeasureCallback):
    """Counts and prints each batch: trials so far, the task, its best time, the model's total."""

    def __init__(self, tasks: list[TuningTask], progress: list[TaskProgress], budget: int,
                 before: int, timed: bool, log: Callable[[str], None]) -> None:
        super().__init__()
        self.tasks = tasks
        self.progress = progress
        self.budget = budget  # of the whole tuning, earlier runs' trials included
        self.before = before  # trials the database held when this run started
        self.timed = timed
        self.log = log
        self.start = time.perf_counter()

    @property
    def trials(self) -> int:
        return sum(p.trials for p in self.progress)

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results,
              runner_results) -> None:
        p = self.progress[task_id]
        for built, ran in zip(builder_results, runner_results, strict=True):
            p.trials += 1
            if built.error_msg is not None:
                p.build_errors += 1
                continue
            p.built += 1
            if ran.error_msg is not None or not ran.run_secs:
                p.run_errors += self.timed
                continue
            secs = sorted(float(s) for s in ran.run_secs)
            p.timed += 1
            median = secs[len(secs) // 2]
            p.best_s = median if p.best_s is None else min(p.best_s, median)
        if builder_results:  # a task whose search space is exhausted comes back empty
            self.log(self._line(p, len(builder_results)))

    def _line(self, p: TaskProgress, batch: int) -> str:
        head = (f"  trial {self.before + self.trials:4d}/{self.budget}  "
                f"{time.perf_counter() - self.start:6.1f} s  {p.name} (x{p.weight}): +{batch}")
        errors = f", {p.build_errors} build errors" if p.build_errors else ""
        if not self.timed:
            return f"{head}, {p.built} built{errors}, none timed (build-only)"
        if p.run_errors:
            errors += f", {p.run_errors} run errors"
        best = "n/a" if p.best_s is None else f"{p.best_s * 1e3:.4f} ms"
        timed = [q for q in self.progress if q.best_s is not None]
        total = sum(q.best_s * q.weight for q in timed) * 1e3
        return (f"{head}, best {best}{errors} | all kernels {total:.3f} ms "
                f"({len(timed)}/{len(self.progress)} tasks timed)")
