"""Default CPU schedule of an injective block (elementwise, broadcast, reshape, transpose).

The innermost loop (the output's contiguous axis) is split by the vector width and vectorised;
the loops outside it are fused into one parallel loop, when there is enough work to pay for
waking the thread pool. A transpose (an input contiguous along another loop than the
innermost) is tiled `TRANSPOSE_TILE` x `TRANSPOSE_TILE` so that both its reads and its writes
stay within a few cache lines: 5-8x faster than the loop order of the definition on a
256 x 8192 weight.
"""

from __future__ import annotations

from tvm import s_tir

from .default_cpu_analysis import product, static_extent, strides, vector_safe

# Loops with fewer iterations (times the elements each computes) than this run serially:
# waking TVM's pool costs about 1 us (1 thread) to 3 us (2 threads); measured on 2 cores, a
# vectorised add breaks even with 2 threads at about 32K float32 elements and gains 35% at 64K.
MIN_PARALLEL_WORK = 65536
# Outer loops are fused until the parallel loop has this many iterations (or all are fused).
PARALLEL_CHUNKS = 64
# Measured on 256 x 8192 .. 64 x 512 float32 transposes: 8 x 8 tiles, the output's axis in
# vectors, beat 16 and 32 (whose tiles spill out of L1 with the strided side).
TRANSPOSE_TILE = 8


def vector_width(extent: int | None, lanes: int) -> int | None:
    """The widest of lanes, lanes/2, .. (at least 4) dividing a static `extent`."""
    width = lanes
    while extent is not None and width >= 4:
        if extent % width == 0:
            return width
        width //= 2
    return None


def fuse_parallel(sch: s_tir.Schedule, loops: list, inner_work: int | None = 1):
    """Fuse the leading `loops` (no more than needed for `PARALLEL_CHUNKS` iterations) and run
    them in parallel when all of them times `inner_work` is at least `MIN_PARALLEL_WORK`.
    Returns the outermost loop left (parallel or not), None without loops."""
    if not loops:
        return None
    extents = [static_extent(sch, lp) for lp in loops]
    total = product(extents)
    if total is not None and inner_work is not None and total * inner_work < MIN_PARALLEL_WORK:
        return loops[0]
    count, chunks = 0, 1
    for extent in extents:
        count += 1
        if extent is None:
            chunks = None
            continue
        if chunks is not None:
            chunks *= extent
            if chunks >= PARALLEL_CHUNKS:
                break
    outer = sch.fuse(*loops[:count]) if count > 1 else loops[0]
    sch.parallel(outer)
    return outer


def vectorize_innermost(sch: s_tir.Schedule, block, loop, lanes: int):
    """Split `loop` by the vector width and vectorise the inner part: (outer, vector loop), or
    None when it has no static extent a vector width divides or the block is not plain."""
    width = vector_width(static_extent(sch, loop), lanes)
    if width is None or not vector_safe(sch, block):
        return None
    outer, inner = sch.split(loop, [None, width])
    sch.vectorize(inner)
    return outer, inner


def _transposed_loop(sch: s_tir.Schedule, block, loops: list) -> int | None:
    """The position of the loop along which some input is contiguous while it is strided
    along the innermost loop (a transpose), when both loops tile evenly."""
    if len(loops) < 2 or static_extent(sch, loops[-1]) is None or \
            static_extent(sch, loops[-1]) % TRANSPOSE_TILE:
        return None
    inner = strides(sch, block, loops[-1])
    strided = {a.buffer for a in inner if not a.store and a.stride not in (0, 1)}
    if not strided:
        return None
    for pos in range(len(loops) - 2, -1, -1):
        extent = static_extent(sch, loops[pos])
        if extent is None or extent % TRANSPOSE_TILE:
            continue
        if any(a.buffer in strided and a.stride == 1 for a in strides(sch, block, loops[pos])):
            return pos
    return None


def _transpose(sch: s_tir.Schedule, block, loops: list, pos: int) -> None:
    rows, cols = loops[pos], loops[-1]
    row_o, row_i = sch.split(rows, [None, TRANSPOSE_TILE])
    col_o, col_i = sch.split(cols, [None, TRANSPOSE_TILE])
    outer = [*loops[:pos], *loops[pos + 1:-1]]
    sch.reorder(*outer, row_o, col_o, row_i, col_i)
    if vector_safe(sch, block):
        sch.vectorize(col_i)
    fuse_parallel(sch, [*outer, row_o, col_o], TRANSPOSE_TILE * TRANSPOSE_TILE)


def schedule_elementwise(sch: s_tir.Schedule, block, lanes: int) -> None:
    """Vectorised innermost loop, parallel outer loops (tiled when it is a transpose)."""
    loops = sch.get_loops(block)
    if not loops:
        return
    pos = _transposed_loop(sch, block, loops)
    if pos is not None:
        _transpose(sch, block, loops, pos)
        return
    split = vectorize_innermost(sch, block, loops[-1], lanes)
    if split is None:
        fuse_parallel(sch, list(loops))
        return
    outer, inner = split
    fuse_parallel(sch, [*loops[:-1], outer], static_extent(sch, inner))
