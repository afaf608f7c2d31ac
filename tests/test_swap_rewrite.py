"""SwapOffload's emitters (passes/swap_rewrite/), each on a tiny module and a plan made by hand:
golden Before / Expected IR (the function a plan runs), the plan checked by `validate` and its
swapped module run against the unswapped one. Whole ops and the copies between them are also in
tests/test_swap_offload.py (`test_golden_ir_of_a_hand_plan`).

Chunked: `y = x + 1` over (2, 256) float32 (2 KiB each), x on the host and y returned from it,
run in 2 chunks of one row along dim 0 with two buffers per cut tensor (4 x 1 KiB = the 4 KiB
budget): both chunks of x are copied in before the first chunk computes, each chunk of y leaves
as soon as its kernel has run.

Recompute: `y = x + 1; z = 2y; u = 2z; w = y + u`, 256 bytes each, x pinned: y's window is
taken by u at position 2, so y is made again at position 3 (`add_one` called twice), into z's
old window.

In place: an optimizer step `(loss, p - 0.5 g)` whose new `p` overwrites its argument: the
update kernel's in-place form writes p's own buffer; the loss comes back from the host in a
tensor of its own.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_ext import driver, pipeline
from tvm_ext.ir.graph_builder import build_graph
from tvm_ext.ir.pass_records import argument_updates
from tvm_ext.ir.targets import vm_devices
from tvm_ext.ir.time_splits import annotate_time_splits
from tvm_ext.passes import SwapOffload
from tvm_ext.swap import Residency, SwapIn, SwapOut, SwapPlan, SwapProblem, simulate, validate
from tvm_ext.swap.placement import argument_devices
from tvm_ext.swap.plan import Split

LLVM = tvm.target.Target("llvm")


@I.ir_module
class RowsBefore:
    @T.prim_func(private=True, s_tir=True)
    def add_one(x: T.Buffer((2, 256), "float32"), y: T.Buffer((2, 256), "float32")):
        for i, j in T.grid(2, 256):
            with T.sblock("y"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj] + T.float32(1)

    @R.function
    def main(x: R.Tensor((2, 256), "float32")):
        R.func_attr({"num_input": 1})
        cls = RowsBefore
        with R.dataflow():
            y = R.call_tir(cls.add_one, (x,), out_ty=R.Tensor((2, 256), "float32"))
            R.output(y)
        return y


def _rows_plan() -> SwapPlan:
    return SwapPlan(
        planner="hand", budget=4096, schedule=[0], pools=[4096], size_classes=[], pinned=[],
        host_start=[0], outputs_on_host=[1], residencies=[],
        swap_outs=[SwapOut(1, 0, 2048)], swap_ins=[SwapIn(0, -1, 0, 2048, -1)],
        predicted_time=0.0, predicted_peak=4096,
        splits=[Split(position=0, op=0, dim=0, chunks=2, pool=0, offset=0, nbytes=4096,
                      cut_inputs=[0], whole_inputs=[], cut_outputs=[1], buffers=2)])


def _rows_expected(plan: SwapPlan):
    @I.ir_module
    class Expected:
        I.module_global_infos({"vdevice": [I.vdevice("llvm", 0, "global"),
                                           I.vdevice("llvm", 1, "global")]})

        @T.prim_func(private=True, s_tir=True)
        def add_one(x: T.Buffer((2, 256), "float32"), y: T.Buffer((2, 256), "float32")):
            for i, j in T.grid(2, 256):
                with T.sblock("y"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = x[vi, vj] + T.float32(1)

        # One row: the kernel's local form for a chunk of dim 0.
        @T.prim_func(s_tir=True)
        def add_one_chunk2_d0(x: T.Buffer((1, 256), "float32"),
                              y: T.Buffer((1, 256), "float32")):
            for i, j in T.grid(1, 256):
                with T.sblock("y"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = x[vi, vj] + T.float32(1)

        @R.function
        def main(x: R.Tensor((2, 256), "float32", vdevice="llvm:1")) -> R.Tensor((2, 256),
                                                                            "float32"):
            R.func_attr({"num_input": 1, "relax.force_pure": True,
                         "tvm_ext.swap_arguments": ["host"],
                         "tvm_ext.swap_plan": json.dumps(plan.summary())})
            cls = Expected
            pool = R.memory.alloc_storage(R.shape([4096]), 0, "global", "uint8")
            # two chunk buffers of x, then two of y, 1 KiB each
            x0 = R.memory.ensure_zero_offset(
                R.memory.alloc_tensor(pool, 0, R.shape([1, 256]), "float32"))
            x1 = R.memory.ensure_zero_offset(
                R.memory.alloc_tensor(pool, 1024, R.shape([1, 256]), "float32"))
            y0 = R.memory.ensure_zero_offset(
                R.memory.alloc_tensor(pool, 2048, R.shape([1, 256]), "float32"))
            y1 = R.memory.ensure_zero_offset(
                R.memory.alloc_tensor(pool, 3072, R.shape([1, 256]), "float32"))
            # y is returned from the host: a host tensor of its own
            y_host = R.call_builtin_with_ctx(
                "tvm_ext.swap.host_empty", (R.shape([2, 256]), R.dtype("float32"), 1, 0),
                ty_args=(R.Tensor((2, 256), "float32"),))
            # (host, buffer, stream, axis, chunk, into the device?, name)
            R.call_packed("tvm_ext.swap.copy_chunk_async", x, x0, 1, 0, 0, 1, R.str("x"),
                          ty_args=R.Tuple([]))
            R.call_packed("tvm_ext.swap.copy_chunk_async", x, x1, 1, 0, 1, 1, R.str("x"),
                          ty_args=R.Tuple([]))
            R.call_packed("tvm_ext.swap.wait", x0, 1, ty_args=R.Tuple([]))
            cls.add_one_chunk2_d0(x0, y0)
            R.call_packed("tvm_ext.swap.copy_chunk_async", y_host, y0, 0, 0, 0, 0, R.str("y"),
                          ty_args=R.Tuple([]))
            R.call_packed("tvm_ext.swap.wait", x1, 1, ty_args=R.Tuple([]))
            cls.add_one_chunk2_d0(x1, y1)
            R.call_packed("tvm_ext.swap.copy_chunk_async", y_host, y1, 0, 0, 1, 0, R.str("y"),
                          ty_args=R.Tuple([]))
            R.call_packed("tvm_ext.swap.wait_all", -1, ty_args=R.Tuple([]))
            return y_host

    return Expected


@I.ir_module
class ChainBefore:
    @T.prim_func(private=True, s_tir=True)
    def add_one(x: T.Buffer((64,), "float32"), y: T.Buffer((64,), "float32")):
        for i in range(64):
            with T.sblock("y"):
                vi = T.axis.spatial(64, i)
                y[vi] = x[vi] + T.float32(1)

    @T.prim_func(private=True, s_tir=True)
    def double(x: T.Buffer((64,), "float32"), y: T.Buffer((64,), "float32")):
        for i in range(64):
            with T.sblock("y"):
                vi = T.axis.spatial(64, i)
                y[vi] = x[vi] * T.float32(2)

    @T.prim_func(private=True, s_tir=True)
    def add(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32"),
            c: T.Buffer((64,), "float32")):
        for i in range(64):
            with T.sblock("c"):
                vi = T.axis.spatial(64, i)
                c[vi] = a[vi] + b[vi]

    @R.function
    def main(x: R.Tensor((64,), "float32")):
        R.func_attr({"num_input": 1})
        cls = ChainBefore
        with R.dataflow():
            y = R.call_tir(cls.add_one, (x,), out_ty=R.Tensor((64,), "float32"))
            z = R.call_tir(cls.double, (y,), out_ty=R.Tensor((64,), "float32"))
            u = R.call_tir(cls.double, (z,), out_ty=R.Tensor((64,), "float32"))
            w = R.call_tir(cls.add, (y, u), out_ty=R.Tensor((64,), "float32"))
            R.output(w)
        return w


def _chain_plan() -> SwapPlan:
    """Tensors x 0, y 1, z 2, u 3, w 4; ops y 0, z 1, u 2, w 3."""
    return SwapPlan(
        planner="hand", budget=1024, schedule=[0, 1, 2, 0, 3], pools=[768], size_classes=[],
        pinned=[0], host_start=[], outputs_on_host=[],
        residencies=[Residency(1, 0, 0, 256, 0, 1, "produced"),
                     Residency(2, 0, 256, 256, 1, 2, "produced"),
                     Residency(3, 0, 0, 256, 2, 4, "produced"),
                     Residency(1, 0, 256, 256, 3, 4, "produced"),  # y made again
                     Residency(4, 0, 512, 256, 4, 4, "produced")],
        swap_outs=[], swap_ins=[], predicted_time=0.0, predicted_peak=1024)


def _chain_expected(plan: SwapPlan):
    @I.ir_module
    class Expected:
        I.module_global_infos({"vdevice": [I.vdevice("llvm", 0, "global"),
                                           I.vdevice("llvm", 1, "global")]})

        @T.prim_func(private=True, s_tir=True)
        def add_one(x: T.Buffer((64,), "float32"), y: T.Buffer((64,), "float32")):
            for i in range(64):
                with T.sblock("y"):
                    vi = T.axis.spatial(64, i)
                    y[vi] = x[vi] + T.float32(1)

        @T.prim_func(private=True, s_tir=True)
        def double(x: T.Buffer((64,), "float32"), y: T.Buffer((64,), "float32")):
            for i in range(64):
                with T.sblock("y"):
                    vi = T.axis.spatial(64, i)
                    y[vi] = x[vi] * T.float32(2)

        @T.prim_func(private=True, s_tir=True)
        def add(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32"),
                c: T.Buffer((64,), "float32")):
            for i in range(64):
                with T.sblock("c"):
                    vi = T.axis.spatial(64, i)
                    c[vi] = a[vi] + b[vi]

        @R.function
        def main(x: R.Tensor((64,), "float32", vdevice="llvm:0")) -> R.Tensor((64,), "float32"):
            R.func_attr({"num_input": 1, "relax.force_pure": True,
                         "tvm_ext.swap_arguments": ["device"],
                         "tvm_ext.swap_plan": json.dumps(plan.summary())})
            cls = Expected
            pool = R.memory.alloc_storage(R.shape([768]), 0, "global", "uint8")
            y = R.memory.ensure_zero_offset(
                R.memory.alloc_tensor(pool, 0, R.shape([64]), "float32"))
            cls.add_one(x, y)
            z = R.memory.ensure_zero_offset(
                R.memory.alloc_tensor(pool, 256, R.shape([64]), "float32"))
            cls.double(y, z)
            u = R.memory.ensure_zero_offset(
                R.memory.alloc_tensor(pool, 0, R.shape([64]), "float32"))
            cls.double(z, u)
            # y again, from x, into z's window
            y2 = R.memory.ensure_zero_offset(
                R.memory.alloc_tensor(pool, 256, R.shape([64]), "float32"))
            cls.add_one(x, y2)
            w = R.memory.ensure_zero_offset(
                R.memory.alloc_tensor(pool, 512, R.shape([64]), "float32"))
            cls.add(y2, u, w)
            R.call_packed("tvm_ext.swap.wait_all", -1, ty_args=R.Tuple([]))
            return w

    return Expected


@I.ir_module
class StepBefore:
    @T.prim_func(private=True, s_tir=True)
    def total(g: T.Buffer((64,), "float32"), out: T.Buffer((), "float32")):
        with T.sblock("out"):
            out[()] = g[0] + g[63]

    @T.prim_func(private=True, s_tir=True)
    def sgd(p: T.Buffer((64,), "float32"), g: T.Buffer((64,), "float32"),
            out: T.Buffer((64,), "float32")):
        for i in range(64):
            with T.sblock("out"):
                vi = T.axis.spatial(64, i)
                out[vi] = p[vi] - T.float32(0.5) * g[vi]

    @R.function
    def main(g: R.Tensor((64,), "float32"), p: R.Tensor((64,), "float32")):
        R.func_attr({"num_input": 1, "tvm_ext.updates": [1]})
        cls = StepBefore
        with R.dataflow():
            loss = R.call_tir(cls.total, (g,), out_ty=R.Tensor((), "float32"))
            new_p = R.call_tir(cls.sgd, (p, g), out_ty=R.Tensor((64,), "float32"))
            out = (loss, new_p)
            R.output(out)
        return out


def _step_plan() -> SwapPlan:
    """Tensors g 0, p 1, loss 2, new p 3 (p's bytes); both arguments stay on the device."""
    return SwapPlan(
        planner="hand", budget=768, schedule=[0, 1], pools=[256], size_classes=[],
        pinned=[0, 1], host_start=[], outputs_on_host=[2],
        residencies=[Residency(2, 0, 0, 256, 0, 1, "produced")],
        swap_outs=[SwapOut(2, 1, 256)], swap_ins=[], predicted_time=0.0, predicted_peak=768)


def _step_expected(plan: SwapPlan):
    @I.ir_module
    class Expected:
        I.module_global_infos({"vdevice": [I.vdevice("llvm", 0, "global"),
                                           I.vdevice("llvm", 1, "global")]})

        @T.prim_func(private=True, s_tir=True)
        def total(g: T.Buffer((64,), "float32"), out: T.Buffer((), "float32")):
            with T.sblock("out"):
                out[()] = g[0] + g[63]

        # `sgd` is gone: its in-place form stores the new value into p
        @T.prim_func(private=True, s_tir=True)
        def sgd_inplace(p: T.Buffer((64,), "float32"), g: T.Buffer((64,), "float32")):
            for i in range(64):
                with T.sblock("out"):
                    vi = T.axis.spatial(64, i)
                    T.reads(p[vi], g[vi])
                    T.writes(p[vi])
                    p[vi] = p[vi] - T.float32(0.5) * g[vi]

        @R.function
        def main(g: R.Tensor((64,), "float32", vdevice="llvm:0"),
                 p: R.Tensor((64,), "float32", vdevice="llvm:0")
                 ) -> R.Tuple(R.Tensor((), "float32"),
                              R.Tensor((64,), "float32", vdevice="llvm:0")):
            R.func_attr({"num_input": 1, "relax.force_pure": True, "tvm_ext.updates": [1],
                         "tvm_ext.swap_arguments": ["device", "device"],
                         "tvm_ext.swap_plan": json.dumps(plan.summary())})
            cls = Expected
            pool = R.memory.alloc_storage(R.shape([256]), 0, "global", "uint8")
            loss = R.memory.ensure_zero_offset(
                R.memory.alloc_tensor(pool, 0, R.shape([]), "float32"))
            cls.total(g, loss)
            cls.sgd_inplace(p, g)
            loss_host = R.call_builtin_with_ctx(
                "tvm_ext.swap.host_empty", (R.shape([]), R.dtype("float32"), 1, 0),
                ty_args=(R.Tensor((), "float32"),))
            R.call_packed("tvm_ext.swap.copy_async", loss, loss_host, 0, R.str("loss"),
                          ty_args=R.Tuple([]))
            R.call_packed("tvm_ext.swap.wait_all", -1, ty_args=R.Tuple([]))
            return (loss_host, p)

    return Expected


CASES = {"chunked": (RowsBefore, _rows_plan, _rows_expected),
         "recompute": (ChainBefore, _chain_plan, _chain_expected),
         "in_place": (StepBefore, _step_plan, _step_expected)}


def _checked(case: str) -> tuple:
    """(Before, its graph, the plan validated against its problem, predicted time filled)."""
    before, make_plan, _ = CASES[case]
    graph = annotate_time_splits(before, build_graph(before))
    plan = make_plan()
    problem = SwapProblem.from_graph(graph, plan.budget, "cpu")
    plan.predicted_time = simulate(problem, plan).makespan
    validate(problem, plan)
    return before, graph, plan


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_ir_of_each_emitter(case):
    before, _, plan = _checked(case)
    with LLVM:
        after = SwapOffload(plan=plan)(before)
    relax.analysis.well_formed(after)  # raises on the first violation
    _assert_modules_equal(after, CASES[case][2](plan))
    with LLVM:
        tvm.ir.assert_structural_equal(SwapOffload(plan=plan)(after), after)  # idempotent


def _assert_modules_equal(after: tvm.IRModule, expected: tvm.IRModule) -> None:
    """Function by function: a chunk kernel shares its loop variables with the kernel it was
    cut from, which a comparison of whole modules reads as a variable defined twice."""
    names = sorted(gv.name_hint for gv in after.functions)
    assert names == sorted(gv.name_hint for gv in expected.functions)
    for name in names:
        # The kernels a function calls are free in it: compared by name, in call order.
        assert _callees(after[name]) == _callees(expected[name]), name
        tvm.ir.assert_structural_equal(after[name], expected[name], map_free_vars=True)
    tvm.ir.assert_structural_equal(after.global_infos, expected.global_infos)


def _callees(func) -> list[str]:
    names: list[str] = []
    tvm_ffi.structural_walk(func, [(tvm.ir.GlobalVar, lambda gv: names.append(gv.name_hint))])
    return names


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_emitters_module_runs_as_the_unswapped_one(case):
    """Bit for bit the unswapped build's outputs (an updated argument in its own buffer, the
    step returning its loss alone), within the budget as measured."""
    before, graph, plan = _checked(case)
    rng = np.random.default_rng(0)
    args = [rng.standard_normal([int(d) for d in p.ty.shape]).astype("float32")
            for p in before["main"].params]
    device, host = vm_devices(LLVM)
    where = argument_devices(graph, plan)
    lower = tvm.transform.Sequential([*pipeline.dataflow_lower_passes(LLVM),
                                      *pipeline.finalize_passes(LLVM)])
    with LLVM:
        swapped = tvm.compile(SwapOffload(plan=plan)(before), LLVM, relax_pipeline=lower)
        plain = tvm.compile(before, LLVM)
    out = driver.run(swapped, args, device, repeat=0, host=host, arg_devices=where)
    expected = driver.run(plain, args, tvm.cpu(0), repeat=0).outputs
    updates = argument_updates(before["main"])
    driver.compare(out.outputs, expected[:len(expected) - len(updates)],
                   tolerances=[(0.0, 0.0)])
    assert out.peak_bytes <= plan.budget
    if updates:  # the new values are in the arguments' buffers
        vm = relax.VirtualMachine(swapped, [device, host])
        placed = [tvm.runtime.tensor(a, [device, host][d]) for a, d in zip(args, where,
                                                                            strict=True)]
        vm["main"](*placed)
        for position, arg in updates.items():
            np.testing.assert_array_equal(placed[arg].numpy(), expected[position])
