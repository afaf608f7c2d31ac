"""Default CPU schedule of a contraction: a reduction over products of two or more inputs
(matmul, batched matmul, convolution as TVM generates it, i.e. with `--no-library` or where
the library does not apply).

Register tiling, the way BLAS micro-kernels do it: the output's innermost axis (contiguous in
one input, the "vector operand") is split into `vectors` vectors of `width` lanes, and a second
spatial axis along which the vector operand does not move (matmul's rows, a convolution's
output channels) into `rows` rows. For each tile the reduction loops run outside the
`rows x vectors` block of accumulators, which is cached in a local buffer (registers once
unrolled): each reduction step loads `vectors` vectors and broadcasts `rows` scalars for
`rows x vectors` fused multiply-adds. The tile loops outside are fused into one parallel loop.
The write-back of the tile takes the elementwise epilogue with it (bias, activation:
`reverse_compute_inline`), so the output is written once.
"""

from __future__ import annotations

import dataclasses

from tvm import s_tir

from .default_cpu_analysis import (
    is_reduction,
    loop_kinds,
    read,
    realize_of,
    root_blocks,
    static_extent,
    strides,
    vector_safe,
    written,
)
from .default_cpu_elementwise import fuse_parallel, vector_width

# Accumulator registers a tile may hold: 32 vector registers with AVX-512 (16 lanes of
# float32), 16 with AVX2; the rest hold the loaded vectors and the broadcast scalars.
ACCUMULATORS = {16: 24, 8: 12}


@dataclasses.dataclass(frozen=True)
class Tile:
    vector_pos: int  # position of the vector loop among the spatial loops
    width: int
    vectors: int
    row_pos: int | None  # position of the row loop among the spatial loops
    rows: int


def is_contraction(sch: s_tir.Schedule, block) -> bool:
    """A reduction reading two or more inputs that all move along some reduction loop."""
    if not is_reduction(sch, block):
        return False
    inputs = read(sch, block) - written(sch, block)
    if len(inputs) < 2:
        return False
    kinds = loop_kinds(sch, block)
    moving: set = set()
    for loop, kind in zip(sch.get_loops(block), kinds, strict=True):
        if kind == "R":
            moving |= {a.buffer for a in strides(sch, block, loop)
                       if not a.store and a.stride != 0}
    return len(moving & inputs) >= 2


def _tile(sch: s_tir.Schedule, block, spatial: list, lanes: int) -> Tile | None:
    if not spatial or not vector_safe(sch, block):
        return None
    vector = spatial[-1]
    accesses = strides(sch, block, vector)
    loads = [a for a in accesses if not a.store]
    width = vector_width(static_extent(sch, vector), lanes)
    if width is None or any(a.store and a.stride != 1 for a in accesses) or \
            any(a.stride not in (0, 1, 2) for a in loads):
        return None
    moving = {a.buffer for a in loads if a.stride != 0}
    if not moving:
        return None
    extent = static_extent(sch, vector)
    vectors = 2 if extent % (2 * width) == 0 else 1
    budget = ACCUMULATORS.get(width, 12) // vectors
    for pos in range(len(spatial) - 2, -1, -1):
        rows_extent = static_extent(sch, spatial[pos])
        if rows_extent is None or any(a.buffer in moving and a.stride != 0
                                      for a in strides(sch, block, spatial[pos])):
            continue
        for rows in range(min(budget, 8), 1, -1):
            if rows_extent % rows == 0:
                return Tile(len(spatial) - 1, width, vectors, pos, rows)
    return Tile(len(spatial) - 1, width, vectors, None, 1)


def _padding(sch: s_tir.Schedule, block, spatial: list, lanes: int) -> list[int] | None:
    """The `pad_einsum` multiples that make the vector axis a whole number of vectors (a static
    extent no vector width divides: ViT's 65 tokens), or None."""
    vector = spatial[-1]
    extent = static_extent(sch, vector)
    if extent is None or extent < 4 or vector_width(extent, lanes) is not None:
        return None
    width = lanes
    while width > 4 and -(-extent // (width // 2)) == -(-extent // width):
        width //= 2  # as many vectors with narrower ones: pad less
    target = sch.get(vector).loop_var
    realize = realize_of(sch, block)
    padding = [width if value.same_as(target) else 1 for value in realize.iter_values]
    return padding if width in padding else None


def schedule_contraction(sch: s_tir.Schedule, block, lanes: int) -> list[str] | None:
    """Register-tile the contraction `block` (see the module docstring) and inline its
    elementwise consumers into the tile's write-back. Returns the blocks padding added (to be
    scheduled as injective blocks), or None (unchanged) when no axis vectorises."""
    name = sch.get(block).name_hint
    loops = sch.get_loops(block)
    kinds = loop_kinds(sch, block)
    spatial = [lp for lp, k in zip(loops, kinds, strict=True) if k == "S"]
    added: list[str] = []
    padding = _padding(sch, block, spatial, lanes) if spatial else None
    if padding is not None:
        before = {sch.get(b).name_hint for b in root_blocks(sch)}
        sch.pad_einsum(block, padding)
        block = sch.get_sblock(name)
        added = [n for n in (sch.get(b).name_hint for b in root_blocks(sch))
                 if n not in before and n != name]
        loops = sch.get_loops(block)
        spatial = [lp for lp, k in zip(loops, kinds, strict=True) if k == "S"]
    reduce = [lp for lp, k in zip(loops, kinds, strict=True) if k == "R"]
    tile = _tile(sch, block, spatial, lanes)
    if tile is None:
        return None if padding is None else added
    v_outer, v_vecs, v_lane = sch.split(spatial[tile.vector_pos],
                                        [None, tile.vectors, tile.width])
    outer = [*spatial[:-1], v_outer]
    inner = [v_vecs, v_lane]
    if tile.row_pos is not None:
        # The row tiles innermost of the tile loops: the vector operand's panel (a B panel
        # of a matmul) stays in cache while every row tile reads it; the other operand,
        # read once per column tile, is the smaller re-read (rows < vectors x width).
        r_outer, r_inner = sch.split(spatial[tile.row_pos], [None, tile.rows])
        outer = [*spatial[:tile.row_pos], *spatial[tile.row_pos + 1:-1], v_outer, r_outer]
        inner.insert(0, r_inner)
    sch.reorder(*outer, *reduce, *inner)
    work = tile.rows * tile.vectors * tile.width
    for lp in reduce:
        work *= static_extent(sch, lp) or 64
    fuse_parallel(sch, outer, work)
    loops = sch.get_loops(sch.get_sblock(name))
    tile_loop = loops[len(loops) - len(reduce) - len(inner) - 1]
    local = sch.cache_write(sch.get_sblock(name), 0, "local")
    sch.reverse_compute_at(local, tile_loop)
    _inline_epilogue(sch, local)
    _finish_tile(sch, name, len(inner))
    _vectorize_write_back(sch, local, tile.width)
    return added


def _inline_epilogue(sch: s_tir.Schedule, write_back) -> None:
    """Inline the elementwise consumers of the contraction's output into its write-back."""
    changed = True
    while changed:
        changed = False
        for consumer in sch.get_consumers(write_back):
            stmt = sch.get(consumer)
            if stmt.name_hint.startswith("tvm_ext_library") or is_reduction(sch, consumer):
                continue
            try:
                sch.reverse_compute_inline(consumer)
                changed = True
                break
            except Exception:
                continue


def _finish_tile(sch: s_tir.Schedule, name: str, inner_count: int) -> None:
    """Hoist the init out of the reduction loops, unroll the tile and vectorise its lanes."""
    block = sch.get_sblock(name)
    loops = sch.get_loops(block)
    kinds = loop_kinds(sch, block)
    first_reduce = kinds.index("R")
    inner = loops[-inner_count:]
    for lp in inner[:-1]:
        sch.unroll(lp)
    sch.vectorize(inner[-1])
    init = sch.decompose_reduction(block, loops[first_reduce])
    init_loops = sch.get_loops(init)
    for lp in init_loops[-inner_count:-1]:
        sch.unroll(lp)
    sch.vectorize(init_loops[-1])


def _vectorize_write_back(sch: s_tir.Schedule, write_back, width: int) -> None:
    loops = sch.get_loops(write_back)
    extent = static_extent(sch, loops[-1])
    if extent is None or extent % width or not vector_safe(sch, write_back):
        return
    _, lane = sch.split(loops[-1], [None, width])
    sch.vectorize(lane)
