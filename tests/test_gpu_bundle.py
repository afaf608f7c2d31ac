"""scripts/gpu_bundle.py (tvm_ext.driver.gpu_bundle) and the checks the bundle runs
(tvm_ext.runtime.gpu_checks): built from this checkout, the bundle imports with TVM's runtime
alone (no compiler library, nothing but numpy beside the standard library), runs its CPU
self-check and marks the GPU checks skipped here; its size is printed and under the limit."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from built_once import built_once

from tvm_ext.cli.gpu_bundle import main
from tvm_ext.driver import gpu_bundle
from tvm_ext.runtime.cuda import CudaUnavailableError, ensure_cuda_runtime
from tvm_ext.runtime.gpu_checks.bundle import Bundle

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "gpu_bundle.py")
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> tuple[str, str]:
    """A quick bundle (tiny models, no tuning batch), for this Python only (no download)."""

    def build(folder) -> None:
        proc = subprocess.run([sys.executable, SCRIPT, str(folder / "bundle"), "--quick",
                               "--python", PYTHON], capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        (folder / "stdout.txt").write_text(proc.stdout)

    folder = built_once(tmp_path_factory, "gpu_bundle", build)
    return str(folder / "bundle"), (folder / "stdout.txt").read_text()


@pytest.fixture(scope="module")
def results(bundle, tmp_path_factory) -> dict:
    """The bundle's checks run by `python -S` with only numpy on the path: no site-packages,
    so no compiler, no tvm_ext install, no numba, no torch; and no nvcc on PATH, as on a GPU
    machine that has the CUDA driver and runtime only."""
    out, _ = bundle

    def build(work) -> None:
        numpy_only = work / "numpy_only"
        numpy_only.mkdir()
        root = os.path.dirname(os.path.dirname(np.__file__))
        for name in ("numpy", "numpy.libs"):
            if os.path.exists(os.path.join(root, name)):
                os.symlink(os.path.join(root, name), numpy_only / name)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TVM"))}
        # No bytecode into the bundle (its Disco workers too): the size test counts its files.
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env["PYTHONPATH"] = str(numpy_only)
        env["PATH"] = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                                      if not os.path.isfile(os.path.join(p, "nvcc")))
        proc = subprocess.run([sys.executable, "-S", os.path.join(out, "run_gpu_checks.py"),
                               "--out", str(work / "gpu_results.json")], capture_output=True,
                              text=True, env=env, cwd=work, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    path = built_once(tmp_path_factory, "gpu_bundle_run", build) / "gpu_results.json"
    data = json.loads(path.read_text())
    data["_path"] = str(path)
    return data


def _checks(results: dict) -> dict[str, dict]:
    return {c["name"]: c for c in results["checks"]}


def test_size_is_printed_and_under_the_limit(bundle):
    out, stdout = bundle
    printed = re.search(r"bundle  .*: (\d+) files, ([\d.]+) MiB \(limit 60 MiB\)", stdout)
    assert printed, stdout
    size, files = gpu_bundle.tree_size(out)
    assert int(printed.group(1)) == files
    assert abs(float(printed.group(2)) - size / 2**20) < 0.06
    assert size < gpu_bundle.SIZE_LIMIT


def test_the_runtime_tree_has_no_compiler(bundle):
    out, _ = bundle
    names = {os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs}
    assert not any(n.endswith("libtvm_compiler.so") for n in names)
    for left_out in ("site/tvm/relax/", "site/tvm/include/", "site/tvm/3rdparty/",
                     "site/tvm_ext/pipeline.py", "site/tvm_ext/passes/", "site/tvm_ext/models/"):
        assert not any(n.startswith(left_out) for n in names), left_out
    for needed in ("run_gpu_checks.py", "manifest.json", "site/tvm/lib/libtvm_runtime.so",
                   "site/tvm_ext/lib/libtvm_ext_runtime.so", "site/tvm_ffi/lib/libtvm_ffi.so",
                   "site/tvm_ext/runtime/gpu_checks/__init__.py"):
        assert needed in names, needed
    manifest = Bundle(out).manifest
    assert manifest["arch"] == "sm_90" and set(manifest["suites"]) == {"cuda", "llvm"}
    assert Bundle(out).verify() == {"missing": [], "changed": []}


def test_self_check_passes_and_gpu_checks_are_skipped(bundle, results):
    checks = _checks(results)
    assert checks["bundle/integrity"]["status"] == "pass"
    runtime = checks["bundle/runtime-only"]
    assert runtime["status"] == "pass" and runtime["data"]["runtime_only"]
    planned = gpu_bundle.planned_checks(bundle[0])
    assert {n for n in planned if n.startswith("llvm/")} <= set(checks)
    # On the GPU, cuDNN's convolutions are checked against TVM's code before they are timed.
    conv = [e for e in Bundle(bundle[0]).suite("cuda")["conv"]]
    assert len(conv) == 2 and all(e["library"] and e["tvm"] for e in conv)
    assert {f"cuda/conv/{e['name']}" for e in conv} <= set(planned)
    for name, check in checks.items():
        if name.startswith("llvm/"):
            assert check["status"] == "pass", (name, check["reason"])
        elif name.startswith("cuda/") and name != "cuda/load":
            assert check["status"] == "skipped" and "no CUDA device" in check["reason"], name
    try:  # where TVM's CUDA runtime loads, the CUDA modules load through the stub, nvcc or not
        ensure_cuda_runtime()
        loads = True
    except CudaUnavailableError:
        loads = False
    assert checks["cuda/load"]["status"] == ("pass" if loads else "skipped"), checks["cuda/load"]
    assert results["summary"]["fail"] == 0


def test_self_check_figures(results):
    checks = _checks(results)
    swapped = [c for n, c in checks.items() if n.startswith("llvm/swap/")
               and "budget" in c["data"]]
    assert {c["data"]["budget_label"] for c in swapped} == {"75%", "min"}
    for check in swapped:
        data = check["data"]
        assert 0 < data["measured_peak"] <= data["budget"]
        # The streams moved what the plan swaps (its sizes are rounded up to 256 bytes).
        moved = data["bytes_out_per_call"] + data["bytes_in_per_call"]
        planned = data["planned_bytes_out"] + data["planned_bytes_in"]
        assert 0 < moved <= planned < moved + 256 * data["planned_copies"]
        assert 0 <= data["overlap_runtime"] <= 1
        # Run again as a user runs it: tvm_ext.runtime.load places the arguments itself.
        assert data["runtime_load"] == "outputs equal the measured run's"
        # No numba beside the bundle here: the simulation waits for --finish.
        assert data["simulated_ms"] is None and "--finish" in data["simulated"]
    copies = checks["llvm/copies"]["data"]
    assert copies["rows"][0]["h2d_bytes_per_s"] > 0
    # Strided chunk copies, one per row width, their bytes checked on the way back.
    assert [r["row_bytes"] for r in copies["strided"]] == [4, 64, 1024]
    assert all(r["rows"] == 256 and r["h2d_us"] > 0 and r["d2h_us"] > 0
               for r in copies["strided"])
    zoo = [c for n, c in checks.items() if n.startswith("llvm/zoo/")]
    assert len(zoo) == 2 and all(c["data"]["max_abs_error"] == 0 for c in zoo)
    gemm = next(c for n, c in checks.items() if n.startswith("llvm/gemm/"))
    assert gemm["data"]["tvm_ms"] > 0 and "torch is not importable" in gemm["data"]["torch"]
    # The convolutions: a forward and a gradient (another storage order); no library here.
    convs = [c["data"] for n, c in checks.items() if n.startswith("llvm/conv/")]
    assert len(convs) == 2 and len({str(c["axes"]) for c in convs}) == 2
    assert all(c["tvm_ms"] > 0 and c["library_ms"] is None for c in convs)


def test_finish_adds_the_simulation(bundle, results, tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({k: v for k, v in results.items() if k != "_path"}))
    assert main([bundle[0], "--finish", str(path)]) == 0
    checks = _checks(json.loads(path.read_text()))
    for label in ("75%", "min"):
        data = checks[f"llvm/swap/{label}"]["data"]
        assert data["simulated_ms"] > 0 and data["measured_vs_simulated"] > 0
        assert data["simulated_untimed_kernels"] == []
        assert data["dispatch_overhead_us"] >= 0  # calibrated from the unswapped run
    first = {label: checks[f"llvm/swap/{label}"]["data"]["simulated_ms"]
             for label in ("75%", "min")}
    assert main([bundle[0], "--finish", str(path)]) == 0  # simulated again: the same
    checks = _checks(json.loads(path.read_text()))
    assert {label: checks[f"llvm/swap/{label}"]["data"]["simulated_ms"]
            for label in first} == first


def test_bad_output_folder_is_refused_before_compiling(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("keep me")
    assert main([str(tmp_path), "--quick"]) == 2
    assert "holds no bundle" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("argv, message", [
    (["--finish", "r.json", "--quick"], "only shape a build"),
    (["--finish", "r.json", "--import-tuning", "r.json"], "one at a time"),
    (["--python", "3"], "like 3.12"),
    (["--arch", "hopper"], "like sm_90"),
    (["--tune-trials", "-1"], ">= 0"),
])
def test_bad_options_exit_2(tmp_path, argv, message, capsys):
    assert main([str(tmp_path / "b"), *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.sweep  # the quick bundle's test covers the same build and load path
def test_full_size_artefacts_build_and_load(tmp_path):
    """The GPU suite's full-size parts (the swapped gpt `medium` training step at 50%, 25% and
    the smallest budget, the `large` GEMMs, the partitioned gpt `small`), bounded: one zoo
    model, no tuning batch (tests/test_schedules_offline.py covers it), 2 s of swap planning
    per budget. Every CUDA module loads and holds device code."""
    cuda = dataclasses.replace(gpu_bundle.GPU_SUITE, zoo=("gpt",), tune_trials=0,
                               swap_time_budget=2.0)
    config = gpu_bundle.BundleConfig(cuda=cuda, python_versions=(PYTHON,), nccl=False)
    report = gpu_bundle.build_bundle(str(tmp_path / "bundle"), config, log=lambda line: None)
    assert report.size_bytes < gpu_bundle.SIZE_LIMIT
    checks = gpu_bundle.planned_checks(report.directory)
    assert {"cuda/swap/50%", "cuda/swap/25%", "cuda/swap/min"} <= set(checks)
    assert len([c for c in checks if c.startswith("cuda/gemm/")]) == 4
    code = ("import sys, json; sys.path.insert(0, sys.argv[1] + '/site')\n"
            "from tvm_ext.runtime.gpu_checks import Bundle, Skip, check_cuda_modules_load\n"
            "try:\n    print(json.dumps(check_cuda_modules_load(Bundle(sys.argv[1]))))\n"
            "except Skip as err:\n    print(json.dumps({'skipped': str(err)}))\n")
    loaded = subprocess.run([sys.executable, "-c", code, report.directory],
                            capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    result = json.loads(loaded.stdout.splitlines()[-1])
    if "skipped" in result:
        pytest.skip(result["skipped"])
    assert result["modules"] >= 14
