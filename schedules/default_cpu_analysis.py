"""What the default CPU schedule rules read from a kernel: blocks, their loops' kinds and static
extents, and the element stride of every access along a loop (see default_cpu.py).

Strides are read on the block as written (before any split or fuse): every loop of the nest is
bound to its range, the indices are simplified with those bounds (a reshape's `(i * 64 + j) %
128` becomes `i * 64 + j`), flattened row-major and differentiated along the loop.
"""

from __future__ import annotations

import dataclasses

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.prim import expr as pe

from tvm_ext.ir.pass_records import LIBRARY_BLOCK_PREFIX

# Calls that cost far more than a load (recomputing them per consumer does not pay).
TRANSCENDENTAL = frozenset(f"tirx.{name}" for name in (
    "exp", "exp2", "exp10", "log", "log2", "log10", "log1p", "tanh", "sigmoid", "erf", "pow",
    "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh",
    "atanh"))


@dataclasses.dataclass(frozen=True)
class Access:
    """One load or store of a block: its buffer (`buffer_id`), and the step of its flattened
    element offset per iteration of a loop (None where the offset is not affine in the loop)."""

    buffer: int
    store: bool
    stride: int | None


def static_extent(sch: s_tir.Schedule, loop) -> int | None:
    extent = sch.get(loop).extent
    return int(extent.value) if isinstance(extent, pe.IntImm) else None


def product(extents) -> int | None:
    total = 1
    for extent in extents:
        if extent is None:
            return None
        total *= extent
    return total


def is_library(sch: s_tir.Schedule, block) -> bool:
    return sch.get(block).name_hint.startswith(LIBRARY_BLOCK_PREFIX)


def root_blocks(sch: s_tir.Schedule) -> list:
    return list(sch.get_child_blocks(sch.get_sblock("root")))


def realize_of(sch: s_tir.Schedule, block) -> s_tir.SBlockRealize:
    target = sch.get(block)
    found: list = []
    tvm_ffi.structural_walk(sch.mod["main"].body, [(s_tir.SBlockRealize, found.append)])
    return next(r for r in found if r.block.same_as(target))


def is_reduction(sch: s_tir.Schedule, block) -> bool:
    return any(iv.iter_type != tirx.IterVar.DataPar for iv in sch.get(block).iter_vars)


def is_leaf(sch: s_tir.Schedule, block) -> bool:
    """A block whose body holds no loop and no block of its own (the rules schedule only
    these: an opaque block with inner loops keeps its loops as written)."""
    nested: list = []
    stmt = sch.get(block)
    tvm_ffi.structural_walk(stmt.body, [((tirx.For, s_tir.SBlockRealize), nested.append)])
    return not nested and bool(stmt.iter_vars)


def buffer_id(buffer) -> int:
    """A buffer's identity (names repeat: FuseTIR keeps `T_multiply` for several buffers)."""
    return int(buffer.id_)


def written(sch: s_tir.Schedule, block) -> set[int]:
    return {buffer_id(w.source) for w in sch.get(block).writes}


def read(sch: s_tir.Schedule, block) -> set[int]:
    return {buffer_id(r.source) for r in sch.get(block).reads}


def has_transcendental(sch: s_tir.Schedule, block) -> bool:
    calls: list = []
    tvm_ffi.structural_walk(sch.get(block).body, [(tvm.ir.Call, calls.append)])
    return any(getattr(c.op, "name", "") in TRANSCENDENTAL for c in calls)


def loop_kinds(sch: s_tir.Schedule, block) -> list[str]:
    """Per loop of `block`: "S" when it feeds only spatial block variables, "R" otherwise."""
    realize = realize_of(sch, block)
    reduce_vars: set = set()
    for iv, value in zip(realize.block.iter_vars, realize.iter_values, strict=True):
        if iv.iter_type != tirx.IterVar.DataPar:
            tvm_ffi.structural_walk(value, [(pe.Var, reduce_vars.add)])
    return ["R" if sch.get(lp).loop_var in reduce_vars else "S" for lp in sch.get_loops(block)]


def vector_safe(sch: s_tir.Schedule, block) -> bool:
    """Blocks vectorised are plain: one store, no bindings, no integer truncating division
    (argmax tuples and pooling gradients are not: LLVM vectorises them wrongly)."""
    stmt = sch.get(block)
    stores: list = []
    odd: list = []

    def int_division(node):
        if "int" in str(node.a.ty):
            odd.append(node)

    tvm_ffi.structural_walk(stmt.body, [(tirx.BufferStore, stores.append),
                                        (tirx.Bind, odd.append),
                                        ((pe.Div, pe.Mod), int_division)])
    return len(stores) == 1 and not odd and len(stmt.writes) == 1


def strides(sch: s_tir.Schedule, block, loop) -> list[Access]:
    """Every access of `block` (loads of the buffers it writes, the accumulator, excluded) with
    its element stride along `loop`."""
    realize = realize_of(sch, block)
    binding = dict(zip([iv.var for iv in realize.block.iter_vars], realize.iter_values,
                       strict=True))
    analyzer = tvm.sym.Analyzer()
    for lp in sch.get_loops(block):
        stmt = sch.get(lp)
        analyzer.bind(stmt.loop_var, tvm.ir.Range.from_min_extent(stmt.min, stmt.extent))
    var = sch.get(loop).loop_var
    outputs = written(sch, block)
    found: list[Access] = []

    def visit(node, store: bool):
        buffer = node.buffer if store else node.source
        if not store and buffer_id(buffer) in outputs:
            return
        offset = _flat_offset(node.indices, buffer.shape, binding)
        found.append(Access(buffer_id(buffer), store, _step(analyzer.simplify(offset), var)))

    tvm_ffi.structural_walk(realize.block.body, [
        (tirx.BufferStore, lambda n: visit(n, True)),
        (tvm.ir.TensorLoad, lambda n: visit(n, False))])
    return found


def _flat_offset(indices, shape, binding: dict):
    def bound(expr):
        return tvm_ffi.structural_map(expr, (pe.Var, lambda v: binding.get(v, v)))

    offset = tirx.const(0, "int64")
    for index, extent in zip(indices, shape, strict=True):
        offset = offset * tirx.Cast("int64", extent) + tirx.Cast("int64", bound(index))
    return offset


def _step(offset, var) -> int | None:
    try:
        coeffs = tvm.sym.detect_linear_equation(offset, [var])
    except Exception:
        return None
    if len(coeffs) == 2 and isinstance(coeffs[0], pe.IntImm):
        return int(coeffs[0].value)
    return None
