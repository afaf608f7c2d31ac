"""Smoke test of benchmarks/vs_torch.py: one tiny model (`--quick --trials 0`), run as a user
runs it, writes the JSON the README's table comes from, and every tvm_ext build it times
agrees with PyTorch eager. No timing is asserted: the figures are the benchmark's to report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("vs_torch") / "vs_torch.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "vs_torch.py"), "--quick", "--trials", "0",
         "--models", "gpt2", "--json", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(path.read_text())
    data["_returncode"], data["_stdout"] = proc.returncode, proc.stdout
    return data


def test_json_has_the_figures(result):
    assert result["benchmark"] == "vs_torch" and result["quick"] is True
    assert {"cpu", "cores", "TVM_NUM_THREADS"} <= set(result["machine"])
    assert result["threads"]["torch_threads"] == result["threads"]["tvm_runtime_threads"]
    assert result["builds"] == ["torch", "untuned", "no_library"]  # --trials 0: no tuned
    assert [(r["model"], r["mode"]) for r in result["rows"]] == [("gpt2", "inference"),
                                                                 ("gpt2", "training")]
    for row in result["rows"]:
        assert row["torch_ms"] > 0 and row["parameters"] > 0
        assert set(row["builds"]) == {"untuned", "no_library"}
    assert len(result["gemms"]) == 1 and result["gemms"][0]["numpy_ms"] > 0
    statuses = {t["name"]: t["status"] for t in result["targets"]}
    assert list(statuses) == ["every_model", "language_models", "zoo_gpt", "gemm", "tuned"]
    assert set(statuses.values()) <= {"PASS", "MISS", "NOT MEASURED"}
    # Only gpt2 ran, and nothing was tuned: these cannot be claimed either way.
    assert statuses["zoo_gpt"] == "NOT MEASURED"
    assert statuses["tuned"] == "NOT MEASURED"
    assert "| gpt2 | training |" in result["_stdout"]


def test_every_build_agrees_with_torch_and_is_timed(result):
    for row in result["rows"]:
        for build, column in row["builds"].items():
            where = f"{row['model']} {row['mode']} {build}"
            assert "error" not in column, f"{where}: {column['error']}"
            assert column["check"]["ok"], f"{where}: {column['check']}"
            assert column["ms"] > 0 and column["ratio"] > 0
    gemm = result["gemms"][0]
    assert gemm["dispatched"] and gemm["check"]["ok"] and gemm["tvm_ext_ms"] > 0
    assert result["_returncode"] == 0
