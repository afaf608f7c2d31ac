"""scripts/compile.py end to end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tvm_ext.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "compile.py")


def test_run_check_report(tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["mlp", "--target", "llvm", "--run", "--check", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "check   OK" in out and "measured peak" in out
    data = json.loads(report.read_text())
    assert data["check"]["ok"] and data["run"]["measured_peak_bytes"] > 0
    assert data["graph"]["ops"] > 0 and data["model_summary"]["name"] == "mlp"


def test_training_export_and_overrides(tmp_path, capsys):
    so = tmp_path / "m.so"
    argv = ["resnet", "--training", "--set", "widths=4,8", "--output", str(so), "--run"]
    assert main(argv) == 0
    assert so.stat().st_size > 0 and "training step" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["vgg"], "unknown model"),
    (["mlp", "--set", "layers"], "FIELD=VALUE"),
    (["mlp", "--size", "huge"], "unknown size"),
    (["missing.onnx"], "does not exist"),
])
def test_bad_input_exits_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cuda_export_holds_device_code(tmp_path):
    """--target cuda on a machine without a GPU compiles with nvcc and exports a module whose
    CUDA part is a cubin (an ELF image with .nv.info sections, embedded in the library), and
    which loads back through TVM's CUDA runtime."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH: CUDA code cannot be compiled here")
    so = tmp_path / "gpt_cuda.so"
    proc = subprocess.run([sys.executable, SCRIPT, "gpt", "--target", "cuda", "--output",
                           str(so)], capture_output=True, text=True, timeout=600)
    if proc.returncode == 2 and "CUDA runtime does not load" in proc.stderr:
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stderr
    check = f"""
import tvm, tvm_ext
from tvm_ext.cuda_support import ensure_cuda_runtime
ensure_cuda_runtime()
lib = tvm.runtime.load_module({str(so)!r})
assert [m.kind for m in lib.imports[0].imports] == ["cuda"]
"""
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = so.read_bytes()
    assert data.count(b"\x7fELF") >= 2 and b".nv.info" in data


def test_exported_module_runs_with_runtime_only(tmp_path):
    """A module exported by tvm_ext runs where only TVM's runtime library (no compiler) and the
    tvm_ext runtime library are loaded."""
    from tvm_ext import runtime

    so = tmp_path / "mlp.so"
    assert main(["mlp", "--output", str(so)]) == 0
    code = f"""
import ctypes, numpy as np, tvm, tvm_ffi
ctypes.CDLL({runtime.load_library()!r}, ctypes.RTLD_GLOBAL)
assert tvm_ffi.get_global_func("relax.build", allow_missing=True) is None  # no compiler here
from tvm.runtime import vm
machine = vm.VirtualMachine(tvm.runtime.load_module({str(so)!r}), tvm.cpu())
shapes = [(4, 16), (32, 16), (32,), (8, 32), (8,)]
out = machine["main"](*[tvm.runtime.tensor(np.ones(s, "float32")) for s in shapes])
print(out.numpy().shape)
"""
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "(4, 8)"


def test_device_memory_run_check(tmp_path, capsys):
    report, plot = tmp_path / "r.json", tmp_path / "plan.png"
    argv = ["gpt", "--training", "--set", "layers=4", "--device-memory", "25%", "--run",
            "--check", "--report", str(report), "--plot", str(plot), "--swap-time-budget", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "check   OK" in out and "planned peak" in out and "without swapping" in out
    data = json.loads(report.read_text())
    assert data["run"]["measured_peak_bytes"] <= data["run"]["budget_bytes"]
    assert data["swap"]["budget"] == data["run"]["budget_bytes"]
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_device_memory_too_small_fails_before_compiling(capsys):
    assert main(["gpt", "--training", "--device-memory", "1KiB"]) == 2
    captured = capsys.readouterr()
    assert "smallest feasible budget" in captured.err and "compile" not in captured.out


def test_device_memory_size_errors(capsys):
    assert main(["mlp", "--device-memory", "lots"]) == 2
    assert "cannot read 'lots' as a size" in capsys.readouterr().err


def test_cuda_swapped_export(tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH: CUDA code cannot be compiled here")
    so = tmp_path / "gpt.so"
    proc = subprocess.run([sys.executable, SCRIPT, "gpt", "--training", "--target", "cuda",
                           "--device-memory", "25%", "--swap-time-budget", "1", "--output",
                           str(so)], capture_output=True, text=True, timeout=600)
    if proc.returncode == 2 and "CUDA runtime does not load" in proc.stderr:
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stderr
    data = so.read_bytes()
    assert b".nv.info" in data and b"tvm_ext.swap.copy_async" in data
    side = json.loads((tmp_path / "gpt.so.swap.json").read_text())
    assert set(side["argument_devices"]) <= {0, 1} and side["plan"]["budget"] > 0
