"""FLOPs, bytes moved and scratch bytes of one TIR kernel, read from its blocks.

FLOPs: for every block, the size of its iteration domain times the arithmetic operations in
the value it stores (index arithmetic excluded; a reduction `C = C + A * B` counts 2, so a GEMM
gives the textbook 2*M*N*K). A domain whose extent depends on an enclosing loop's index (a
fused attention's causal walk) counts the iterations it has over that loop, and `if` guards on
loop indices the iterations they admit; any other guard admits every iteration. Bytes moved:
every parameter buffer read or written once (the compulsory traffic a roofline model charges).
Scratch: buffers a fused kernel allocates for its intermediate stages.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir import TensorLoad
from tvm.ir.prim import expr as pe
from tvm.s_tir import SBlock, SBlockRealize

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


def has_symbolic_buffers(func) -> bool:
    """Whether some buffer parameter of the PrimFunc `func` has a symbolic extent (a generic
    kernel, such as TVM's GPU scan, bound by each call)."""
    return isinstance(func, tirx.PrimFunc) and any(
        not isinstance(d, pe.IntImm)
        for p in func.params for d in (getattr(p, "shape", None) or ()))


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


# Guards are evaluated over at most this many combinations of the loop indices they read.
_MAX_GUARD_POINTS = 1 << 16
_INT_OPS = {pe.Add: np.add, pe.Sub: np.subtract, pe.Mul: np.multiply,
            pe.FloorDiv: np.floor_divide, pe.FloorMod: np.mod, pe.Min: np.minimum,
            pe.Max: np.maximum, pe.LT: np.less, pe.LE: np.less_equal, pe.GT: np.greater,
            pe.GE: np.greater_equal, pe.EQ: np.equal, pe.NE: np.not_equal,
            pe.And: np.logical_and, pe.Or: np.logical_or}


def _evaluate(expr, values: dict):
    """An integer or boolean expression of loop indices over arrays of their values; None
    where it reads anything else."""
    if isinstance(expr, pe.IntImm):
        return np.int64(expr.value)
    if isinstance(expr, pe.Var):
        return values.get(expr)
    if isinstance(expr, pe.Not):
        a = _evaluate(expr.a, values)
        return None if a is None else np.logical_not(a)
    if isinstance(expr, pe.Select):
        parts = [_evaluate(e, values) for e in (expr.condition, expr.true_value,
                                                 expr.false_value)]
        return None if any(p is None for p in parts) else np.where(*parts)
    op = _INT_OPS.get(type(expr))
    if op is None:
        return None
    a, b = _evaluate(expr.a, values), _evaluate(expr.b, values)
    return None if a is None or b is None else op(a, b)


def _mean_over_loops(factors: list, guards: list, loops: dict) -> float | None:
    """The mean over the iterations of the loops in `loops` (var -> (min, extent)) of the
    product of `factors` (integer expressions) times whether every guard holds; None where
    they read anything but those loops' indices."""
    exprs = [*factors, *guards]
    read: dict = {}
    for expr in exprs:
        tvm_ffi.structural_walk(expr, [(pe.Var, lambda v: read.setdefault(v, None))])
    if any(v not in loops for v in read):
        return None
    ranges = [loops[v] for v in read]
    if int(np.prod([extent for _, extent in ranges], dtype=np.int64)) > _MAX_GUARD_POINTS:
        return None
    grids = np.meshgrid(*[np.arange(lo, lo + extent, dtype=np.int64) for lo, extent in ranges],
                        indexing="ij")
    values = dict(zip(read, grids, strict=True))
    total = np.ones(grids[0].shape if grids else (), np.float64)
    for expr in exprs:
        value = _evaluate(expr, values)
        if value is None:
            return None
        total = total * np.asarray(value, np.float64)
    return float(total.mean())


def _block_iterations(block: SBlock, guards: list, loops: dict, values=None,
                      binds: dict | None = None, local: frozenset = frozenset()) -> float:
    """The iterations of `block`'s domain that run: an extent that depends on an enclosing
    loop's index (a fused attention's causal walk) is averaged over that loop, and guards on
    loop indices count the iterations they admit; where those read anything else, an extent
    counts as its largest value and a guard as admitting every iteration.

    A block nested in another reads the outer block's variables in its extents (TVM's
    adaptive pool, whose windows depend on the output index): `binds` maps those to the loop
    indices they are bound to, and an axis that `values` (the realize's bindings) binds to no
    loop inside the outer block (`local`) is a single point of it, whatever its domain says."""
    binds = binds or {}
    size, variable = 1, []
    for i, iv in enumerate(block.iter_vars):
        extent = _substituted(iv.dom.extent, binds)
        if isinstance(extent, pe.IntImm):
            size *= int(extent.value)
        elif values is not None and not _reads_any(values[i], local):
            continue
        else:
            variable.append(extent)
    share = _mean_over_loops(variable, guards, loops)
    if share is None:
        share = _mean_over_loops(variable, [], loops)
    if share is None:
        analyzer = tvm.sym.Analyzer()
        for var, (lo, extent) in loops.items():
            analyzer.bind(var, tvm.ir.Range.from_min_extent(lo, extent))
        for extent in variable:
            bound = largest_extent(analyzer, extent)
            if bound == math.inf:
                raise ValueError(f"block {block.name_hint}: its extent {extent} is unbounded")
            size *= bound
        return float(size)
    return size * share


def _substituted(expr, binds: dict):
    if not binds:
        return expr
    return tvm_ffi.structural_mutate(expr, [(pe.Var, lambda v, m: binds.get(v, v))])


def _reads_any(expr, names: frozenset) -> bool:
    found = []
    tvm_ffi.structural_walk(expr, [(pe.Var, lambda v: found.append(v in names))])
    return any(found)


def largest_extent(analyzer, extent) -> float:
    """The largest value a loop or block extent can take (`const_int_bound`, through what
    `analyzer` knows of the variables it reads); math.inf where nothing bounds it."""
    if isinstance(extent, pe.IntImm):
        return int(extent.value)
    bound = analyzer.const_int_bound(extent).max_value
    return math.inf if bound >= 2**62 else bound


def _guarded_blocks(stmt, loops: dict, guards: list, out: list, binds: dict | None = None,
                    local: frozenset = frozenset()) -> None:
    """(block, iterations that run) of every block under `stmt`; `binds` maps the enclosing
    blocks' variables to loop indices, `local` holds the loops since the innermost block."""
    binds = binds or {}
    if isinstance(stmt, tirx.SeqStmt):
        for s in stmt.seq:
            _guarded_blocks(s, loops, guards, out, binds, local)
    elif isinstance(stmt, tirx.For):
        inner = dict(loops)
        if isinstance(stmt.min, pe.IntImm) and isinstance(stmt.extent, pe.IntImm):
            inner[stmt.loop_var] = (int(stmt.min.value), int(stmt.extent.value))
        _guarded_blocks(stmt.body, inner, guards, out, binds, local | {stmt.loop_var})
    elif isinstance(stmt, tirx.IfThenElse):
        _guarded_blocks(stmt.then_case, loops, [*guards, stmt.condition], out, binds, local)
        if stmt.else_case is not None:
            _guarded_blocks(stmt.else_case, loops, [*guards, pe.Not(stmt.condition)], out,
                            binds, local)
    elif isinstance(stmt, SBlockRealize):
        values = [_substituted(v, binds) for v in stmt.iter_values]
        out.append((stmt.block, _block_iterations(stmt.block, guards, loops, values, binds,
                                                  local)))
        inner_binds = {**binds, **{iv.var: v for iv, v in
                                   zip(stmt.block.iter_vars, values, strict=True)}}
        _guarded_blocks(stmt.block.body, loops, guards, out, inner_binds)
        if stmt.block.init is not None:
            _guarded_blocks(stmt.block.init, loops, guards, out, inner_binds)
    elif hasattr(stmt, "body"):
        _guarded_blocks(stmt.body, loops, guards, out, binds, local)


def analyze_kernel(func: tirx.PrimFunc) -> KernelCost:
    """FLOPs, bytes moved and scratch bytes of a PrimFunc with static shapes."""
    blocks: list[SBlock] = []
    tvm_ffi.structural_walk(func.body, [(SBlock, blocks.append)])
    guarded: list = []
    _guarded_blocks(func.body, {}, [], guarded)
    if len(guarded) != len(blocks):  # a statement kind the walk does not descend: no guards
        guarded = [(block, _block_iterations(block, [], {})) for block in blocks]
    flops = 0.0
    scratch = 0
    for block, iterations in guarded:
        for buf in block.alloc_buffers:
            # Shared and local buffers of a scheduled GPU kernel are on-chip, not device memory.
            if str(getattr(buf, "scope", lambda: "global")()) in ("global", ""):
                scratch += buffer_bytes(buf.shape, buf.dtype)
        if isinstance(block.body, tirx.BufferStore) and block.iter_vars:
            flops += iterations * _arith_ops(block.body.value)
    moved = 0
    for param in func.params:
        shape = getattr(param, "shape", None)
        if shape is not None:
            moved += buffer_bytes(shape, param.dtype)
    reduces = any(iv.iter_type == tirx.IterVar.CommReduce for b in blocks for iv in b.iter_vars)
    calls = find_library_calls(func)
    low = any(c.dtypes[0] in LOW_PRECISION for c in calls)
    return KernelCost(float(flops), int(moved), int(scratch), bool(calls), reduces, low)
