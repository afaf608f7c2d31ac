"""benchmarks/vs_torch_gpu.py, both halves on this CPU (`prepare --target llvm`, `run --device
cpu`) at the tiny sizes: the module's parameters are found among the torch model's by name, a
torch model rebuilt from the recorded config runs the same weights, and the outputs agree. The
first-NaN finder names the kernel that made a NaN. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "vs_torch_gpu.py"

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("vs_torch_gpu")
    proc = subprocess.run([sys.executable, str(SCRIPT), "prepare", str(folder), "--target",
                           "llvm", "--size", "quick", "--models", "gpt2,resnet"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return folder


def test_parameters_are_named_and_none_carried(prepared):
    manifest = json.loads((prepared / "manifest.json").read_text())
    for name, spec in manifest["models"].items():
        assert all("name" in s for s in spec["parameters"]), name
        assert spec["carried_bytes"] == 0
    # ResNet's BatchNorm statistics travel (they may be folded into the module).
    assert any("running_mean" in b for b in manifest["models"]["resnet"]["buffers"])


def test_run_agrees_with_torch(prepared, tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "run", str(prepared), "--device", "cpu",
                           "--rounds", "1", "--round-seconds", "0.05", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["model"] for r in rows] == ["gpt2", "resnet"]
    for row in rows:
        assert row["ok"] and row["max_abs_error"] < 1e-4, row
        assert row["torch_ms"] > 0 and row["tvm_ext_ms"] > 0


def test_first_nan_kernel(prepared):
    import tvm
    from tvm.runtime.vm import VirtualMachine

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import vs_torch_gpu

    import tvm_ext  # noqa: F401  (library kernels)

    spec = json.loads((prepared / "manifest.json").read_text())["models"]["gpt2"]
    model = vs_torch_gpu._torch_model(spec, torch, "cpu")
    named = dict(model.named_parameters(remove_duplicate=False))
    params = [named[s["name"]].detach().numpy().copy() for s in spec["parameters"]]
    ids = np.load(prepared / "gpt2.npz")["input0"]
    vm = VirtualMachine(tvm.runtime.load_module(str(prepared / "gpt2.so")), tvm.cpu())

    def args():
        return [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in (ids, *params)]

    assert vs_torch_gpu.first_nan_kernel(vm, args()) is None
    # +inf and -inf in one weight: a kernel downstream (inf - inf) makes the first NaN from
    # inputs that hold none.
    index = next(i for i, s in enumerate(spec["parameters"])
                 if s["name"].endswith("h.0.attn.c_proj.weight"))
    params[index].flat[0], params[index].flat[1] = np.inf, -np.inf
    found = vs_torch_gpu.first_nan_kernel(vm, args())
    assert found is not None and found["kernel"], found
    assert found["nan_before"] == []
    assert found["argument"] < len(found["shapes"])
