"""gpu_loop_nests: plain loop nests (an embedding's gradient) over GPU threads, one iteration a
thread, accumulations as atomic adds; nests whose iterations depend on each other refused."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from gpu_emulation import on_cpu, run_kernel
from tvm import relax
from tvm.script import tirx as T

from tvm_ext import driver
from tvm_ext.schedules.gpu_loop_nests import parallel_loop_nests
from tvm_ext.schedules.thread_work import serial_iterations


def _take_backward(rows: int, vocab: int, dim: int):
    bb = relax.BlockBuilder()
    g = relax.Var("g", relax.TensorType((rows, dim), "float32"))
    x = relax.Var("x", relax.TensorType((vocab, dim), "float32"))
    i = relax.Var("i", relax.TensorType((rows,), "int32"))
    with bb.function("main", [g, x, i]):
        out = bb.emit(relax.op.grad.take_backward(g, x, i, 0))
        bb.emit_func_output(out)
    return relax.transform.LegalizeOps()(bb.get())["take_backward"]


def test_an_embedding_gradient_is_an_atomic_scatter_add(cuda_target):
    """Repeated indices (the same token twice) add up; every thread does one element."""
    func = _take_backward(96, 10, 24)
    scheduled = parallel_loop_nests(func, cuda_target)
    assert serial_iterations(scheduled).iterations == 1
    assert "T.cuda.atomic_add" in scheduled.script()
    rng = np.random.default_rng(0)
    g = rng.standard_normal((96, 24)).astype("float32")
    idx = rng.integers(0, 10, 96).astype("int32")
    args = [g, np.zeros((10, 24), "float32"), idx, np.full((10, 24), np.nan, "float32")]
    out = run_kernel(on_cpu(scheduled), args)[-1]
    want = np.zeros((10, 24))
    np.add.at(want, idx, g)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def _sources(module) -> list[str]:
    try:
        own = [module.inspect_source()]
    except Exception:  # a module without source (the host code's)
        own = []
    return own + [s for sub in module.imports for s in _sources(sub)]


def test_the_scatter_add_compiles_to_atomic_add(cuda_target):
    """Through the pipeline: the default GPU schedules pick this rule for take_backward."""
    from tvm_ext.models.base import model_from_function

    bb = relax.BlockBuilder()
    params = [relax.Var("g", relax.TensorType((64, 32), "float32")),
              relax.Var("x", relax.TensorType((10, 32), "float32")),
              relax.Var("i", relax.TensorType((64,), "int32"))]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(relax.op.grad.take_backward(*params, 0))
        bb.emit_func_output(out)
    ex = driver.build(model_from_function("take_backward", bb.get()["main"], 3), cuda_target)
    assert any("atomicAdd" in src for src in _sources(ex.mod))


@T.prim_func(s_tir=True)
def _recurrence(A: T.Buffer((64,), "float32"), B: T.Buffer((64,), "float32")):
    with T.sblock("root"):
        for i in range(63):
            B[i + 1] = B[i] + A[i]


@T.prim_func(s_tir=True)
def _overlapping(A: T.Buffer((64,), "float32"), B: T.Buffer((32,), "float32")):
    with T.sblock("root"):
        for i in range(64):
            B[i // 2] = A[i]


@T.prim_func(s_tir=True)
def _fill(A: T.Buffer((8, 64), "float32"), B: T.Buffer((8, 64), "float32")):
    with T.sblock("root"):
        for i in range(512):
            B[i // 64, i % 64] = A[i // 64, i % 64] * T.float32(2)


@T.prim_func(s_tir=True)
def _parallel_recurrence(A: T.Buffer((64,), "float32"), B: T.Buffer((64,), "float32")):
    with T.sblock("root"):
        for i in T.parallel(63):
            B[i + 1] = B[i] + A[i]


def test_an_index_put_scatter_runs_one_element_a_thread(cuda_target):
    """TVM legalizes index_put into a copy and a scatter at data-dependent indices, both loops
    marked parallel (UNet1D's down- and upsampling build their kernels' weight so: a zero
    tensor with the kernel written along its diagonal); they ran on one GPU thread."""
    c, k = 32, 8
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((c, c, k), "float32"))
    i = relax.Var("i", relax.TensorType((c, 1), "int64"))
    j = relax.Var("j", relax.TensorType((k,), "int64"))
    v = relax.Var("v", relax.TensorType((c, k), "float32"))  # as broadcast by the importer
    with bb.function("main", [x, i, j, v]):
        bb.emit_func_output(bb.emit(relax.op.index_put(x, relax.Tuple([i, i, j]), v)))
    func = relax.transform.LegalizeOps()(bb.get())["index_put"]
    assert serial_iterations(func).iterations >= c * c * k
    scheduled = parallel_loop_nests(func, cuda_target)
    assert serial_iterations(scheduled).iterations == 1
    rng = np.random.default_rng(0)
    data = rng.standard_normal((c, c, k)).astype("float32")
    rows = np.arange(c, dtype="int64")[:, None]
    cols = np.arange(k, dtype="int64")
    values = rng.standard_normal((c, k)).astype("float32")
    out = run_kernel(on_cpu(scheduled), [data, rows, rows, cols, values,
                                         np.full_like(data, np.nan)])[-1]
    want = data.copy()
    want[rows, rows, cols] = values
    np.testing.assert_array_equal(out, want)


@T.prim_func(s_tir=True)
def _parallel_chase(A: T.Buffer((64,), "int32"), B: T.Buffer((64,), "int32")):
    with T.sblock("root"):
        for i in T.parallel(64):
            B[B[i] % 64] = A[i]


@pytest.mark.parametrize("func", [_recurrence, _overlapping, _parallel_recurrence,
                                  _parallel_chase],
                         ids=["recurrence", "overlap", "parallel recurrence",
                              "parallel store at indices it writes"])
def test_nests_whose_iterations_depend_on_each_other_are_refused(func, cuda_target):
    assert parallel_loop_nests(func, cuda_target) is None


def test_a_bijective_store_runs_one_element_a_thread(cuda_target):
    scheduled = parallel_loop_nests(_fill, cuda_target)
    a = np.arange(512, dtype="float32").reshape(8, 64)
    out = run_kernel(on_cpu(scheduled), [a, np.zeros_like(a)])[1]
    np.testing.assert_array_equal(out, 2 * a)


def test_atomic_adds_need_a_cuda_target():
    """Other GPU targets get no atomic add from this rule (refused, not mistranslated)."""
    rocm = tvm.target.Target({"kind": "rocm", "mcpu": "gfx90a"})
    assert parallel_loop_nests(_take_backward(8, 4, 4), rocm) is None
    cuda_old = driver.resolve_target("cuda", "sm_60")
    assert parallel_loop_nests(_take_backward(8, 4, 4), cuda_old) is not None
