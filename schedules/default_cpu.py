"""Default CPU schedules for every kernel no tuning record scheduled.

TVM's CPU pipeline compiles an unscheduled kernel as written: one thread, scalar code, the loop
order of the operator's definition, one libm call per `exp`. `ApplyDefaultCPUSchedules` gives
each kernel what dlight's rules give GPU kernels (run it after FuseTIR and the library
dispatch, before lowering; it skips PrimFuncs marked `tirx.is_scheduled` and marks those it
schedules):

1. **Inline** the injective stages a fused kernel computes into scratch buffers (a reshape,
   a transpose, a broadcast) into their consumers (`compute_inline`), except into a
   contraction or a vendor library call, or, for a stage calling `exp`/`tanh`/.., into more
   than one consumer (inline_stages.py).
2. **Row groups** (softmax, layer norm: default_cpu_reduction.py): one parallel loop over rows,
   every stage of a row computed under it, row reductions accumulated in vector lanes.
3. **Contractions** (matmul, convolution: default_cpu_contraction.py): register tiles over
   the output, the reduction loops outside the vectorised tile, parallel tile loop, the
   elementwise epilogue inlined into the tile's write-back (`reverse_compute_inline`).
4. **Other reductions**: vectorised along the output's contiguous axis inside the reduction
   loops (sums over leading axes, pooling) or along the reduced row (rfactor), parallel rows.
5. **Injective blocks** (default_cpu_elementwise.py): vectorised innermost loop, fused
   parallel outer loops; transposes tiled.
6. **Vector math** (default_cpu_math.py, `vector_math=True`): float32 exp, tanh, erf, sigmoid
   and small integer powers as polynomials that vectorise (libm calls do not), within a few
   units in the last place.

The thread count follows `TVM_NUM_THREADS` at run time (TVM's thread pool): the schedule only
decides how many loops to fuse for enough parallel iterations. Symbolic extents keep their
loops whole (vectorised only along static axes). A kernel whose schedule fails keeps its
unscheduled body, and a failing rule leaves the other blocks scheduled: every schedule
primitive keeps the kernel's meaning, so a half-applied rule is slower, never wrong. Blocks
that call a vendor library (`tvm_ext.passes.DispatchLibraryKernels`, blocks named
`tvm_ext_library*`) are left as they are, and so are the blocks that produce their inputs
(they stay materialised) and their consumers' placement (nothing is inlined into them).
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.ir.transform import PassContext, module_pass
from tvm.target import codegen

from .default_cpu_analysis import (
    is_leaf,
    is_library,
    is_reduction,
    loop_kinds,
    root_blocks,
)
from .default_cpu_contraction import is_contraction, schedule_contraction
from .default_cpu_elementwise import schedule_elementwise
from .default_cpu_math import vector_math as rewrite_vector_math
from .default_cpu_reduction import schedule_reduction, schedule_row_group
from .inline_stages import inline_injective, param_buffers

SCHEDULED_ATTRS = ("tirx.is_scheduled", "tir.is_scheduled")


def vector_lanes(target: tvm.target.Target, bits: int = 32) -> int:
    """Lanes of the target's SIMD registers for elements of `bits` bits."""
    try:
        width = int(codegen.llvm_get_vector_width(target))
    except Exception:
        width = 128
    return max(1, max(width, 128) // bits)


def _element_bits(sch: s_tir.Schedule, block) -> int:
    writes = sch.get(block).writes
    if not writes:
        return 32
    return max(8, int(tvm.runtime.DataType(str(writes[0].source.dtype)).bits))


def _lanes(sch: s_tir.Schedule, block, target) -> int:
    return vector_lanes(target, _element_bits(sch, block))


def _row_candidates(sch: s_tir.Schedule, names: list[str]) -> list[int]:
    """Numbers of leading loops of the last block to try as the row loop, most first."""
    if len(names) < 2 or not any(is_reduction(sch, sch.get_sblock(n)) for n in names[:-1]):
        return []
    if any(is_contraction(sch, sch.get_sblock(n)) for n in names):
        return []
    last = sch.get_sblock(names[-1])
    kinds = loop_kinds(sch, last)
    spatial = len(kinds) - len("".join(kinds).lstrip("S"))
    top = spatial if "R" in kinds else spatial - 1
    return list(range(top, 0, -1))


def _try_row_group(func: tirx.PrimFunc, names: list[str], target) -> tirx.PrimFunc | None:
    probe = s_tir.Schedule(func)
    lanes = _lanes(probe, probe.get_sblock(names[-1]), target)
    for rows in _row_candidates(probe, names):
        sch = s_tir.Schedule(func)
        try:
            schedule_row_group(sch, names, rows, lanes)
        except Exception:  # not a row group at this depth: try fewer rows
            continue
        return sch.mod["main"]
    return None


def _schedule_each(sch: s_tir.Schedule, names: list[str], target) -> None:
    """Each block by its own rule; a rule that fails leaves that block as far as it got."""
    queue = list(names)
    while queue:
        name = queue.pop(0)
        try:
            block = sch.get_sblock(name)
        except Exception:  # inlined into a contraction's write-back meanwhile
            continue
        lanes = _lanes(sch, block, target)
        try:
            if is_contraction(sch, block):
                added = schedule_contraction(sch, block, lanes)
                if added is not None:
                    queue.extend(added)  # the padded copies of its inputs
                    continue
            if is_reduction(sch, block):
                schedule_reduction(sch, block, lanes)
            else:
                schedule_elementwise(sch, block, lanes)
        except Exception:  # see the module docstring: the kernel stays correct
            continue


def schedule_kernel(func: tirx.PrimFunc, target: tvm.target.Target,
                    vector_math: bool = True) -> tirx.PrimFunc | None:
    """`func` with the default CPU schedule (None when it cannot be scheduled at all: a kernel
    without a root block or without a block the rules apply to)."""
    try:
        return _schedule(func, target, vector_math)
    except Exception:
        return None


def _schedule(func: tirx.PrimFunc, target, vector_math: bool) -> tirx.PrimFunc | None:
    sch = s_tir.Schedule(func)
    try:
        inline_injective(sch, param_buffers(func))
    except Exception:
        sch = s_tir.Schedule(func)
    inlined = sch.mod["main"]
    names = [sch.get(b).name_hint for b in root_blocks(sch)
             if not is_library(sch, b) and is_leaf(sch, b)]
    if not names:
        return None
    has_library = any(is_library(sch, b) for b in root_blocks(sch))
    scheduled = None if has_library else _try_row_group(inlined, names, target)
    if scheduled is None:
        sch = s_tir.Schedule(inlined)
        _schedule_each(sch, names, target)
        scheduled = sch.mod["main"]
    return rewrite_vector_math(scheduled) if vector_math else scheduled


def is_scheduled(func: tirx.PrimFunc) -> bool:
    attrs = func.attrs
    return attrs is not None and any(key in attrs and int(attrs[key]) == 1
                                     for key in SCHEDULED_ATTRS)


@module_pass(opt_level=0, name="ApplyDefaultCPUSchedules")
class ApplyDefaultCPUSchedules:
    """Default CPU schedules for the kernels without one (see the module docstring).
    `unscheduled` lists the kernels left as written (no block the rules apply to).

    Args:
        vector_math: rewrite float32 exp/tanh/erf/sigmoid/pow into vectorisable polynomials
            (a few ulp from libm; False keeps the libm calls, one per element).
    """

    def __init__(self, vector_math: bool = True):
        self.vector_math = vector_math
        self.unscheduled: list[str] = []

    def transform_module(self, mod: tvm.IRModule, _ctx: PassContext) -> tvm.IRModule:
        target = tvm.target.Target.current(allow_none=True) or tvm.target.Target("llvm")
        updated = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc) or is_scheduled(func):
                continue
            scheduled = schedule_kernel(func, target, self.vector_math)
            if scheduled is None:
                self.unscheduled.append(gv.name_hint)
                continue
            updated[gv] = scheduled.with_attr("tirx.is_scheduled", True)
        for gv, func in updated.items():
            mod[gv] = func
        return mod
