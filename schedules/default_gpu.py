"""Default GPU schedules for every kernel, training graphs included.

`dlight.ApplyDefaultSchedule` stops at the first rule that raises (GEMV asserts on a kernel
without spatial loops, Matmul on a convolution whose epilogue it cannot inline), and leaves
kernels no rule matches unscheduled, which CUDA code generation then rejects. Training graphs
have both kinds (the loss gradient, `take_backward` of an embedding). This pass tries dlight's
rules in order per kernel, moving on when one raises; a kernel no rule schedules is run on a
single GPU thread per top-level loop nest: correct for any kernel, slow, and reported in
`ApplyDefaultGPUSchedules.serial_kernels`.

A kernel that calls a vendor library (`tvm_ext.passes.DispatchLibraryKernels`) keeps its library
blocks in host code (cuBLAS launches its own kernels); each of its other loop nests (the
epilogue after a GEMM, its injective stages inlined into one loop nest) runs one GPU thread per
output element (`_library_kernel`).
"""

from __future__ import annotations

import warnings

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.transform import PassContext, module_pass

from tvm_ext.ir.pass_records import LIBRARY_ATTR, LIBRARY_BLOCK_PREFIX

from .inline_stages import inline_injective, param_buffers

_THREADS = 256


def _default_rules():
    from tvm.s_tir import dlight as dl

    return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(),
            dl.gpu.Fallback()]


def _lowers(func: tirx.PrimFunc) -> bool:
    """Whether a scheduled kernel survives the lowering step rules most often break (a
    cross-thread reduction whose combiner has no known reducer fails only there)."""
    try:
        s_tir.transform.LowerCrossThreadReduction()(tvm.IRModule({"main": func}))
    except Exception:
        return False
    return True


def _is_scheduled(func: tirx.PrimFunc) -> bool:
    return func.attrs is not None and "tirx.is_scheduled" in func.attrs and \
        int(func.attrs["tirx.is_scheduled"]) == 1


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
    """dlight's default GPU rules, robust to rules that fail (see the module docstring)."""

    def __init__(self, rules=None):
        self.rules = list(rules) if rules is not None else _default_rules()
        self.serial_kernels: list[str] = []

    def transform_module(self, mod: tvm.IRModule, _ctx: PassContext) -> tvm.IRModule:
        updated = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc) or _is_scheduled(func):
                continue
            target = func.attrs.get("target") if func.attrs is not None else None
            target = target or tvm.target.Target.current(allow_none=False)
            scheduled = None
            if func.attrs is not None and LIBRARY_ATTR in func.attrs:
                scheduled = _library_kernel(func)
            for rule in [] if scheduled is not None else self.rules:
                try:
                    space = rule.apply(func, target, False)
                except Exception:
                    continue
                if space is not None:
                    sch = space[0] if isinstance(space, list) else space
                    if _lowers(sch.mod["main"]):
                        scheduled = sch.mod["main"]
                        break
            if scheduled is None:
                scheduled = _single_thread(func)
                self.serial_kernels.append(gv.name_hint)
            updated[gv] = scheduled.with_attr("tirx.is_scheduled", True)
        for gv, func in updated.items():
            mod[gv] = func
        if self.serial_kernels:
            warnings.warn(f"no default GPU schedule fits {', '.join(self.serial_kernels)}: "
                          "they run on one GPU thread per loop nest (correct, slow); tune them "
                          "(--tune-trials) for speed", stacklevel=1)
        return mod
