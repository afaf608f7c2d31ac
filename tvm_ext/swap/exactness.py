"""Whether a swapped build computes the unswapped build's bits.

Swapping, recompute and splitting move and repeat the same kernels on the same bytes, so a
swapped run's outputs equal the unswapped build's exactly, except where a kernel that reduces
runs in chunks. A chunk is a kernel of another shape, and the order in which it sums is up to
the code that computes it: a vendor library picks its kernel and blocking by shape (OpenBLAS
takes a matrix-vector path for a single row), TVM's default schedules pick vector lanes and
tiles by extent (a GEMM cut into column chunks may sum its products in another order), and a
reduction split along the dim it reduces (`SplitOption.accumulate`) adds its chunks' parts in
chunk order. Element-wise kernels compute each element by the same expression at any shape, so
their chunks are exact. A run with such splits is compared within the float tolerance of its
dtype, and says which ops made it so.
"""

from __future__ import annotations

from ..graph import DataflowGraph
from .plan import SwapPlan


def inexact_splits(graph: DataflowGraph, plan: SwapPlan) -> list[str]:
    """The ops (by name) that `plan` runs in chunks whose rounding may differ from the whole
    op's: kernels that reduce (or that a vendor library computes), and reductions split along
    the reduced dim."""
    return sorted({graph.ops[sp.op].name for sp in plan.splits
                   if graph.ops[sp.op].library or graph.ops[sp.op].reduces or sp.accumulate})
