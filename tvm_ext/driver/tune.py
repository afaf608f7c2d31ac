"""Tune a model's kernels as the tvm_ext pipeline will compile them."""

from __future__ import annotations

from collections.abc import Callable

import tvm

from tvm_ext.schedules import BatchExport, TuningReport, export_batch, extract_tasks, tune_tasks

from .. import pipeline


def tune(
    mod: tvm.IRModule,
    target: tvm.target.Target,
    work_dir: str,
    trials: int,
    *,
    measure: bool | None = None,
    trials_per_iter: int | None = None,
    seed: int | None = 0,
    log: Callable[[str], None] | None = None,
    **pipeline_options,
) -> TuningReport:
    """Tune the kernels of `mod` as the tvm_ext pipeline will compile them.

    Args:
        mod: a Relax module, as given to `tvm.compile` (before the pipeline).
        target: the compilation target (the same one the build uses).
        work_dir: the tuning work directory (created if missing; shared by models and targets).
        trials: the trial budget for all kernels of `mod` together.
        measure: time candidates on the device (default: when there is one; False: build only).
        trials_per_iter: candidates per search iteration (default: from the budget).
        seed: the search's random seed (None: random).
        log: where progress lines go (default: stdout, flushed).
        pipeline_options: options of `pipeline.phases` that shape the kernels (e.g. a partition
            plan), so tasks are the kernels the build will see.
    """
    staged = pipeline.module_at_schedule_phase(mod, target, **pipeline_options)
    return tune_tasks(extract_tasks(staged, target), target, work_dir, trials, measure=measure,
                      trials_per_iter=trials_per_iter, seed=seed, log=log)


def export_tuning_batch(
    mod: tvm.IRModule,
    target: tvm.target.Target,
    work_dir: str,
    out_dir: str,
    trials: int,
    *,
    trials_per_iter: int | None = None,
    seed: int | None = 0,
    log: Callable[[str], None] | None = None,
    **pipeline_options,
) -> BatchExport:
    """Offline tuning, step 1 (`tvm_ext.schedules.offline`): search build-only for the kernels
    of `mod` as the pipeline will compile them, and export the candidates to `out_dir` to be
    timed on a machine that has the target's device."""
    staged = pipeline.module_at_schedule_phase(mod, target, **pipeline_options)
    return export_batch(extract_tasks(staged, target), target, work_dir, out_dir, trials,
                        trials_per_iter=trials_per_iter, seed=seed, log=log)
