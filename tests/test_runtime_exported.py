"""`tvm_ext.runtime.load`: an exported module run with TVM's runtime alone, its sidecar read
and each argument placed where the module reads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tvm

from tvm_ext import driver, runtime
from tvm_ext.cli import main
from tvm_ext.errors import InputError
from tvm_ext.models import get_model
from tvm_ext.runtime import blas

# Run where TVM has no compiler (as on a machine deployed to); prints the outputs' sums.
_RUNTIME_ONLY = """
import sys, numpy as np, tvm, tvm_ffi, tvm_ext
assert tvm_ext.RUNTIME_ONLY and tvm_ffi.get_global_func("relax.build", allow_missing=True) is None
module = tvm_ext.runtime.load(sys.argv[1])
arguments = np.load(sys.argv[2])
outputs = module(*[arguments[f"a{i}"] for i in range(len(arguments.files))])
print(module.devices, module.argument_devices)
print(*[float(np.sum(o, dtype=np.float64)) for o in outputs])
"""


@pytest.fixture(scope="module")
def swapped(tmp_path_factory):
    """The zoo MLP's training step exported swapped at half its peak, with its arguments."""
    folder = tmp_path_factory.mktemp("exported")
    path = str(folder / "mlp.so")
    assert main(["mlp", "--training", "--device-memory", "50%", "--output", path]) == 0
    model = get_model("mlp", training=True)
    return path, model


def test_a_swapped_export_runs_with_the_runtime_alone(swapped, tmp_path):
    path, model = swapped
    arguments = model.random_arguments(0)
    np.savez(tmp_path / "args.npz", **{f"a{i}": a for i, a in enumerate(arguments)})
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1", TVM_EXT_BLAS_LIB=blas.cpu_blas_path())
    proc = subprocess.run([sys.executable, "-c", _RUNTIME_ONLY, path, str(tmp_path / "args.npz")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    devices, sums = proc.stdout.strip().splitlines()
    with open(path + ".swap.json") as f:
        assert str(json.load(f)["argument_devices"]) in devices and "index=1" in devices
    expected = driver.run(driver.build(model, tvm.target.Target("llvm")), arguments,
                          tvm.cpu(0), repeat=0).outputs
    np.testing.assert_allclose([float(x) for x in sums.split()],
                               [float(np.sum(e, dtype=np.float64)) for e in expected],
                               rtol=1e-5, atol=1e-5)


def test_arguments_go_where_the_sidecar_says(swapped):
    path, model = swapped
    module = runtime.load(path)
    assert module.devices == [tvm.cpu(0), tvm.cpu(1)] and 1 in module.argument_devices
    placed = module.place(model.random_arguments(0))
    assert [module.devices.index(t.device) for t in placed] == module.argument_devices
    assert len(module.run(placed)) == 1 + len(model.params)
    with pytest.raises(InputError, match=r"takes .* arguments"):
        module(np.zeros(3, "float32"))


def test_a_plain_export_runs_on_one_device(tmp_path):
    path = str(tmp_path / "mlp.so")
    model = get_model("mlp")
    driver.export(driver.build(model, tvm.target.Target("llvm")), path)
    module = runtime.load(path)
    assert module.devices == [tvm.cpu(0)] and module.argument_devices is None
    (out,) = module(*model.random_arguments(0))
    assert out.shape == (4, 8)


def test_what_load_cannot_run_is_refused_clearly(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        runtime.load(str(tmp_path / "missing.so"))
    path = tmp_path / "m.so"
    path.write_bytes(b"")
    (tmp_path / "m.so.partition.json").write_text("{}")
    with pytest.raises(InputError, match=r"partitioned.*run_exported"):
        runtime.load(str(path))
    os.remove(tmp_path / "m.so.partition.json")
    (tmp_path / "m.so.swap.json").write_text("{}")
    with pytest.raises(InputError, match="not a swap sidecar"):
        runtime.load(str(path))
