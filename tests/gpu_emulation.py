"""Run a GPU-scheduled kernel's loops on the CPU, to check a schedule's arithmetic without a GPU.

`on_cpu` turns the loops bound to GPU threads into serial loops (a thread-bound reduction loop
becomes a plain reduction), CUDA atomic adds into read-modify-writes, and cuBLAS GEMM and cuDNN
convolution calls into the CPU GEMM and convolution of the runtime library (same arguments,
same semantics): the same iterations in one order. A schedule that computes the wrong elements,
skips some or reads an old value after it was overwritten gives a different result here too;
races between threads do not show (the schedules' own checks prove those away)."""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx

# The runtime library's GPU functions and their CPU twins (same arguments and semantics).
_ON_CPU = {"tvm_ext.cublas.gemm": "tvm_ext.blas.gemm",
           "tvm_ext.cudnn.conv2d": "tvm_ext.blas.conv2d"}


def on_cpu(func: tirx.PrimFunc) -> tirx.PrimFunc:
    def on_for(loop, m):
        body = m.mutate(loop.body)
        if loop.kind != tirx.ForKind.THREAD_BINDING:
            return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, body,
                            annotations=loop.annotations)
        return tirx.For(loop.loop_var, loop.min, loop.extent, tirx.ForKind.SERIAL, body)

    def on_evaluate(stmt, m):
        call = stmt.value
        if not (isinstance(call, tvm.ir.Call) and isinstance(call.op, tvm.ir.Op)
                and call.op.name == "tirx.cuda.atomic_add"):
            return m.default_mutate(stmt)
        target = call.args[0].args[0]  # address_of(B[I])
        return tirx.BufferStore(target.source, target + call.args[1], list(target.indices))

    def on_call(call, m):
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "tirx.tvm_call_packed"
                and call.args[0].value in _ON_CPU):
            return m.default_mutate(call)
        args = [tvm.ir.StringImm(_ON_CPU[call.args[0].value]), *call.args[1:]]
        return tvm.ir.Call(call.op, args, ret_ty=call.ty)

    body = tvm_ffi.structural_mutate(func.body, [(tirx.For, on_for),
                                                 (tirx.Evaluate, on_evaluate),
                                                 (tvm.ir.Call, on_call)])
    attrs = {k: v for k, v in (func.attrs or {}).items() if k != "target"}
    return tirx.PrimFunc(func.params, body, func.ret_type, tvm.ir.make_node("ir.DictAttrs",
                                                                             **attrs))


def build_kernels(funcs: dict) -> tvm.runtime.Module:
    """One llvm library of the kernels `{name: PrimFunc}`, each callable by its name."""
    mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    return tvm.tirx.build(mod, target="llvm")


def run_kernel(kernel, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """Run `kernel` (a PrimFunc, or a function of `build_kernels`' library) over copies of
    `arrays` (one per parameter); every array after."""
    if isinstance(kernel, tirx.PrimFunc):
        kernel = build_kernels({"main": kernel})["main"]
    tensors = [tvm.runtime.tensor(a.copy()) for a in arrays]
    kernel(*tensors)
    return [t.numpy() for t in tensors]


def differing(reference: tvm.IRModule, scheduled: tvm.IRModule, names: list[str],
              rtol: float = 1e-5, atol: float = 1e-6) -> list[str]:
    """Those of the kernels `names` whose `scheduled` version, run on the CPU (`on_cpu`),
    leaves any array other than the `reference` kernel does, on `random_arguments`."""
    refs = build_kernels({n: reference[n] for n in names})
    emulated = build_kernels({n: on_cpu(scheduled[n]) for n in names})
    out = []
    for n in names:
        args = random_arguments(reference[n])
        want, got = run_kernel(refs[n], args), run_kernel(emulated[n], args)
        if not all(np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
                   for a, b in zip(want, got, strict=True)):
            out.append(n)
    return out


def random_arguments(func: tirx.PrimFunc, seed: int = 0) -> list[np.ndarray]:
    """An array per parameter of a kernel with static shapes: floats in [0.25, 1) (positive: an
    optimizer's step count and second moments are), integers in [0, the smallest axis of any
    parameter) (valid indices for a gather)."""
    rng = np.random.default_rng(seed)
    shapes = [tuple(int(s) for s in p.ty.shape) for p in func.params]
    low = min((min(s) for s in shapes if s), default=1)
    out = []
    for p, shape in zip(func.params, shapes, strict=True):
        dtype = str(p.ty.dtype)
        if dtype.startswith(("int", "uint")):
            out.append(rng.integers(0, max(1, low), shape).astype(dtype))
        else:
            out.append(rng.uniform(0.25, 1, shape).astype(dtype))
    return out
