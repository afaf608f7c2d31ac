"""DispatchLibraryKernels: GEMMs and convolutions computed by a vendor library.

Every kernel's GEMM and conv2d loop nests (`tvm_ext.ir.library_kernels`) are replaced, inside
the kernel, by a block that calls the runtime library (`T.call_packed` on the buffers):

* on CPU targets `tvm_ext.blas.gemm` and `tvm_ext.blas.conv2d` (OpenBLAS, loaded at run time;
  a conv1d is a conv2d of unit height);
* on CUDA `tvm_ext.cublas.gemm` (cuBLAS, loaded at run time), and `tvm_ext.cudnn.conv2d`
  (cuDNN, loaded at run time; the arguments of `tvm_ext.blas.conv2d`) for a convolution whose
  operands share a dtype and whose windows stay within its data (cuDNN pads symmetrically;
  the padding is a loop nest of the kernel before the call). Other convolutions, and all of
  them with `cudnn=False`, are a GEMM too: a loop nest gathers the column matrix (im2col),
  one batched GEMM multiplies it (`tvm_ext.ir.conv_as_gemm`).

The kernel keeps its signature and its other loop nests (a bias add, an activation, the padding
before a convolution), which the schedule phase schedules as usual. So nothing before the
schedule phase changes: the partition and swap planners read the kernel's TIR as it was, and a
partitioned kernel's chunk (a smaller GEMM) dispatches like any other. Dispatched kernels carry
the attribute `tvm_ext.library` (the functions they call) and are not tuned.

Run it in the schedule phase, before tuning records and default schedules (the "tvm_ext"
pipeline's `library_kernels` phase, on unless `library=False`).
"""

from __future__ import annotations

import warnings

import tvm
import tvm_ffi
from tvm import tirx
from tvm.s_tir import SBlock, SBlockRealize
from tvm.tirx.buffer import buffer_data

from tvm_ext.ir.conv_as_gemm import GemmOperand, conv_as_gemm
from tvm_ext.ir.library_kernels import (
    LibraryCall,
    conv_parts,
    find_library_calls,
    root_statements,
)
from tvm_ext.ir.pass_records import LIBRARY_ATTR, LIBRARY_BLOCK_PREFIX
from tvm_ext.ir.targets import is_cpu, is_gpu
from tvm_ext.runtime import blas

_FLOAT = ("float32", "float64")
_GPU_INPUTS = ("float32", "float16", "bfloat16")
CUDNN_CONV = "tvm_ext.cudnn.conv2d"


def packed_function(call: LibraryCall, target: tvm.target.Target,
                    cudnn: bool = True) -> str | None:
    """The runtime library function that computes `call` on `target` (None: none does)."""
    a, b, c = call.dtypes
    if is_cpu(target):
        if a == b == c and a in _FLOAT:
            return "tvm_ext.blas.gemm" if call.kind == "gemm" else "tvm_ext.blas.conv2d"
        return None
    if target.kind.name != "cuda" or a != b or a not in _GPU_INPUTS or c not in ("float32", a):
        return None
    if cudnn and call.kind != "gemm" and c == a and _windows_within_data(call):
        return CUDNN_CONV
    return "tvm_ext.cublas.gemm"  # a convolution as a GEMM over its column matrix


def _windows_within_data(call: LibraryCall) -> bool:
    """Whether every window of the convolution `call` reads inside its data (static shapes):
    it reads no zeros past the data's far edge, which cuDNN's symmetric padding cannot give."""
    if len(call.conv) != 5 or len(call.conv_axes) != 3:
        return False
    sh, sw, dh, dw, _ = call.conv

    def extents(operand: int, shape) -> list[int] | None:
        shape = list(shape) + ([1] if call.kind == "conv1d" else [])
        if not all(isinstance(e, (int, tirx.IntImm)) for e in shape):
            return None
        return [int(shape[axis]) for axis in call.conv_axes[operand]]

    data = extents(0, call.operands[0].shape)
    weight = extents(1, call.weight_copy[2] if call.weight_copy else call.operands[1].shape)
    out = extents(2, call.operands[2].shape)
    if None in (data, weight, out):
        return False
    rows = (out[2] - 1) * sh + (weight[2] - 1) * dh + 1
    cols = (out[3] - 1) * sw + (weight[3] - 1) * dw + 1
    return rows <= data[2] and cols <= data[3]


def _full_region(buf):
    ranges = [tvm.ir.Range.from_min_extent(0, e) for e in buf.ty.shape]
    return tvm.ir.expr.TensorRegion(buf, ranges, tirx.BufferRegionType())


def _shaped_array(buf, shape: tuple[int, ...]):
    """The DLTensor of `buf` with `shape` (same elements, row-major: axes split or merged)."""
    make_shape = tvm.ir.Call("tirx.tvm_stack_make_shape", [tirx.IntImm("int64", s)
                                                           for s in shape],
                             ret_ty=tvm.ir.PointerType(tvm.ir.PrimType("int64")))
    return tvm.ir.Call(tvm.ir.Op.get("tirx.tvm_stack_make_array"),
                       [buffer_data(buf), make_shape, 0, len(shape),
                        tvm.runtime.const(0, buf.ty.dtype), buf.ty.elem_offset], ret_ty="handle")


def _array(buf, view: tuple[tuple[int, ...], ...] | None, unit_height: bool = False):
    """The DLTensor of `buf` the library receives, its shape merged along `view` (the tensor
    axes of each view axis; None: as it is), or with a unit last axis (a conv1d operand seen
    as a conv2d's: the axis its height role names)."""
    shape = list(buf.ty.shape)
    if unit_height:
        shape.append(1)
    if view is not None:
        merged = []
        for axes in view:
            extent = shape[axes[0]]
            for a in axes[1:]:
                extent = extent * shape[a]
            merged.append(extent)
        shape = merged
    make_shape = tvm.ir.Call("tirx.tvm_stack_make_shape", shape,
                             ret_ty=tvm.ir.PointerType(tvm.ir.PrimType("int64")))
    return tvm.ir.Call(tvm.ir.Op.get("tirx.tvm_stack_make_array"),
                       [buffer_data(buf), make_shape, 0, len(shape),
                        tvm.runtime.const(0, buf.ty.dtype), buf.ty.elem_offset], ret_ty="handle")


def _library_block(call: LibraryCall, function: str, operands: tuple) -> SBlockRealize:
    ints = []
    views = call.views or (None, None, None)
    if call.kind == "gemm":
        for roles in call.roles:
            ints += [len(roles), *roles]
    else:
        sh, sw, dh, dw, groups = call.conv
        ints = [sh, sw, 0, 0, dh, dw, groups, *(a for axes in call.conv_axes for a in axes)]
    x, y, out = operands
    arrays = [_array(b, v, call.kind == "conv1d") for b, v in zip(operands, views, strict=True)]
    body = tirx.Evaluate(tirx.call_packed(function, *arrays, *ints))
    block = SBlock([], [_full_region(x), _full_region(y)], [_full_region(out)],
                   f"{LIBRARY_BLOCK_PREFIX}_{call.block}", body)
    return SBlockRealize([], True, block)


def _gemm_block(name: str, function: str, operands: tuple[GemmOperand, ...]
                ) -> SBlockRealize:
    """The library call of a GEMM on views of its operands (explicit shapes and roles)."""
    arrays, ints = [], []
    for op in operands:
        arrays.append(_shaped_array(op.buffer, op.shape))
        ints += [len(op.roles), *op.roles]
    body = tirx.Evaluate(tirx.call_packed(function, *arrays, *ints))
    a, b, c = (op.buffer for op in operands)
    block = SBlock([], [_full_region(a), _full_region(b)], [_full_region(c)],
                   f"{LIBRARY_BLOCK_PREFIX}_{name}", body)
    return SBlockRealize([], True, block)


def _conv_on_gpu(func: tirx.PrimFunc, call: LibraryCall, function: str):
    """(statement, scratch buffers) computing a convolution as a GEMM over its column
    matrix (`tvm_ext.ir.conv_as_gemm`); None when its output cannot be one GEMM."""
    gemm = conv_as_gemm(conv_parts(func, call), call.block)
    if gemm is None:
        return None
    stmt = tirx.SeqStmt([*gemm.nests, _gemm_block(call.block, function, gemm.operands)])
    return stmt, list(gemm.scratch)


def _weight_copy(call: LibraryCall):
    """(buffer, nest) computing a weight read through index expressions into its canonical
    [F, C/g, K..] layout: `buffer[f, c, k..] = weight[indices(f, c, k..)]`."""
    block_vars, indices, extents = call.weight_copy
    weight = call.operands[1]
    buffer = tirx.decl_buffer([tirx.IntImm("int64", e) for e in extents], weight.ty.dtype,
                              f"{weight.name}_canonical")
    loops = [tirx.Var(f"i{k}", "int64") for k in range(len(extents))]
    iters = [tirx.IterVar(tvm.ir.Range.from_min_extent(0, tirx.IntImm("int64", e)),
                          tirx.Var(f"v{k}", "int64"), tirx.IterVar.DataPar)
             for k, e in enumerate(extents)]
    rename = {v: it.var for v, it in zip(block_vars, iters, strict=True)}
    source = [tvm_ffi.structural_map(i, (tvm.ir.expr.Var, lambda v: rename.get(v, v)))
              for i in indices]
    store = tirx.BufferStore(buffer, weight[tuple(source)], [it.var for it in iters])
    block = SBlock(iters, [_full_region(weight)], [_full_region(buffer)],
                   f"{call.block}_weight", store)
    nest = SBlockRealize(loops, True, block)
    for loop, extent in reversed(list(zip(loops, extents, strict=True))):
        nest = tirx.For(loop, tirx.IntImm("int64", 0), tirx.IntImm("int64", extent),
                        tirx.ForKind.SERIAL, nest)
    return buffer, nest


def dispatch_kernel(func: tirx.PrimFunc, target: tvm.target.Target, min_flops: int = 0,
                    cudnn: bool = True) -> tirx.PrimFunc | None:
    """`func` with its library-computable nests calling the library (None: none)."""
    stmts = root_statements(func)
    if stmts is None:
        return None
    chosen, scratch = [], []
    for call in find_library_calls(func):
        function = packed_function(call, target, cudnn)
        if function is None or (call.flops is not None and call.flops < min_flops):
            continue
        operands = call.operands
        if call.kind != "gemm" and is_gpu(target) and function != CUDNN_CONV:
            on_gpu = _conv_on_gpu(func, call, function)
            if on_gpu is None:
                continue
            stmts[call.stmt], more = on_gpu
            scratch += more
            chosen.append(function)
            continue
        stmt = _library_block(call, function, operands)
        if call.weight_copy:
            weight, nest = _weight_copy(call)
            scratch.append(weight)
            stmt = tirx.SeqStmt([nest, _library_block(
                call, function, (operands[0], weight, operands[2]))])
        stmts[call.stmt] = stmt
        chosen.append(function)
    if not chosen:
        return None
    root = func.body.block
    body = tirx.SeqStmt(stmts) if len(stmts) > 1 else stmts[0]
    new_root = SBlock([], [], [], root.name_hint, body,
                      alloc_buffers=[*root.alloc_buffers, *scratch],
                      annotations=root.annotations)
    out = tirx.PrimFunc(list(func.params), SBlockRealize([], True, new_root), func.ret_type,
                        func.attrs)
    return out.with_attr(LIBRARY_ATTR, sorted(set(chosen)))


@tvm.transform.module_pass(opt_level=0, name="DispatchLibraryKernels")
class DispatchLibraryKernels:
    """Replace the GEMM and conv2d loop nests of every unscheduled kernel by calls to the
    runtime library's vendor-library functions (see the module docstring).

    Args:
        target: the target (default: the current one).
        min_flops: leave nests of fewer floating-point operations to generated code (the
            call costs about a microsecond).
        cudnn: on CUDA, convolutions by cuDNN where it computes them (else as GEMMs over
            their column matrix, by cuBLAS).
    """

    def __init__(self, target: tvm.target.Target | None = None, min_flops: int = 0,
                 cudnn: bool = True):
        self.target = target
        self.min_flops = min_flops
        self.cudnn = cudnn

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = self.target or tvm.target.Target.current()
        if target is None:
            raise ValueError("DispatchLibraryKernels needs a target")
        if not (is_cpu(target) or is_gpu(target)):
            return mod
        if is_cpu(target) and not blas.cpu_blas_available():
            warnings.warn("no CPU BLAS library can be loaded here (pip install "
                          "scipy-openblas32, or set TVM_EXT_BLAS_LIB): GEMMs and convolutions "
                          "are generated by TVM", stacklevel=1)
            return mod
        updates = {}
        for gv, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc) or _scheduled(func):
                continue
            new = dispatch_kernel(func, target, self.min_flops, self.cudnn)
            if new is not None:
                updates[gv] = new
        if not updates:
            return mod
        mod = mod.shallow_copy() if hasattr(mod, "shallow_copy") else mod
        for gv, func in updates.items():
            mod[gv] = func
        return mod


def _scheduled(func: tirx.PrimFunc) -> bool:
    attrs = func.attrs
    return attrs is not None and (bool(attrs.get("tirx.is_scheduled", False)) or
                                  LIBRARY_ATTR in attrs)
