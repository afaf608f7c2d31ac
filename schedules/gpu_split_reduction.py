"""A reduction too long for one GPU thread block, in two stages (a loss over a whole batch).

dlight reduces each output in one thread block: a mean over every logit of a batch
(4 x 512 x 50257 = 103M terms into one value) then runs on one block, its scalar case on one
thread. `SplitReduction` splits the reduced iterations in two: `outer` x `inner`, with
`inner` a divisor of the count near `THREADS * PER_THREAD`. A first kernel reduces each
`inner` run of each output in a block of `THREADS` threads (`rfactor`: a partial result per
output and run), a second reduces the partial results of each output in one block; each
thread's serial share is `inner / THREADS` in the first and `outer / THREADS` in the second.
Outputs that are not the reduction's (the mean's division) run one thread per element.
"""

from __future__ import annotations

import math

from tvm import s_tir, tirx
from tvm.target import Target

from .default_cpu_analysis import is_reduction, loop_kinds, root_blocks, static_extent

THREADS = 256
PER_THREAD = 16
# Reductions of fewer iterations per output go to one block per output (dlight's rules).
MIN_ITERATIONS = THREADS * PER_THREAD


class SplitReduction:
    """A GPU schedule rule (dlight's `apply` signature) for one long reduction per kernel."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool
              ) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or target.kind.name not in ("cuda", "rocm"):
            return None
        sch = s_tir.Schedule(func)
        blocks = root_blocks(sch)
        reductions = [b for b in blocks if is_reduction(sch, b)]
        if len(reductions) != 1 or any(sch.get_child_blocks(b) for b in blocks):
            return None
        for block in blocks:
            if not sch.get_loops(block):  # rfactor fails beside a loopless root block
                sch.add_unit_loop(block)
        red = reductions[0]
        kinds = loop_kinds(sch, red)
        if kinds != sorted(kinds, key=lambda k: k != "S") or "R" not in kinds:
            return None
        loops = sch.get_loops(red)
        spatial = [lp for lp, k in zip(loops, kinds, strict=True) if k == "S"]
        reduce = [lp for lp, k in zip(loops, kinds, strict=True) if k == "R"]
        extents = [static_extent(sch, lp) for lp in reduce]
        if any(e is None for e in extents) or math.prod(extents) < MIN_ITERATIONS:
            return None
        total = math.prod(extents)
        inner = _inner_count(total)
        if inner is None:
            return None
        r = sch.fuse(*reduce) if len(reduce) > 1 else reduce[0]
        outer_loop, _ = sch.split(r, [total // inner, inner])
        rf = sch.rfactor(outer_loop, len(spatial))
        for block in (rf, red):
            _cross_thread(sch, block)
        for block in blocks:
            if not sch.get(block).same_as(sch.get(red)) and not is_reduction(sch, block):
                _one_thread_each(sch, block)
        return sch


def _inner_count(total: int) -> int | None:
    """The largest divisor of `total` at most `MIN_ITERATIONS` and at least `THREADS` whose
    cofactor a block of `THREADS` can reduce in `PER_THREAD * THREADS`-ish steps; None when
    `total` has none (a prime count)."""
    best = None
    for d in range(THREADS, MIN_ITERATIONS + 1):
        if total % d == 0:
            best = d
    return best


def _cross_thread(sch: s_tir.Schedule, block) -> None:
    """The block's outputs over thread blocks, its reduction over `THREADS` threads of each
    (each thread a serial share, then a reduction across the threads)."""
    loops = sch.get_loops(block)
    kinds = loop_kinds(sch, block)
    spatial = [lp for lp, k in zip(loops, kinds, strict=True) if k == "S"]
    reduce = [lp for lp, k in zip(loops, kinds, strict=True) if k == "R"]
    sch.reorder(*spatial, *reduce)
    r = sch.fuse(*reduce) if len(reduce) > 1 else reduce[0]
    _, tx = sch.split(r, [None, THREADS])
    if spatial:
        bx = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
    else:  # a scalar output: one thread block
        bx = sch.add_unit_loop(sch.get_loops(block)[0])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")


def _one_thread_each(sch: s_tir.Schedule, block) -> None:
    loops = sch.get_loops(block)
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    extent = static_extent(sch, fused) or THREADS
    bx, tx = sch.split(fused, [None, min(THREADS, extent)])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
