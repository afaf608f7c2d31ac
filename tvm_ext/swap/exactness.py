"""Whether a swapped build computes the unswapped build's bits.

Swapping, recompute and splitting move and repeat the same kernels on the same bytes, so a
swapped run's outputs equal the unswapped build's exactly, with one exception: a kernel that a
vendor library computes (a GEMM or convolution, `Op.library`) run in chunks. The library picks
its kernel and blocking by shape (OpenBLAS takes a matrix-vector path for a single row), so the
chunks may round differently from the whole: such a run is compared within the float tolerance
of its dtype, and says which ops made it so.
"""

from __future__ import annotations

from ..ir.graph import DataflowGraph
from .plan import SwapPlan


def library_splits(graph: DataflowGraph, plan: SwapPlan) -> list[str]:
    """The ops (by name) that `plan` runs in chunks and a vendor library computes."""
    return sorted({graph.ops[sp.op].name for sp in plan.splits if graph.ops[sp.op].library})
