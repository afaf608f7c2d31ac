"""FLOPs, bytes moved and scratch bytes of one TIR kernel, read from its blocks.

FLOPs: for every block, the size of its iteration domain times the arithmetic operations in
the value it stores (index arithmetic excluded; a reduction `C = C + A * B` counts 2, so a GEMM
gives the textbook 2*M*N*K). Bytes moved: every parameter buffer read or written once (the
compulsory traffic a roofline model charges). Scratch: buffers a fused kernel allocates for its
intermediate stages.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tvm_ffi
from tvm import tirx
from tvm.ir import TensorLoad
from tvm.ir.prim import expr as pe
from tvm.s_tir import SBlock

from .library_kernels import find_library_calls

LOW_PRECISION = ("float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class KernelCost:
    flops: float
    bytes_moved: int
    scratch_bytes: int
    library: bool = False  # a GEMM or convolution a vendor library computes (library_kernels)
    reduces: bool = False  # some block reduces (its sum's order is up to the schedule)
    # its library GEMMs or convolutions take float16/bfloat16 operands (tensor-core rates)
    low_precision: bool = False


def buffer_bytes(shape, dtype: str) -> int:
    """Bytes of a dense buffer (bool counts one byte, as TVM stores it)."""
    dtype = str(dtype)
    bits = 8 if dtype == "bool" else int(np.dtype(dtype).itemsize * 8)
    return int(np.prod([int(s) for s in shape], dtype=np.int64)) * max(bits // 8, 1)


def _arith_ops(expr) -> int:
    """Arithmetic operations in a value expression, not descending into load indices."""
    if isinstance(expr, TensorLoad) or isinstance(expr, (pe.IntImm, pe.FloatImm, pe.Var)):
        return 0
    if isinstance(expr, pe.Cast):
        return _arith_ops(expr.value)
    # Not subclasses LogicalExpr but has no `.b`: test it first.
    if isinstance(expr, pe.Not):
        return _arith_ops(expr.a)
    if isinstance(expr, (pe.BinaryOpExpr, pe.CmpExpr, pe.LogicalExpr)):
        return 1 + _arith_ops(expr.a) + _arith_ops(expr.b)
    if isinstance(expr, pe.Select):
        return 1 + _arith_ops(expr.condition) + _arith_ops(expr.true_value) + _arith_ops(
            expr.false_value)
    if isinstance(expr, tvm_ffi.core.Object) and hasattr(expr, "args") and hasattr(expr, "op"):
        # Intrinsic calls: exp, erf, sqrt, if_then_else ... count one each.
        return 1 + sum(_arith_ops(a) for a in expr.args)
    return 0


def _domain_size(block: SBlock) -> int:
    size = 1
    for iv in block.iter_vars:
        size *= int(iv.dom.extent)
    return size


def analyze_kernel(func: tirx.PrimFunc) -> KernelCost:
    """FLOPs, bytes moved and scratch bytes of a PrimFunc with static shapes."""
    blocks: list[SBlock] = []
    tvm_ffi.structural_walk(func.body, [(SBlock, blocks.append)])
    flops = 0.0
    scratch = 0
    for block in blocks:
        for buf in block.alloc_buffers:
            # Shared and local buffers of a scheduled GPU kernel are on-chip, not device memory.
            if str(getattr(buf, "scope", lambda: "global")()) in ("global", ""):
                scratch += buffer_bytes(buf.shape, buf.dtype)
        if isinstance(block.body, tirx.BufferStore) and block.iter_vars:
            flops += _domain_size(block) * _arith_ops(block.body.value)
    moved = 0
    for param in func.params:
        shape = getattr(param, "shape", None)
        if shape is not None:
            moved += buffer_bytes(shape, param.dtype)
    reduces = any(iv.iter_type == tirx.IterVar.CommReduce for b in blocks for iv in b.iter_vars)
    calls = find_library_calls(func)
    low = any(c.dtypes[0] in LOW_PRECISION for c in calls)
    return KernelCost(float(flops), int(moved), int(scratch), bool(calls), reduces, low)
