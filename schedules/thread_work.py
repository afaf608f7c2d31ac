"""How much serial work one GPU thread does in a scheduled kernel.

A GPU kernel is fast when its work is spread over many threads. A schedule that leaves a kernel
on one thread (the serial fallback), or a reduction serial inside each thread, shows as a long
chain of loop iterations one thread runs. `serial_iterations` reads it from the scheduled TIR:
for every store (or call: an atomic add), the product of the extents of the loops around it that
are not bound to GPU threads (vectorised loops count as one iteration: one instruction); the
kernel's figure is the largest such product. A loop with a symbolic extent counts as the largest
value the extent can take (`const_int_bound`, through the `let` bindings above it: TVM's scan
runs `total_rounds` rounds, a sum of seven 0-or-1 comparisons), or as unbounded where nothing
bounds it. Blocks that call a vendor library (cuBLAS launches its own kernels) are not counted.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import s_tir, tirx

from tvm_ext.ir.kernel_cost import largest_extent
from tvm_ext.ir.pass_records import LIBRARY_BLOCK_PREFIX


@dataclasses.dataclass(frozen=True)
class ThreadWork:
    """The serial iterations of one thread at a kernel's busiest store."""

    kernel: str
    iterations: float  # math.inf for a symbolic extent
    block: str  # the block of that store ("" outside any block)
    serial_loops: tuple[str, ...]  # the serial loop variables around it, outermost first


def serial_iterations(func: tirx.PrimFunc, name: str = "") -> ThreadWork:
    """The largest number of loop iterations one GPU thread runs before a store of `func`."""
    best = ThreadWork(name, 0, "", ())
    analyzer = tvm.sym.Analyzer()

    def visit(stmt, count: float, block: str, loops: tuple[str, ...]) -> None:
        nonlocal best
        if isinstance(stmt, tirx.For):
            if stmt.kind in (tirx.ForKind.THREAD_BINDING, tirx.ForKind.VECTORIZED):
                visit(stmt.body, count, block, loops)
                return
            visit(stmt.body, count * largest_extent(analyzer, stmt.extent), block,
                  (*loops, str(stmt.loop_var)))
            return
        if isinstance(stmt, tirx.LetStmt | tirx.Bind):
            analyzer.bind(stmt.var, stmt.value)
        if isinstance(stmt, s_tir.SBlockRealize):
            inner = stmt.block
            if inner.name_hint.startswith(LIBRARY_BLOCK_PREFIX):
                return
            if inner.init is not None:
                visit(inner.init, count, inner.name_hint, loops)
            visit(inner.body, count, inner.name_hint, loops)
            return
        if isinstance(stmt, tirx.BufferStore | tirx.Evaluate):  # a store, or an atomic add
            if count > best.iterations:
                best = ThreadWork(name, count, block, loops)
            return
        for child in _children(stmt):
            visit(child, count, block, loops)

    visit(func.body, 1, "", ())
    return best


def _children(stmt) -> list:
    if isinstance(stmt, tirx.SeqStmt):
        return list(stmt.seq)
    if isinstance(stmt, tirx.IfThenElse):
        return [s for s in (stmt.then_case, stmt.else_case) if s is not None]
    body = getattr(stmt, "body", None)
    return [body] if isinstance(body, tirx.Stmt) else []


def kernel_thread_work(mod: tvm.IRModule) -> list[ThreadWork]:
    """`serial_iterations` of every kernel of `mod`, busiest first."""
    works = [serial_iterations(func, gv.name_hint) for gv, func in mod.functions_items()
             if isinstance(func, tirx.PrimFunc)]
    return sorted(works, key=lambda w: -w.iterations)
