"""Offline tuning: tune for a target this machine cannot run (CUDA without a GPU), time the
candidates where they can run, and bring the times back into the tuning database.

    1. here   `export_batch(tasks, target, work_dir, out_dir, trials)`: the build-only search of
              `tune_tasks(measure=False)` (candidates generated and compiled, none timed, kept in
              `work_dir`'s `.untimed` database), then every candidate of these kernels in that
              database not yet measured is compiled into one library, `out_dir/candidates.so`,
              described by `out_dir/batch.json` (each candidate's kernel, workload and trace).
    2. there  `tvm_ext.runtime.candidate_batch.measure_batch(out_dir, device)`: times each
              candidate with TVM's runtime alone (the GPU bundle runs it) into
              `measurements.json`.
    3. here   `import_measurements(out_dir, measurements, work_dir)`: each timed candidate becomes
              a tuning record with its measured `run_secs` in `work_dir`'s timed database for the
              target, so `ApplyTuningDatabase` (`tune_db=work_dir`) builds each kernel with its
              fastest candidate. A batch is imported once; a later export leaves out what was.

One round samples the search space with an untrained cost model (nothing was timed when the
candidates were generated); a larger budget in a second round adds new candidates.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

from tvm_ext.errors import InputError
from tvm_ext.runtime.candidate_batch import (
    BATCH_FILE,
    FORMAT,
    LIBRARY_FILE,
    MEASUREMENTS_FILE,
    read_batch,
)
from tvm_ext.runtime.kernel_timing import kernel_params

from .database import database_dir, has_database, open_database, target_key
from .tasks import TuningTask
from .tuning import TuningReport, tune_tasks

IMPORTED_FILE = "offline_imports.json"  # in the timed database: batches and candidates imported


@dataclasses.dataclass
class BatchExport:
    """What `export_batch` wrote."""

    directory: str
    candidates: int
    failed: list[str]  # candidates that did not compile into the library
    tuning: TuningReport


@dataclasses.dataclass
class MeasurementImport:
    """What `import_measurements` brought into the database."""

    database: str
    imported: int
    untimed: int  # candidates the measurements carry no time for (failed, not reached)
    already_imported: bool


def export_batch(tasks: list[TuningTask], target: tvm.target.Target, work_dir: str,
                 out_dir: str, trials: int, *, trials_per_iter: int | None = None,
                 seed: int | None = 0, log: Callable[[str], None] | None = None
                 ) -> BatchExport:
    """Search build-only (see `tune_tasks`), then write every candidate of `tasks` not yet
    measured into `out_dir` (created; a batch already there is replaced)."""
    log = log or (lambda line: print(line, flush=True))
    report = tune_tasks(tasks, target, work_dir, trials, measure=False,
                        trials_per_iter=trials_per_iter, seed=seed, log=log)
    records = _candidates(tasks, target, work_dir)
    funcs, failed, kept = {}, [], []
    for i, (task_index, record) in enumerate(records):
        name = f"candidate_{i:04d}"
        try:
            funcs[name] = _scheduled(record).with_attr("global_symbol", name)
            kept.append((name, task_index, record))
        except Exception as err:  # a trace that no longer applies: leave the candidate out
            failed.append(f"{name} ({tasks[task_index].name}): {type(err).__name__}")
    library, unbuilt = _build_library(funcs, target)
    failed += unbuilt
    kept = [k for k in kept if k[0] not in unbuilt]
    os.makedirs(out_dir, exist_ok=True)
    for stale in (MEASUREMENTS_FILE,):
        if os.path.exists(os.path.join(out_dir, stale)):
            os.remove(os.path.join(out_dir, stale))
    if library is not None:
        library.export_library(os.path.join(out_dir, LIBRARY_FILE))
    batch = _batch_json(tasks, target, kept)
    with open(os.path.join(out_dir, BATCH_FILE + ".tmp"), "w") as f:
        json.dump(batch, f)
    os.replace(os.path.join(out_dir, BATCH_FILE + ".tmp"), os.path.join(out_dir, BATCH_FILE))
    log(f"offline tuning: {len(kept)} candidates of {len(tasks)} kernels for "
        f"{target_key(target)} in {out_dir}" + (f"; {len(failed)} did not compile" if failed
                                                 else ""))
    return BatchExport(out_dir, len(kept), failed, report)


def _candidates(tasks: list[TuningTask], target: tvm.target.Target, work_dir: str
                ) -> list[tuple[int, ms.database.TuningRecord]]:
    """(task index, record) of every build-only candidate of `tasks` not imported before."""
    untimed = database_dir(work_dir, target, timed=False)
    if not has_database(untimed):
        return []
    db = open_database(untimed, create=False)
    workloads = [db.commit_workload(t.mod) if db.has_workload(t.mod) else None for t in tasks]
    done = _imported(database_dir(work_dir, target)).get("candidates", [])
    out = []
    for record in db.get_all_tuning_records():
        for i, w in enumerate(workloads):
            if w is not None and record.workload.same_as(w):
                if _candidate_key(record) not in done:
                    out.append((i, record))
                break
    return out


def _scheduled(record: ms.database.TuningRecord) -> tvm.tirx.PrimFunc:
    """The candidate's kernel: its workload with its trace applied, as the builder builds it."""
    sch = tvm.s_tir.Schedule(record.workload.mod)
    record.trace.apply_to_schedule(sch, remove_postproc=False)
    return RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(sch.mod)["main"]


def _build_library(funcs: dict[str, tvm.tirx.PrimFunc], target: tvm.target.Target):
    """All candidates in one library (one nvcc call for CUDA); if that fails, each alone, to
    leave out those that do not compile. Returns (library or None, names left out)."""
    if not funcs:
        return None, []
    try:
        return _build(funcs, target), []
    except Exception:
        good = {}
        for name, func in funcs.items():
            try:
                _build({name: func}, target)
                good[name] = func
            except Exception:
                continue
        bad = [n for n in funcs if n not in good]
        return (_build(good, target) if good else None), bad


def _build(funcs: dict[str, tvm.tirx.PrimFunc], target: tvm.target.Target):
    with target:  # nvcc reads the current target
        return tvm.tirx.build(tvm.IRModule(funcs), target=target)


def _batch_json(tasks: list[TuningTask], target: tvm.target.Target, kept: list) -> dict:
    entries = []
    for name, task_index, record in kept:
        func = record.workload.mod["main"]
        entries.append({
            "function": name, "task": tasks[task_index].name, "task_index": task_index,
            "params": [list(p) for p in kernel_params(func)],
            "key": _candidate_key(record), "record": record.as_json()})
    ident = hashlib.sha1(json.dumps([e["key"] for e in entries]).encode()).hexdigest()[:16]
    return {"format": FORMAT, "id": ident, "target": json.loads(str(target)),
            "target_key": target_key(target), "library": LIBRARY_FILE,
            "tasks": [{"name": t.name, "weight": t.weight,
                       "workload": ms.database.Workload(t.mod).as_json()} for t in tasks],
            "candidates": entries}


def _candidate_key(record: ms.database.TuningRecord) -> str:
    trace = json.dumps(record.as_json()[0], sort_keys=True)
    shash = str(tvm_ffi.structural_hash(record.workload.mod))
    return hashlib.sha1((shash + trace).encode()).hexdigest()[:20]


def import_measurements(batch_dir: str, measurements: dict | str, work_dir: str
                        ) -> MeasurementImport:
    """Bring a batch's measurements (a dict, or the path of `measurements.json` or of a GPU
    bundle's results JSON that holds them) into `work_dir`'s timed database for the batch's
    target."""
    batch = read_batch(batch_dir)
    data = _read_measurements(measurements)
    if data.get("batch") != batch["id"]:
        raise InputError(f"these measurements are of batch {data.get('batch')}, the batch in "
                         f"{batch_dir} is {batch['id']}: measure that batch")
    rows = data["candidates"]
    if [r["function"] for r in rows] != [c["function"] for c in batch["candidates"]]:
        raise InputError("the measurements list other candidates than the batch")
    target = tvm.target.Target(batch["target"])
    db_dir = database_dir(work_dir, target)
    imported = _imported(db_dir)
    if batch["id"] in imported.get("batches", []):
        return MeasurementImport(db_dir, 0, 0, already_imported=True)
    db = open_database(db_dir)
    workloads = [db.commit_workload(ms.database.Workload.from_json(t["workload"]).mod)
                 for t in batch["tasks"]]
    count = 0
    for cand, row in zip(batch["candidates"], rows, strict=True):
        if not row.get("seconds"):
            continue
        workload = workloads[cand["task_index"]]
        record = ms.database.TuningRecord.from_json(cand["record"], workload)
        db.commit_tuning_record(ms.database.TuningRecord(
            record.trace, workload, run_secs=[float(s) for s in row["seconds"]],
            target=record.target, args_info=record.args_info))
        count += 1
    imported.setdefault("batches", []).append(batch["id"])
    imported.setdefault("candidates", []).extend(c["key"] for c in batch["candidates"])
    _write_json(os.path.join(db_dir, IMPORTED_FILE), imported)
    return MeasurementImport(db_dir, count, len(rows) - count, already_imported=False)


def _read_measurements(measurements: dict | str) -> dict:
    if isinstance(measurements, str):
        try:
            with open(measurements) as f:
                measurements = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise InputError(f"cannot read measurements from {measurements}: {err}") from None
    if "candidates" not in measurements:  # a GPU bundle's results JSON holds them
        measurements = measurements.get("tuning_measurements") or {}
    if "candidates" not in measurements:
        raise InputError("no tuning measurements in the given JSON")
    return measurements


def _imported(db_dir: str) -> dict:
    path = os.path.join(db_dir, IMPORTED_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _write_json(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)
