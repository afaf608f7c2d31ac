"""Smoke test of benchmarks/vs_torch.py: one tiny model (`--quick --trials 0`), run as a user
runs it, writes the JSON benchmarks/README.md's table comes from, and every tvm_ext build it times
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


def test_tuned_is_judged_on_paired_rounds():
    """Tuned against untuned: each round's median ratio, the median over rounds, and a 95%
    interval; a row is slower only when the whole interval lies above 1."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import vs_torch

    base = [[10.0, 10.2, 9.9] for _ in range(9)]
    slower = [[x * 1.05 for x in r] for r in base]
    paired = vs_torch.paired_ratio(slower, base)
    assert paired["ratio"] == pytest.approx(1.05) and paired["rounds"] == 9
    assert paired["ci95"][0] == pytest.approx(1.05) and paired["ci95"][1] == pytest.approx(1.05)
    # Load that comes and goes hits both builds of a round alike: the pairing removes it.
    loaded = [[x * (1 + k % 3) for x in r] for k, r in enumerate(base)]
    assert vs_torch.paired_ratio([[x * 1.05 for x in r] for r in loaded], loaded)["ratio"] == \
        pytest.approx(1.05)
    # Noise either way: the interval reaches 1, so the row is not slower.
    noisy = [[x * (1.03 if k % 2 else 0.98) for x in r] for k, r in enumerate(base)]
    row = {"model": "m", "mode": "inference", "tuned_vs_untuned": vs_torch.paired_ratio(noisy,
                                                                                         base),
           "builds": {"tuned": {"ms": 1.0, "ratio": 1.0}, "untuned": {"ms": 1.0, "ratio": 1.0}}}
    lo, hi = row["tuned_vs_untuned"]["ci95"]
    assert lo <= 1.0 <= hi
    assert not vs_torch._measurably_slower(row, row["tuned_vs_untuned"]["ratio"])
    targets = {t["name"]: t for t in vs_torch.evaluate_targets([row], [], trials=1)}
    assert targets["tuned"]["status"] == "PASS"
    row["tuned_vs_untuned"] = paired
    assert vs_torch.evaluate_targets([row], [], trials=1)[-1]["status"] == "MISS"
