"""Whether a swapped build computes the unswapped build's bits.

Swapping, recompute and splitting move and repeat the same kernels on the same bytes, so a
swapped run's outputs equal the unswapped build's exactly, with two exceptions, both ops run in
chunks. A kernel that a vendor library computes (a GEMM or convolution, `Op.library`): the
library picks its kernel and blocking by shape (OpenBLAS takes a matrix-vector path for a
single row), so the chunks may round differently from the whole. And a reduction split along
the dim it reduces (`SplitOption.accumulate`): each chunk adds its part to the output, so the
sum runs in chunk order where the whole kernel's schedule (vector lanes, a library, a GPU's
threads) adds in another. Such a run is compared within the float tolerance of its dtype, and
says which ops made it so.
"""

from __future__ import annotations

from ..ir.graph import DataflowGraph
from .plan import SwapPlan


def inexact_splits(graph: DataflowGraph, plan: SwapPlan) -> list[str]:
    """The ops (by name) that `plan` runs in chunks whose rounding may differ from the whole
    op's: those a vendor library computes, and reductions split along the reduced dim."""
    return sorted({graph.ops[sp.op].name for sp in plan.splits
                   if graph.ops[sp.op].library or sp.accumulate})
