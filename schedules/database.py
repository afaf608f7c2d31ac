"""The tuning work directory: one MetaSchedule JSON database per target, appended as it goes.

Layout of a work dir `DIR`:

    DIR/<target key>/database_workload.json       kernels (one TIR module per line)
    DIR/<target key>/database_tuning_record.json  one line per measured candidate
    DIR/<target key>/cost_model.tar               the XGBoost cost model and its training data
    DIR/<target key>/state.json                   budgets completed per module (see tuning.py)
    DIR/<target key>/logs/                        MetaSchedule's own logs
    DIR/<target key>.untimed/...                  the same for build-only tuning (no device):
                                                  its records carry no time and are never applied

MetaSchedule appends a line per candidate and flushes it, so a killed run keeps every finished
trial; a run killed in the middle of a write leaves a torn last line, which `open_database`
drops (anything else that does not parse is an error).
"""

from __future__ import annotations

import json
import os
import re
import warnings

import tvm
from tvm.s_tir import meta_schedule as ms

from tvm_ext.errors import InputError

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
UNTIMED_SUFFIX = ".untimed"
# MetaSchedule's stub for "no time": failed and untimed candidates are stored with it.
NO_TIME = 1e10


class TuningDatabaseError(InputError):
    """A tuning database that cannot be read."""


def target_key(target: tvm.target.Target) -> str:
    """A readable directory name per code-generation target: `llvm`, `llvm-znver5`, `cuda-sm_90`."""
    parts = [target.kind.name]
    for attr in ("arch", "mcpu", "mattr"):
        value = target.attrs.get(attr)
        if value:
            parts.append(",".join(str(v) for v in value) if not isinstance(value, str) else value)
    return re.sub(r"[^A-Za-z0-9_.,+-]", "_", "-".join(parts))


def database_dir(work_dir: str, target: tvm.target.Target, timed: bool = True) -> str:
    """Where the records of `target` live in `work_dir` (`timed=False`: build-only tuning)."""
    return os.path.join(work_dir, target_key(target) + ("" if timed else UNTIMED_SUFFIX))


def has_database(db_dir: str) -> bool:
    return os.path.isfile(os.path.join(db_dir, WORKLOAD_FILE)) and os.path.isfile(
        os.path.join(db_dir, RECORD_FILE)
    )


def open_database(db_dir: str, create: bool = True) -> ms.database.JSONDatabase:
    """The JSON database in `db_dir`, torn last lines (from a killed run) dropped first."""
    if not create and not has_database(db_dir):
        raise TuningDatabaseError(f"no tuning database in {db_dir}")
    os.makedirs(db_dir, exist_ok=True)
    workload_path = os.path.join(db_dir, WORKLOAD_FILE)
    record_path = os.path.join(db_dir, RECORD_FILE)
    n_workloads = _repair(workload_path, lambda obj: True)
    _repair(record_path, lambda obj: isinstance(obj, list) and len(obj) == 2
            and isinstance(obj[0], int) and 0 <= obj[0] < n_workloads)
    return ms.database.JSONDatabase(
        path_workload=workload_path, path_tuning_record=record_path, allow_missing=True,
        module_equality="structural",
    )


def _repair(path: str, valid) -> int:
    """Drop a torn last line of `path`; return the number of lines kept."""
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    kept = []
    for i, line in enumerate(lines):
        try:
            ok = valid(json.loads(line))
        except json.JSONDecodeError:
            ok = False
        if ok:
            kept.append(line)
        elif i == len(lines) - 1:
            warnings.warn(f"{path}: dropped a torn last line (a tuning run was killed while "
                          "writing it)", stacklevel=3)
        else:
            raise TuningDatabaseError(f"{path}, line {i + 1}: not a tuning database line; "
                                      "the file is corrupt: delete it to start afresh")
    if len(kept) != len(lines):
        with open(path, "w") as f:
            f.write("".join(line + "\n" for line in kept))
    return len(kept)


def record_seconds(record: ms.database.TuningRecord) -> float | None:
    """The median measured time of a record, None when it was not timed (or failed)."""
    if record.run_secs is None:
        return None
    secs = sorted(float(s) for s in record.run_secs)
    if not secs or secs[0] >= NO_TIME:
        return None
    return secs[len(secs) // 2]


def count_records(db: ms.database.Database, mods: list[tvm.IRModule]) -> list[int]:
    """How many candidates (timed, failed or untimed) the database holds for each kernel."""
    workloads = [db.commit_workload(m) if db.has_workload(m) else None for m in mods]
    counts = [0] * len(mods)
    if not any(w is not None for w in workloads):
        return counts
    for record in db.get_all_tuning_records():
        for i, w in enumerate(workloads):
            if w is not None and record.workload.same_as(w):
                counts[i] += 1
                break
    return counts


def best_seconds(db: ms.database.Database, mod: tvm.IRModule) -> float | None:
    """The best measured time of a kernel, None when the database holds no timed record."""
    if not db.has_workload(mod):
        return None
    top = db.get_top_k(db.commit_workload(mod), 1)
    return record_seconds(top[0]) if top else None
