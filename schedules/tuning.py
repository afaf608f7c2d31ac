"""Tune a module's kernels with MetaSchedule (evolutionary search + XGBoost cost model) into a
work directory that later builds apply (`relax.get_pipeline("tvm_ext", tune_db=DIR)`).

The trial budget is global to the module, as MetaSchedule's `max_trials_global`: the gradient
task scheduler spends it where the weighted kernel time drops most. Reuse: candidates already in
the database for these kernels count against the budget, so a second call with the same budget
tunes nothing, an interrupted run resumes with what is left, and a larger budget tunes the
difference. A run that ends early (every search space exhausted) is recorded as complete in
`state.json`, so it is not started again either.

Without a device for the target (CUDA on a machine with no GPU), tuning is build-only: the
candidates are generated, compiled (nvcc) and fed to the cost model, but none is timed; the
records go to a separate `.untimed` database that is never applied.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.utils import cpu_count, fork_seed

from tvm_ext.errors import UnavailableError
from tvm_ext.ir.targets import is_cpu
from tvm_ext.runtime.cuda import has_gpu

from .cost_model import load_cost_model, save_cost_model
from .database import best_seconds, count_records, database_dir, open_database, target_key
from .default_times import mark_pending, measure_default_times, record_loses, workload_key
from .interrupt import Interruptible, StopOnSignal
from .measure import PooledBuilder, UntimedRunner, timing_runner
from .progress import ProgressCallback, TaskProgress
from .tasks import TuningTask
from .tensor_intrinsics import import_tensor_intrinsics

STATE_FILE = "state.json"
POPULATION = 128  # of the evolutionary search; see _search_strategy


class NoDeviceError(UnavailableError):
    """Timed tuning was asked for, but there is no device for the target here."""


@dataclasses.dataclass
class TuningReport:
    target: str
    database: str  # the directory holding the records
    timed: bool  # False: build-only, nothing was timed
    budget: int  # the trial budget asked for
    trials_before: int  # candidates of these kernels already in the database
    trials_run: int  # candidates measured (or built, if not timed) by this call
    seconds: float
    tasks: list[TaskProgress]

    @property
    def tuned_nothing(self) -> bool:
        return self.trials_run == 0

    def kernel_ms(self) -> float | None:
        """Sum over kernels of weight x best time, None unless every kernel was timed."""
        if any(t.best_s is None for t in self.tasks):
            return None
        return sum(t.best_s * t.weight for t in self.tasks) * 1e3

    def to_json(self) -> dict:
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if f.name != "tasks"},
                "tasks": [dataclasses.asdict(t) for t in self.tasks]}

    @classmethod
    def from_json(cls, data: dict) -> TuningReport:
        return cls(**{**data, "tasks": [TaskProgress(**t) for t in data["tasks"]]})

    def format(self) -> str:
        """A table of the kernels, and a line saying what was (and was not) measured."""
        rows = [f"  {'kernel':<40} {'calls':>5} {'trials':>6} {'best ms':>10}"]
        for t in self.tasks:
            best = "-" if t.best_s is None else f"{t.best_s * 1e3:.4f}"
            rows.append(f"  {t.name[:40]:<40} {t.weight:>5} {t.trials_before + t.trials:>6} "
                        f"{best:>10}")
        if self.timed:
            total = self.kernel_ms()
            timed = sum(t.best_s is not None for t in self.tasks)
            rows.append(f"  {timed}/{len(self.tasks)} kernels timed; sum of weighted best times "
                        + ("n/a" if total is None else f"{total:.3f} ms"))
        else:
            built = sum(t.built for t in self.tasks)
            failed = sum(t.build_errors for t in self.tasks)
            rows.append(f"  build-only: {built} candidates built, {failed} failed to build, "
                        "NO candidate was timed (no device here); compile keeps the default "
                        "schedules")
        return "\n".join(rows)


def can_time(target: tvm.target.Target) -> bool:
    """Whether candidates for `target` can be timed on this machine."""
    if is_cpu(target):
        return True
    if target.kind.name == "cuda":
        return has_gpu()
    return bool(tvm.device(target.kind.name, 0).exist)


def tuning_target(target: tvm.target.Target) -> tvm.target.Target:
    """`target` with the attributes MetaSchedule's rules read and target tags usually carry:
    the cores to use on CPUs, thread and shared-memory limits on CUDA."""
    config = dict(target.export())
    if target.kind.name == "llvm":
        config.setdefault("num-cores", cpu_count(logical=False))
    elif target.kind.name == "cuda":
        config.setdefault("max_threads_per_block", int(config.get("max_num_threads", 1024)))
        # 48 KiB: the shared memory any CUDA GPU gives a block without opting in.
        config.setdefault("max_shared_memory_per_block", 48 * 1024)
    return tvm.target.Target(config)


def tune_tasks(
    tasks: list[TuningTask],
    target: tvm.target.Target,
    work_dir: str,
    trials: int,
    *,
    measure: bool | None = None,
    trials_per_iter: int | None = None,
    seed: int | None = 0,
    log: Callable[[str], None] | None = None,
) -> TuningReport:
    """Tune `tasks` (from `extract_tasks`); see `tvm_ext.driver.tune`."""
    log = log or _print
    if trials < 0:
        raise ValueError(f"the trial budget must be >= 0, got {trials}")
    timed = can_time(target) if measure is None else measure
    if timed and not can_time(target):
        raise NoDeviceError(f"no {target.kind.name} device here to time candidates on; tune "
                            "with measure=False (build-only) or on a machine with one")
    db_dir = database_dir(work_dir, target, timed)
    db = open_database(db_dir)
    counts = count_records(db, [t.mod for t in tasks])
    progress = [TaskProgress(t.name, t.weight, c, best_seconds(db, t.mod))
                for t, c in zip(tasks, counts, strict=True)]
    before = sum(counts)
    fingerprint = _fingerprint(tasks)
    state = _load_state(db_dir)
    remaining = 0 if state.get(fingerprint, 0) >= trials else trials - before
    report = TuningReport(target_key(target), db_dir, timed, trials, before, 0, 0.0, progress)
    if not tasks or remaining <= 0:
        log(f"tuning: nothing to tune: {len(tasks)} kernels, {before} trials already in {db_dir} "
            f"(budget {trials})")
        if tasks:
            _save_state(db_dir, state, fingerprint, trials)
        return report

    per_iter = trials_per_iter or step_size(remaining, len(tasks))
    log(f"tuning: {len(tasks)} kernels for {target_key(target)}, {remaining} trials "
        f"({before} already in the database), {per_iter} per search step, records in {db_dir}"
        + ("" if timed else "; BUILD-ONLY: no device here, no candidate will be timed"))
    start = time.perf_counter()
    callback = ProgressCallback(tasks, progress, before + remaining, before, timed, log)
    if timed:  # a record is applied once compared with the default, as the run ends
        mark_pending([t.mod for t in tasks], db_dir)
    cost_model = load_cost_model(db_dir)
    builder = PooledBuilder(target.kind.name, max_workers=cpu_count(logical=True))
    runner = timing_runner(target.kind.name) if timed else UntimedRunner()
    try:
        with Interruptible() as interruptible:
            _scheduler_tune(tasks, tuning_target(target), db_dir, db, remaining, per_iter, seed,
                            builder, runner, callback, StopOnSignal(interruptible), cost_model)
        _save_state(db_dir, state, fingerprint, trials)
    except BaseException as err:
        what = "interrupted" if isinstance(err, KeyboardInterrupt) else (
            f"failed ({type(err).__name__}: {(str(err).strip().splitlines() or [''])[-1]})")
        log(f"tuning {what} after {callback.trials} trials: {before + callback.trials} kept in "
            f"{db_dir}; run again with the same budget to finish")
        raise
    finally:
        save_cost_model(cost_model, db_dir)
        builder.shutdown()
    if timed:  # what each kernel costs without a record: records slower are not applied
        defaults = measure_default_times([t.mod for t in tasks], target, db_dir, db)
        log(_versus_defaults(tasks, defaults))
    report.trials_run = callback.trials
    report.seconds = time.perf_counter() - start
    past = callback.trials - remaining
    log(f"tuning: {callback.trials} trials in {report.seconds:.1f} s"
        + (f" ({past} past the budget: MetaSchedule measures whole search steps)"
           if past > 0 else "") + f"\n{report.format()}")
    return report


def step_size(remaining: int, num_tasks: int) -> int:
    """Candidates per search step: up to 16, fewer for a small budget per kernel; within half
    of that, the size whose last step runs least past the budget (MetaSchedule measures whole
    steps: 49 trials left measured 51 in steps of 16 or 12, 49 in steps of 7)."""
    cap = min(16, max(4, remaining // max(num_tasks, 1)), max(remaining, 1))
    sizes = range(cap, (cap + 1) // 2 - 1, -1)
    return min(sizes, key=lambda size: (-remaining % size, -size))


def _versus_defaults(tasks: list[TuningTask], defaults: dict[str, dict[str, float]]) -> str:
    """How many kernels' best records beat their default schedules (the others keep them)."""
    beaten, compared = 0, 0
    for t in tasks:
        if workload_key(t.mod) in defaults:
            compared += 1
            beaten += not record_loses(defaults, t.mod)
    return (f"tuning: the best record beats the default schedule for {beaten} of {compared} "
            "kernels; the others keep their default schedules")


def _scheduler_tune(tasks, target, db_dir, db, trials, per_iter, seed, builder, runner,
                    progress, stop, cost_model) -> None:
    """Each step's measure callbacks: `progress`, MetaSchedule's own (which store the
    records), then `stop`."""
    import_tensor_intrinsics()  # what TuneContext imports, in seconds (see the module)
    with _metaschedule_logs(db_dir, [t.name for t in tasks]) as loggers:
        contexts = [
            ms.TuneContext(mod=t.mod, target=target, space_generator="post-order-apply",
                           search_strategy=_search_strategy(), task_name=t.name, logger=logger,
                           rand_state=rand, num_threads="physical").clone()
            for t, logger, rand in zip(tasks, loggers, fork_seed(seed, len(tasks)), strict=True)
        ]
        ms.task_scheduler.TaskScheduler.create("gradient").tune(
            tasks=contexts,
            task_weights=[float(t.weight) for t in tasks],
            max_trials_global=trials,
            max_trials_per_task=trials,
            num_trials_per_iter=per_iter,
            builder=builder,
            runner=runner,
            measure_callbacks=[progress, *ms.measure_callback.MeasureCallback.create("default"),
                               stop],
            database=db,
            cost_model=cost_model,
        )


@contextlib.contextmanager
def _metaschedule_logs(db_dir: str, names: list[str]):
    """MetaSchedule's tables and per-trial logs go to files under db_dir/logs (its warnings to
    stderr), for this run only. (Its own `get_loggers_from_work_dir` fails when called twice in
    one process.)"""
    log_dir = os.path.join(db_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    fmt = logging.Formatter("%(asctime)s [%(levelname)s] %(message)s")

    def file_handler(name: str) -> logging.Handler:
        handler = logging.FileHandler(os.path.join(log_dir, name + ".log"))
        handler.setFormatter(fmt)
        return handler

    warn = logging.StreamHandler()
    warn.setLevel(logging.WARNING)
    top = logging.getLogger("tvm.s_tir.meta_schedule")
    attached = [(top, file_handler("task_scheduler")), (top, warn)]
    loggers = []
    for i, name in enumerate(names):
        # One logger per task, unique to this run (loggers live for the whole process).
        logger = logging.getLogger(f"tvm_ext.schedules.run{id(attached)}.task_{i}")
        attached.append((logger, file_handler(f"task_{i:02d}_{name[:80]}")))
        loggers.append(logger)
    saved = top.level, top.propagate
    top.setLevel(logging.INFO)
    top.propagate = False
    for logger in loggers:
        logger.setLevel(logging.INFO)
        logger.propagate = False
    for logger, handler in attached:
        logger.addHandler(handler)
    try:
        yield loggers
    finally:
        for logger, handler in attached:
            logger.removeHandler(handler)
            handler.close()
        top.level, top.propagate = saved


def _print(line: str) -> None:
    print(line, flush=True)


def _search_strategy() -> ms.search_strategy.EvolutionarySearch:
    # MetaSchedule's default population (512) makes mutation the main cost of a step on a
    # 2-core machine; the budgets here are small, and the cost model is untrained (random
    # scores) for its first 100 samples, so a smaller population loses little.
    return ms.search_strategy.EvolutionarySearch(population_size=POPULATION)


def _fingerprint(tasks: list[TuningTask]) -> str:
    hashes = sorted(str(tvm_ffi.structural_hash(t.mod)) for t in tasks)
    return hashlib.sha1(",".join(hashes).encode()).hexdigest()[:16]


def _load_state(db_dir: str) -> dict[str, int]:
    path = os.path.join(db_dir, STATE_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f).get("completed_budgets", {})


def _save_state(db_dir: str, state: dict[str, int], fingerprint: str, trials: int) -> None:
    state = {**state, fingerprint: max(trials, state.get(fingerprint, 0))}
    tmp = os.path.join(db_dir, STATE_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"completed_budgets": state}, f, indent=1)
    os.replace(tmp, os.path.join(db_dir, STATE_FILE))
