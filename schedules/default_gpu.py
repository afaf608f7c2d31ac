"""Default GPU schedules for every kernel, training graphs included.

`dlight.ApplyDefaultSchedule` stops at the first rule that raises (GEMV asserts on a kernel
without spatial loops, Matmul on a convolution whose epilogue it cannot inline), and leaves
kernels no rule matches unscheduled, which CUDA code generation then rejects. Training graphs
have both kinds (the loss gradient, `take_backward` of an embedding). This pass tries dlight's
rules in order per kernel, moving on when one raises; a kernel no rule schedules is run on a
single GPU thread per top-level loop nest: correct for any kernel, slow, and reported in
`ApplyDefaultGPUSchedules.serial_kernels`.
"""

from __future__ import annotations

import warnings

import tvm
from tvm import s_tir, tirx
from tvm.ir.transform import PassContext, module_pass


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
            for rule in self.rules:
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
