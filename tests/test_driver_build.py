"""tvm_ext.driver.build: the host target it resolves compiles kernels correctly."""

from __future__ import annotations

import importlib

import numpy as np
import tvm
from tvm.script import tirx as T

# The module, not the function tvm_ext.driver re-exports under the same name.
build = importlib.import_module("tvm_ext.driver.build")


@T.prim_func(private=True, s_tir=True)
def _rotate_half(a: T.Buffer((128,), "float32"), b: T.Buffer((128,), "float32"),
                 p: T.Buffer((128,), "float32"), out: T.Buffer((64, 32), "float32")):
    # What the default CPU schedule makes of a RoPE gradient once its concat is inlined: a
    # predicated load whose index wraps (`j % 8`) inside the vectorised loop.
    T.func_attr({"tirx.noalias": True})
    for i, j in T.grid(64, 32):
        with T.sblock("out"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = T.if_then_else(
                4 <= vj % 8, b[vi % 16 * 8 + vj % 8 - 4], p[vi % 16 * 8 + vj % 8]
            ) + a[vi % 16 * 8 + vj % 8]


def _expected(a, b, p):
    i, j = np.arange(64)[:, None], np.arange(32)[None, :]
    idx = i % 16 * 8 + j % 8
    return np.where(4 <= j % 8, b[np.maximum(idx - 4, 0)], p[idx]) + a[idx]


def test_host_target_compiles_wrapping_predicated_loads_correctly():
    target = build.resolve_target("llvm")
    lib = tvm.compile(tvm.IRModule({"main": _rotate_half.with_attr("global_symbol", "main")}),
                      target=target)
    rng = np.random.default_rng(0)
    a, b, p = (rng.standard_normal(128).astype("float32") for _ in range(3))
    out = tvm.runtime.tensor(np.zeros((64, 32), "float32"))
    lib["main"](*(tvm.runtime.tensor(x) for x in (a, b, p)), out)
    np.testing.assert_allclose(out.numpy(), _expected(a, b, p), rtol=1e-6)


def test_miscompiling_cpu_models_map_to_their_generic_level(monkeypatch):
    for cpu in ("znver4", "znver5"):
        monkeypatch.setattr(build.codegen, "llvm_get_system_cpu", lambda cpu=cpu: cpu)
        assert build.host_cpu() == "x86-64-v4"
        assert build.resolve_target("llvm").attrs["mcpu"] == "x86-64-v4"
    monkeypatch.setattr(build.codegen, "llvm_get_system_cpu", lambda: "skylake")
    assert build.host_cpu() == "skylake"
