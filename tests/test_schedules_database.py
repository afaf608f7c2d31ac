"""The tuning work dir's files: per-target directories, torn-line repair, record times."""

import json
import os

import pytest
import tvm

from tvm_ext.schedules import database as db_mod
from tvm_ext.schedules.database import (
    RECORD_FILE,
    WORKLOAD_FILE,
    TuningDatabaseError,
    database_dir,
    open_database,
    target_key,
)


def test_target_keys_separate_code_generators():
    assert target_key(tvm.target.Target("llvm")) == "llvm"
    assert target_key(tvm.target.Target({"kind": "llvm", "mcpu": "znver5"})) == "llvm-znver5"
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host="llvm")
    assert target_key(cuda) == "cuda-sm_90"
    assert database_dir("W", cuda, timed=False) == os.path.join("W", "cuda-sm_90.untimed")


def _write(path, lines):
    with open(path, "w") as f:
        f.write("".join(line + "\n" for line in lines))


def test_open_drops_a_torn_last_line(tmp_path):
    # A real database with one workload and no records, then a torn record line as a killed
    # run leaves it.
    db = open_database(str(tmp_path))
    from tvm import te

    a = te.placeholder((4,), name="A")
    b = te.compute((4,), lambda i: a[i] + 1.0, name="B")
    db.commit_workload(tvm.IRModule({"main": te.create_prim_func([a, b])}))
    del db
    with open(tmp_path / RECORD_FILE, "a") as f:
        f.write('[0, [[["GetSBlock", [], [')  # no newline: the write was cut short
    with pytest.warns(UserWarning, match="torn last line"):
        db = open_database(str(tmp_path))
    assert len(db) == 0
    assert (tmp_path / RECORD_FILE).read_text() == ""
    assert len((tmp_path / WORKLOAD_FILE).read_text().splitlines()) == 1


def test_open_refuses_corruption_in_the_middle(tmp_path):
    _write(tmp_path / WORKLOAD_FILE, [])
    _write(tmp_path / RECORD_FILE, ["not json", json.dumps([0, []])])
    with pytest.raises(TuningDatabaseError, match="line 1"):
        open_database(str(tmp_path))


def test_open_without_create_needs_a_database(tmp_path):
    with pytest.raises(TuningDatabaseError, match="no tuning database"):
        open_database(str(tmp_path / "missing"), create=False)
    assert not (tmp_path / "missing").exists()


class _Record:
    def __init__(self, run_secs):
        self.run_secs = run_secs


def test_record_seconds_ignores_untimed_records():
    assert db_mod.record_seconds(_Record([3e-3, 1e-3, 2e-3])) == 2e-3
    assert db_mod.record_seconds(_Record([db_mod.NO_TIME])) is None
    assert db_mod.record_seconds(_Record(None)) is None
