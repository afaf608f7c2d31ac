"""Default GPU schedules for every kernel, training graphs included.

`dlight.ApplyDefaultSchedule` stops at the first rule that raises (GEMV asserts on a kernel
without spatial loops, Matmul on a convolution whose epilogue it cannot inline), takes a rule's
schedule however much serial work it leaves each thread (its scalar reduction runs a loss over
a whole batch on one thread), and leaves kernels no rule matches unscheduled, which CUDA code
generation rejects. This pass tries the rules in order per kernel, moving on when one raises,
and takes the first schedule that lowers and leaves no thread more than
`MAX_SERIAL_ITERATIONS` serial iterations (`thread_work.py`), else the one that leaves the
fewest. Its own rules beside dlight's: a reduction too long for one thread block in two
stages (`gpu_split_reduction.py`), and kernels written as plain loop nests (an embedding's
gradient) with one thread per iteration, accumulations as atomic adds (`gpu_loop_nests.py`).
A kernel that updates an argument in place (an optimizer step) is scheduled as if out of place
and checked before it is put back in place (`gpu_in_place.py`). A kernel no rule schedules
runs on one GPU thread per loop nest (correct, slow); every kernel left over the bound is
reported in `ApplyDefaultGPUSchedules.slow_kernels` and warned about.

A kernel that calls a vendor library (`tvm_ext.passes.DispatchLibraryKernels`) keeps its library
blocks in host code (cuBLAS launches its own kernels); each of its other loop nests (the
epilogue after a GEMM, its injective stages inlined into one loop nest) runs one GPU thread per
output element (`_library_kernel`).
"""

from __future__ import annotations

import math
import warnings

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.transform import PassContext, module_pass

from tvm_ext.errors import InternalError
from tvm_ext.ir.pass_records import LIBRARY_ATTR, LIBRARY_BLOCK_PREFIX

from .gpu_in_place import in_place_buffers, schedule_in_place
from .gpu_loop_nests import parallel_loop_nests
from .gpu_split_reduction import SplitReduction
from .inline_stages import inline_injective, param_buffers
from .thread_work import serial_iterations

_THREADS = 256
# A schedule that leaves a GPU thread more serial loop iterations than this is taken only when
# no rule gives one under it (a kernel that long on one thread takes milliseconds).
MAX_SERIAL_ITERATIONS = 4096


def _default_rules():
    from tvm.s_tir import dlight as dl

    return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(),
            SplitReduction(), dl.gpu.Fallback()]


def _lowers(func: tirx.PrimFunc) -> bool:
    """Whether a scheduled kernel survives the lowering step rules most often break (a
    cross-thread reduction whose combiner has no known reducer fails only there)."""
    try:
        s_tir.transform.LowerCrossThreadReduction()(tvm.IRModule({"main": func}))
    except Exception:
        return False
    return True


def _is_scheduled(func: tirx.PrimFunc) -> bool:
    """Marked scheduled, or written for the GPU already: TVM's GPU sort (`topi.cuda.argsort`,
    what DispatchSortScan makes of a mixture of experts' token sort) launches its own threads
    (`T.launch_thread`) without the mark."""
    if func.attrs is not None and "tirx.is_scheduled" in func.attrs and \
            int(func.attrs["tirx.is_scheduled"]) == 1:
        return True
    bound: list = []
    tvm_ffi.structural_walk(func.body, [
        (tirx.For, lambda loop: bound.append(loop.kind == tirx.ForKind.THREAD_BINDING)),
        (tirx.AttrStmt, lambda attr: bound.append(str(attr.attr_key) == "thread_extent"))])
    return any(bound)


def _single_thread(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Every top-level loop nest (or loop-less block) under one blockIdx x one threadIdx."""
    body = func.body
    if isinstance(body, s_tir.SBlockRealize) and body.block.name_hint != "root":
        # A kernel written as one opaque block (take_backward) is its own root: nest it under
        # a new root so that loops can be added above it.
        root = s_tir.SBlock([], [], [], "root", body)
        func = func.with_body(s_tir.SBlockRealize([], True, root))
    sch = s_tir.Schedule(func)
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        loops = sch.get_loops(block)
        anchor = loops[0] if loops else block
        thread = sch.add_unit_loop(anchor)
        bx = sch.add_unit_loop(thread)
        sch.bind(bx, "blockIdx.x")
        sch.bind(thread, "threadIdx.x")
    return sch.mod["main"]


def _library_kernel(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """The loop nests of a kernel with library calls (those stay in host code) over GPU
    threads, its injective stages first inlined into their consumers (a GEMM's bias and GELU
    epilogue: one GPU kernel, one pass over the product, not one per stage): the outer
    spatial loops fused and split over blocks of `_THREADS` threads, the rest (reduction
    loops) serial inside each thread."""
    sch = s_tir.Schedule(func)
    try:
        inline_injective(sch, param_buffers(func))
    except Exception:  # a refused inline leaves stages materialised: slower, not wrong
        sch = s_tir.Schedule(func)
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        if sch.get(block).name_hint.startswith(LIBRARY_BLOCK_PREFIX):
            continue
        loops = sch.get_loops(block)
        spatial = _outer_spatial_loops(sch, block, loops)
        if spatial:
            fused = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
            bx, tx = sch.split(fused, [None, _THREADS])
        else:
            tx = sch.add_unit_loop(loops[0] if loops else block)
            bx = sch.add_unit_loop(tx)
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
    return sch.mod["main"]


def _outer_spatial_loops(sch, block, loops) -> list:
    """The outer loops of `block` that feed only spatial block variables."""
    target = sch.get(block)
    realizes: list = []
    tvm_ffi.structural_walk(sch.mod["main"].body, [(s_tir.SBlockRealize, realizes.append)])
    realize = next(r for r in realizes if r.block.same_as(target))
    reduce_vars: set = set()
    for iv, value in zip(target.iter_vars, realize.iter_values, strict=True):
        if iv.iter_type != tirx.IterVar.DataPar:
            tvm_ffi.structural_walk(value, [(tvm.ir.expr.Var, reduce_vars.add)])
    out = []
    for loop in loops:
        if sch.get(loop).loop_var in reduce_vars:
            break
        out.append(loop)
    return out


@module_pass(opt_level=0, name="ApplyDefaultGPUSchedules")
class ApplyDefaultGPUSchedules:
    """Default GPU schedules for every kernel (see the module docstring)."""

    def __init__(self, rules=None):
        self.rules = list(rules) if rules is not None else _default_rules()
        # Kernels no schedule spreads over threads: (name, serial iterations per thread).
        self.slow_kernels: list[tuple[str, float]] = []

    def transform_module(self, mod: tvm.IRModule, _ctx: PassContext) -> tvm.IRModule:
        updated = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc) or _is_scheduled(func):
                continue
            target = func.attrs.get("target") if func.attrs is not None else None
            target = target or tvm.target.Target.current(allow_none=False)
            scheduled = self._schedule(gv.name_hint, func, target)
            work = serial_iterations(scheduled).iterations
            if work > MAX_SERIAL_ITERATIONS:
                self.slow_kernels.append((gv.name_hint, work))
            updated[gv] = scheduled.with_attr("tirx.is_scheduled", True)
        for gv, func in updated.items():
            mod[gv] = func
        if self.slow_kernels:
            names = ", ".join(f"{n} ({w:.3g})" for n, w in self.slow_kernels)
            warnings.warn(f"no default GPU schedule spreads these kernels over GPU threads; "
                          f"serial iterations per thread: {names}; tune them (--tune-trials) "
                          "for speed", stacklevel=1)
        return mod

    def _schedule(self, name: str, func: tirx.PrimFunc, target) -> tirx.PrimFunc:
        if func.attrs is not None and LIBRARY_ATTR in func.attrs:
            return _library_kernel(func)
        if in_place_buffers(func):  # TVM's bind refuses such a kernel as it stands
            scheduled = (schedule_in_place(func, lambda f: self._by_rules(f, target))
                         or schedule_in_place(func, _single_thread))
            if scheduled is None:
                raise InternalError(f"{name}: not even one thread per loop nest keeps this "
                                    "in-place kernel's reads before its writes")
            return scheduled
        return self._by_rules(func, target) or _single_thread(func)

    def _by_rules(self, func: tirx.PrimFunc, target) -> tirx.PrimFunc | None:
        """The first rule's schedule that lowers and leaves no thread more than
        `MAX_SERIAL_ITERATIONS` serial iterations, else the one that leaves the fewest."""
        best, best_work = None, math.inf
        for rule in [*self.rules, _LoopNests()]:
            try:
                space = rule.apply(func, target, False)
            except Exception:
                continue
            if space is None:
                continue
            sch = space[0] if isinstance(space, list) else space
            candidate = sch if isinstance(sch, tirx.PrimFunc) else sch.mod["main"]
            if not _lowers(candidate):
                continue
            work = serial_iterations(candidate).iterations
            if work <= MAX_SERIAL_ITERATIONS:
                return candidate
            if work < best_work:
                best, best_work = candidate, work
        return best


class _LoopNests:
    """`parallel_loop_nests` as a rule: kernels written as plain loop nests."""

    def apply(self, func: tirx.PrimFunc, target, _tunable: bool) -> tirx.PrimFunc | None:
        return parallel_loop_nests(func, target)
