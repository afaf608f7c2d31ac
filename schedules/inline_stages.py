"""Inlining a fused kernel's injective scratch stages into their consumers, shared by the
default CPU and GPU schedules.

A fused kernel computes each stage (a reshape, a bias add, each step of a GELU) into a scratch
buffer of its own; run as written, every stage is a pass over memory (on a GPU, a kernel launch
and a round trip through global memory each). A stage is inlined (`compute_inline`) unless
it reduces, writes a kernel parameter, feeds a vendor library call (`tvm_ext_library*` blocks
read materialised buffers) or a contraction (its input is read once per output column: it stays
materialised, in the layout the contraction reads best), or calls `exp`/`tanh`/.. and has more
than one consumer (it would be recomputed).
"""

from __future__ import annotations

from tvm import s_tir, tirx

from .default_cpu_analysis import (
    buffer_id,
    has_transcendental,
    is_leaf,
    is_library,
    is_reduction,
    read,
    root_blocks,
    written,
)
from .default_cpu_contraction import is_contraction


def param_buffers(func: tirx.PrimFunc) -> set[int]:
    """The kernel's parameter buffers (inlining never removes a store to them)."""
    return {buffer_id(p) for p in func.params if getattr(p, "shape", None) is not None}


def _library_inputs(sch: s_tir.Schedule) -> set[int]:
    """Buffers a library block reads: their producers must stay blocks of their own."""
    names: set[int] = set()
    for block in root_blocks(sch):
        if is_library(sch, block):
            names |= read(sch, block)
    return names


def _inlinable(sch: s_tir.Schedule, block, params: set, protected: set) -> bool:
    if is_library(sch, block) or is_reduction(sch, block) or not is_leaf(sch, block):
        return False
    out = written(sch, block)
    if not out or out & params or out & protected:
        return False
    consumers = [c for c in root_blocks(sch) if read(sch, c) & out]
    if any(is_library(sch, c) or is_contraction(sch, c) for c in consumers):
        return False
    return len(consumers) <= 1 or not has_transcendental(sch, block)


def inline_injective(sch: s_tir.Schedule, params: set) -> None:
    """Inline every injective scratch stage `_inlinable` allows, until none more can be."""
    changed = True
    while changed:
        changed = False
        protected = _library_inputs(sch)
        for block in root_blocks(sch):
            if not _inlinable(sch, block, params, protected):
                continue
            try:
                sch.compute_inline(block)
            except Exception:  # TVM refuses some inlines: the stage stays
                continue
            changed = True
            break
