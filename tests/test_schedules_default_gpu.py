"""Default GPU schedules for every kernel of the zoo's training graphs (CUDA code generation
runs here with nvcc; nothing runs on a GPU)."""

from __future__ import annotations

import pytest
import tvm
from tvm import tirx

from tvm_ext import driver
from tvm_ext import pipeline as P
from tvm_ext.schedules.default_gpu import ApplyDefaultGPUSchedules


def _fused(model, target):
    with target:
        return tvm.transform.Sequential(
            P.library_dispatch_passes(target) + P.legalize_passes(target))(model.mod)


def test_every_kernel_gets_a_thread_binding(zoo_cache, cuda_target):
    """GEMV raises on the loss gradient and nothing matches take_backward: each kernel still
    ends scheduled, the unmatched ones on one thread, and reported."""
    target = cuda_target
    scheduler = ApplyDefaultGPUSchedules()
    with target, pytest.warns(UserWarning, match="take_backward"):
        mod = scheduler(_fused(zoo_cache("gpt", training=True), target))
    assert set(scheduler.serial_kernels) == {"take_backward", "take_backward1"}
    for gv, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc):
            assert int(func.attrs["tirx.is_scheduled"]) == 1, gv.name_hint
            assert "threadIdx.x" in func.script(), gv.name_hint


@pytest.mark.parametrize("name", ["mlp", "resnet"])
def test_training_graphs_compile_for_cuda(name, zoo_cache, tmp_path, cuda_target):
    target = cuda_target
    ex = driver.build(zoo_cache(name, training=True), target)
    path = driver.export(ex, str(tmp_path / f"{name}.so"))
    data = open(path, "rb").read()
    assert b".nv.info" in data  # a cubin, not CUDA source


def test_cuda_kernels_compile_without_fast_math(monkeypatch, cuda_target):
    """nvcc's --use_fast_math (TVM's default) turns powf into exp2(y * log2(x)): NaN for a
    negative base, which GPT-2's GELU (x ** 3) and Llama's RMSNorm (x ** 2) take. tvm_ext builds
    CUDA kernels with IEEE math, as PyTorch's are."""
    import subprocess

    from tvm import relax

    from tvm_ext.models.base import model_from_function

    monkeypatch.delenv("TVM_CUDA_NVCC_NO_FAST_MATH", raising=False)
    # Resolved again after the variable is gone: resolving the target is what sets it.
    target = driver.resolve_target(str(cuda_target.kind.name))
    commands = []
    real = subprocess.Popen

    def record(cmd, *args, **kwargs):
        commands.append(list(cmd))
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", record)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 64), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.power(x, relax.const(3.0, "float32")))
        bb.emit_func_output(y)
    driver.build(model_from_function("cube", bb.get()["main"], 1), target)
    nvcc = [c for c in commands if c and c[0].endswith("nvcc")]
    assert nvcc, commands
    assert all("--use_fast_math" not in c for c in nvcc), nvcc


def test_a_library_gemms_epilogue_is_one_loop_nest(cuda_target):
    """A GEMM with a bias and GPT-2's GELU written out (pow, tanh, adds and products): cuBLAS's
    product, then the whole epilogue in one loop nest over GPU threads (one pass over the
    product), not a GPU kernel and a round trip through global memory per stage."""
    import tvm_ffi
    from tvm import relax, s_tir

    from tvm_ext.ir.pass_records import LIBRARY_ATTR, LIBRARY_BLOCK_PREFIX
    from tvm_ext.models.base import model_from_function

    def const(v):
        return relax.const(v, "float32")

    op = relax.op
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64, 128), "float32"))
    w = relax.Var("w", relax.TensorType((128, 256), "float32"))
    b = relax.Var("b", relax.TensorType((256,), "float32"))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            h = bb.emit(op.add(op.matmul(x, w), b))
            inner = bb.emit(op.multiply(const(0.7978845608), op.add(
                h, op.multiply(const(0.044715), op.power(h, const(3.0))))))
            y = bb.emit_output(op.multiply(op.multiply(const(0.5), h),
                                           op.add(const(1.0), op.tanh(inner))))
        bb.emit_func_output(y)
    model = model_from_function("gemm_gelu", bb.get()["main"], 1)
    scheduled = P.scheduled_module(model.mod, cuda_target, None)
    library = [f for f in scheduled.functions.values()
               if isinstance(f, tirx.PrimFunc) and LIBRARY_ATTR in (f.attrs or {})]
    assert len(library) == 1, "matmul, bias and GELU fuse into one kernel"
    blocks: list = []
    tvm_ffi.structural_walk(library[0].body, [(s_tir.SBlock, blocks.append)])
    names = [bl.name_hint for bl in blocks]
    assert sum(n.startswith(LIBRARY_BLOCK_PREFIX) for n in names) == 1, names
    rest = [n for n in names if n != "root" and not n.startswith(LIBRARY_BLOCK_PREFIX)]
    assert len(rest) == 1, rest
    driver.build(model, cuda_target)
