"""Default CPU schedules of reductions that are not contractions (default_cpu_contraction.py).

- **Row groups** (softmax, layer norm, RMS norm: reductions along a row, then a block that
  uses them): the last block's leading spatial loops are fused into one parallel loop over the
  rows and every other block is computed at it, so that each row is read from L1 by the
  blocks after the first and the scratch buffers shrink to one row (`schedule_row_group`).
- **Row reductions** (the reduced axis is contiguous): `rfactor` by the vector width, so the
  accumulation runs in `lanes` independent vector lanes and one horizontal step per row ends
  it; this reassociates a sum (the result differs from the serial sum by rounding only).
- **Column reductions** (the output's innermost axis is contiguous in the input: a sum over a
  leading axis, pooling windows): the innermost spatial axis is vectorised inside the
  reduction loops, so each reduction step updates a vector of outputs.
- **Long reductions** (at most a vector of outputs, each the sum of at least `LONG_REDUCTION`
  contiguous terms: a loss, a norm over a whole tensor): the reduction loops fused and
  `rfactor`ed into `PARTIAL_SUMS` vectors of partial sums, each over an interleaved share of
  the terms, in parallel, then summed. One accumulator per output would also be correct, but
  serial and, in float32, off by about 1e-3 after a million terms (tested).
"""

from __future__ import annotations

import tvm
from tvm import s_tir

from .default_cpu_analysis import (
    is_reduction,
    loop_kinds,
    product,
    root_blocks,
    static_extent,
    strides,
    vector_safe,
)
from .default_cpu_elementwise import (
    MIN_PARALLEL_WORK,
    fuse_parallel,
    vector_width,
    vectorize_innermost,
)

# A block computed at a row loop may run at most this many times the iterations the row's
# last block runs there (more means it recomputes far more than one row: rejected).
MAX_ROW_WORK_RATIO = 4


# Terms per output from which a long reduction gets partial sums, and how many vectors of
# them (each vector lane sums terms / (lanes * PARTIAL_SUMS) of them: 256 for a million terms).
LONG_REDUCTION = 1 << 14
PARTIAL_SUMS = 16


def _split_kinds(sch: s_tir.Schedule, block) -> tuple[list, list]:
    """(spatial loops, reduction loops) of `block`, reordered spatial first if needed."""
    loops = sch.get_loops(block)
    kinds = loop_kinds(sch, block)
    spatial = [lp for lp, k in zip(loops, kinds, strict=True) if k == "S"]
    reduce = [lp for lp, k in zip(loops, kinds, strict=True) if k == "R"]
    if kinds != ["S"] * len(spatial) + ["R"] * len(reduce):
        sch.reorder(*spatial, *reduce)
    return spatial, reduce


def _rfactor(sch: s_tir.Schedule, loop, factor_axis: int):
    """`sch.rfactor`, after giving every loopless root block a unit loop: TVM's rfactor fails
    ("block_realize == old_block_realize_") when the kernel has such a block (a scalar
    output's epilogue, e.g. a mean's division)."""
    for block in root_blocks(sch):
        if not sch.get_loops(block):
            sch.add_unit_loop(block)
    return sch.rfactor(loop, factor_axis)


def rfactor_row(sch: s_tir.Schedule, block, lanes: int):
    """rfactor the innermost reduction loop by the vector width when every input is contiguous
    (or constant) along it: the block that accumulates `width` partial results, or None."""
    if not is_reduction(sch, block) or not vector_safe(sch, block):
        return None
    _, reduce = _split_kinds(sch, block)
    if not reduce:
        return None
    inner = reduce[-1]
    width = vector_width(static_extent(sch, inner), lanes)
    loads = [a for a in strides(sch, block, inner) if not a.store]
    total = product(static_extent(sch, lp) for lp in reduce)
    if width is None or (total is not None and total < 2 * width) or not loads or \
            any(a.stride not in (0, 1) for a in loads) or all(a.stride == 0 for a in loads):
        return None
    _, lane = sch.split(inner, [None, width])
    factor_axis = len(sch.get(block).writes[0].source.shape)
    return _rfactor(sch, lane, factor_axis)


def finish_rfactor(sch: s_tir.Schedule, rf, after) -> None:
    """The rfactor block's lane loop innermost and vectorised, its init hoisted; `after` is the
    loop it was computed at (None: it stays at the root)."""
    loops = sch.get_loops(rf)
    kinds = loop_kinds(sch, rf)
    start = 0
    if after is not None:
        target = sch.get(after)
        start = next(i for i, lp in enumerate(loops) if sch.get(lp).same_as(target)) + 1
    inner = [(lp, k) for lp, k in zip(loops[start:], kinds[start:], strict=True)]
    lane = [lp for lp, k in inner if k == "S" and (static_extent(sch, lp) or 0) > 1][-1]
    reduce = [lp for lp, k in inner if k == "R"]
    others = [lp for lp, _ in inner if not sch.get(lp).same_as(sch.get(lane))]
    sch.reorder(*others, lane)
    sch.vectorize(lane)
    if reduce:
        sch.decompose_reduction(rf, reduce[0])


def _trips(sch: s_tir.Schedule, block, after):
    """Iterations of `block`'s loops under the loop `after` (a PrimExpr)."""
    loops = sch.get_loops(block)
    target = sch.get(after)
    start = next(i for i, lp in enumerate(loops) if sch.get(lp).same_as(target)) + 1
    total = tvm.tirx.const(1, "int64")
    for lp in loops[start:]:
        total = total * tvm.tirx.Cast("int64", sch.get(lp).extent)
    return total


def _check_row_work(sch: s_tir.Schedule, blocks: list, last, row) -> None:
    """Raise when some block computed at `row` recomputes more than about one row."""
    analyzer = tvm.sym.Analyzer()
    limit = _trips(sch, last, row) * MAX_ROW_WORK_RATIO
    for block in blocks:
        if not analyzer.can_prove(_trips(sch, block, row) <= limit):
            raise ValueError(f"{sch.get(block).name_hint} is not a row of the group")


def schedule_row_group(sch: s_tir.Schedule, names: list[str], rows: int, lanes: int) -> None:
    """The blocks `names` (root blocks, in order; the last one uses the others) computed at
    the fused first `rows` loops of the last block. Raises when they do not fit."""
    rfactored = {}
    for name in names:
        rf = rfactor_row(sch, sch.get_sblock(name), lanes)
        if rf is not None:
            rfactored[name] = sch.get(rf).name_hint
    last = sch.get_sblock(names[-1])
    loops = sch.get_loops(last)
    if rows > len(loops) or "R" in loop_kinds(sch, last)[:rows]:
        raise ValueError("the last block has fewer spatial loops than rows")
    row = sch.fuse(*loops[:rows]) if rows > 1 else loops[0]
    moved = [n for name in names[:-1] for n in (rfactored.get(name), name) if n is not None]
    if names[-1] in rfactored:
        moved.append(rfactored[names[-1]])
    for name in reversed(moved):
        sch.compute_at(sch.get_sblock(name), row)
    _check_row_work(sch, [sch.get_sblock(n) for n in moved], last, row)
    work = _trips(sch, last, row)
    work = int(work.value) if isinstance(work, tvm.ir.prim.expr.IntImm) else None
    fuse_parallel(sch, [row], work)
    for name in [*moved, names[-1]]:
        _finish_row_block(sch, name, set(rfactored.values()), row, lanes)


def _finish_row_block(sch: s_tir.Schedule, name: str, rf_names: set, row, lanes: int) -> None:
    block = sch.get_sblock(name)
    if name in rf_names:
        finish_rfactor(sch, block, row)
        return
    loops = sch.get_loops(block)
    target = sch.get(row)
    inner = loops[next(i for i, lp in enumerate(loops) if sch.get(lp).same_as(target)) + 1:]
    if not inner:
        return
    kinds = loop_kinds(sch, block)[-len(inner):]
    if "R" not in kinds:
        vectorize_innermost(sch, block, inner[-1], lanes)
    else:
        sch.decompose_reduction(block, inner[kinds.index("R")])


def schedule_column_reduction(sch: s_tir.Schedule, block, lanes: int) -> bool:
    """Vectorise the output's innermost axis inside the reduction loops, when it is
    contiguous in the inputs; False (nothing changed) otherwise."""
    loops = sch.get_loops(block)
    kinds = loop_kinds(sch, block)
    spatial = [lp for lp, k in zip(loops, kinds, strict=True) if k == "S"]
    if not spatial or "R" not in kinds or not vector_safe(sch, block):
        return False
    last = spatial[-1]
    accesses = strides(sch, block, last)
    loads = [a for a in accesses if not a.store]
    width = vector_width(static_extent(sch, last), lanes)
    if width is None or not any(a.stride in (1, 2) for a in loads) or \
            any(a.stride not in (0, 1, 2) for a in loads) or \
            any(a.store and a.stride != 1 for a in accesses):
        return False
    spatial, reduce = _split_kinds(sch, block)
    outer, inner = sch.split(spatial[-1], [None, width])
    sch.reorder(outer, *reduce, inner)
    sch.vectorize(inner)
    reduce_work = 1
    for lp in reduce:
        reduce_work *= static_extent(sch, lp) or 64
    fuse_parallel(sch, [*spatial[:-1], outer], width * reduce_work)
    sch.decompose_reduction(block, reduce[0])
    return True


def _contiguous_chain(sch: s_tir.Schedule, block, reduce: list) -> bool:
    """Every load reads the reduction loops, innermost last, as one contiguous run (or does not
    move with them), and at least one load moves."""
    extents = [static_extent(sch, lp) for lp in reduce]
    per_loop = [strides(sch, block, lp) for lp in reduce]
    moving = False
    for i in range(len(per_loop[0])):
        if per_loop[0][i].store:
            continue
        steps = [accesses[i].stride for accesses in per_loop]
        if all(step == 0 for step in steps):
            continue
        want = 1
        for step, extent in zip(reversed(steps), reversed(extents), strict=True):
            if step != want:
                return False
            want *= extent
        moving = True
    return moving


def schedule_long_reduction(sch: s_tir.Schedule, block, lanes: int) -> bool:
    """Partial sums for a long reduction (see the module docstring); False (nothing changed)
    when `block` is not one."""
    if not is_reduction(sch, block) or not vector_safe(sch, block):
        return False
    spatial, reduce = _split_kinds(sch, block)
    terms = product(static_extent(sch, lp) for lp in reduce)
    outputs = product(static_extent(sch, lp) for lp in spatial)
    if terms is None or outputs is None or terms < LONG_REDUCTION or outputs > lanes:
        return False
    partials = lanes * PARTIAL_SUMS
    if terms % partials or not _contiguous_chain(sch, block, reduce):
        return False
    fused = sch.fuse(*reduce) if len(reduce) > 1 else reduce[0]
    _, share = sch.split(fused, [None, partials])
    rf = _rfactor(sch, share, len(sch.get(block).writes[0].source.shape))
    loops = sch.get_loops(rf)
    kinds = loop_kinds(sch, rf)
    outer, lane = sch.split(loops[-1], [None, lanes])
    rest = [lp for lp, k in zip(loops[:-1], kinds[:-1], strict=True) if k == "S"]
    serial = [lp for lp, k in zip(loops[:-1], kinds[:-1], strict=True) if k == "R"]
    sch.reorder(*rest, outer, *serial, lane)
    sch.vectorize(lane)
    parallel = sch.fuse(*rest, outer) if rest else outer
    if terms * outputs >= MIN_PARALLEL_WORK:
        sch.parallel(parallel)
    sch.decompose_reduction(rf, serial[0])
    return True


def schedule_reduction(sch: s_tir.Schedule, block, lanes: int) -> None:
    """One reduction on its own: a long reduction's partial sums, a column reduction when it
    vectorises that way, else a row reduction (rfactor by the vector width where the row is
    contiguous, else serial rows)."""
    if schedule_long_reduction(sch, block, lanes) or \
            schedule_column_reduction(sch, block, lanes):
        return
    name = sch.get(block).name_hint
    _, reduce = _split_kinds(sch, block)
    work = 1
    for lp in reduce:
        work *= static_extent(sch, lp) or 64
    rf = rfactor_row(sch, block, lanes)
    spatial, _ = _split_kinds(sch, sch.get_sblock(name))
    if rf is None:
        fuse_parallel(sch, spatial, work)
        return
    if not spatial:
        finish_rfactor(sch, rf, None)
        return
    row = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
    sch.compute_at(rf, row)
    fuse_parallel(sch, [row], work)
    finish_rfactor(sch, rf, row)
