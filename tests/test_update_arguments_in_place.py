"""UpdateArgumentsInPlace and ReturnLossOnly (passes/), and the in-place kernel rewrite they use
(tvm_ext/ir/inplace_kernels.py); ReturnLossOnly's golden IR is in test_return_loss_only.py."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, te, tirx
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_ext import driver, pipeline
from tvm_ext.ir.inplace_kernels import InPlaceError, inplace_kernel, inplace_obstacle
from tvm_ext.ir.pass_records import UPDATES_ATTR
from tvm_ext.models.optimizer import Optimizer, make_optimizer_step
from tvm_ext.passes import ReturnLossOnly, UpdateArgumentsInPlace


def _func(stages):
    """A PrimFunc of TE stages over x (8,): `stages(x) -> outputs`."""
    x = te.placeholder((8,), "float32", "x")
    return te.create_prim_func([x, *stages(x)])


def _obstacle(func, out: int = 1):
    return inplace_obstacle(func, func.params[0], func.params[out])


def test_elementwise_output_may_overwrite_its_input():
    func = _func(lambda x: [te.compute((8,), lambda i: x[i] * 2.0, name="y")])
    assert _obstacle(func) is None
    kernel = inplace_kernel(func, 1, {0: 0})
    assert len(kernel.params) == 1
    lib = tvm.compile(tvm.IRModule({"main": kernel}), "llvm")
    x = tvm.runtime.tensor(np.arange(8, dtype="float32"))
    lib["main"](x)
    np.testing.assert_array_equal(x.numpy(), np.arange(8, dtype="float32") * 2)


def test_unread_argument_becomes_the_destination():
    func = _func(lambda x: [te.compute((8,), lambda i: x[i] + 1.0, name="y")])
    kernel = inplace_kernel(func, 1, {0: None})
    assert [p.name for p in kernel.params] == ["x", "y"]


def _read_after_write(x):
    y = te.compute((8,), lambda i: x[i] * 2.0, name="y")
    return [y, te.compute((8,), lambda i: x[i] + y[i], name="z")]


def _shifted(x):
    return [te.compute((8,), lambda i: x[(i + 1) % 8], name="y")]


def _reduction(x):
    k = te.reduce_axis((0, 8), "k")
    return [te.compute((8,), lambda i: te.sum(x[k] * x[i], axis=k), name="y")]


@pytest.mark.parametrize("stages, reason", [
    (_read_after_write, "after it is overwritten"),
    (_shifted, "own position"),
    (_reduction, "own position"),
])
def test_unsafe_overwrites_are_refused(stages, reason):
    func = _func(stages)
    problem = _obstacle(func)
    assert problem is not None and reason in problem
    with pytest.raises(InPlaceError):
        inplace_kernel(func, 1, {0: 0})


@pytest.fixture(scope="module")
def fused_step(llvm):
    from tvm_ext.models import get_model

    step = make_optimizer_step(get_model("mlp", "tiny", training=True), Optimizer("adam"))
    return step, pipeline.fuse(step.mod, driver.resolve_target("llvm"))


def test_updates_become_call_tir_inplace(fused_step):
    step, fused = fused_step
    mod = UpdateArgumentsInPlace()(fused)
    main = mod["main"]
    values = {b.var: b.value for block in main.body.blocks for b in block.bindings}
    inplace = [v for v in values.values() if isinstance(v, relax.Call)
               and v.op.same_as(tvm.ir.Op.get("relax.call_tir_inplace"))]
    n_trained = len(step.config["gradients"])
    assert len(inplace) == n_trained + 1  # one per parameter, and the step count
    params = set(main.params)
    for call in inplace:
        args = call.args[1].fields
        assert all(args[i] in params for i in call.attrs.inplace_indices if i >= 0)
    kernels = {gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}
    assert all("_inplace" in k for k in kernels if "update" in k)  # the originals are gone
    tvm.ir.assert_structural_equal(UpdateArgumentsInPlace()(mod), mod)  # idempotent


def test_reading_an_argument_after_its_update_is_an_error():
    """The pass never reorders: a function that reads the old value after the update is
    refused, not silently wrong."""
    bb = relax.BlockBuilder()
    p = relax.Var("p", relax.TensorType((4,), "float32"))
    with bb.function("main", [p]):
        with bb.dataflow():
            new = bb.emit_te(lambda a: te.compute((4,), lambda i: a[i] - 1.0, name="upd"), p)
            late = bb.emit_te(lambda a: te.compute((), lambda: a[0], name="read"), p)
            out = bb.emit_output(relax.Tuple([late, new]))
        bb.emit_func_output(out)
    mod = bb.get()
    mod["main"] = mod["main"].with_attr(UPDATES_ATTR, [0])
    with pytest.raises(RuntimeError, match="after"):  # an InternalError, through TVM
        UpdateArgumentsInPlace()(mod)


def test_compiled_step_returns_the_loss_alone(fused_step, llvm):
    step, _ = fused_step
    ex = driver.build(step, driver.resolve_target("llvm"))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    args = [tvm.runtime.tensor(a) for a in step.random_arguments(0)]
    before = args[step.num_input].numpy()
    loss = vm["main"](*args)
    assert isinstance(loss, tvm.runtime.Tensor) and loss.shape == ()
    assert not np.array_equal(args[step.num_input].numpy(), before)  # updated in place


def test_return_loss_only_refuses_a_step_not_made_in_place(fused_step):
    _, fused = fused_step
    target = driver.resolve_target("llvm")
    with target:
        lowered = tvm.transform.Sequential(pipeline.dataflow_lower_passes(target)[:-1])(fused)
    with pytest.raises(RuntimeError, match="UpdateArgumentsInPlace"):
        ReturnLossOnly()(lowered)


@I.ir_module
class SgdStep:
    """A step that returns its loss and the new value of its argument `p` (`tvm_ext.updates`:
    output 1 overwrites argument 1)."""

    @T.prim_func(private=True, s_tir=True)
    def total(g: T.Buffer((4,), "float32"), out: T.Buffer((), "float32")):
        for k in range(4):
            with T.sblock("out"):
                vk = T.axis.reduce(4, k)
                with T.init():
                    out[()] = T.float32(0)
                out[()] = out[()] + g[vk]

    @T.prim_func(private=True, s_tir=True)
    def sgd(p: T.Buffer((4,), "float32"), g: T.Buffer((4,), "float32"),
            out: T.Buffer((4,), "float32")):
        for i in range(4):
            with T.sblock("out"):
                vi = T.axis.spatial(4, i)
                out[vi] = p[vi] - T.float32(0.5) * g[vi]

    @R.function
    def main(g: R.Tensor((4,), "float32"), p: R.Tensor((4,), "float32")):
        R.func_attr({"num_input": 1, "tvm_ext.updates": [1]})
        cls = SgdStep
        with R.dataflow():
            loss = R.call_tir(cls.total, (g,), out_ty=R.Tensor((), "float32"))
            new_p = R.call_tir(cls.sgd, (p, g), out_ty=R.Tensor((4,), "float32"))
            out = (loss, new_p)
            R.output(out)
        return out


@I.ir_module
class SgdStepInPlace:
    @T.prim_func(private=True, s_tir=True)
    def total(g: T.Buffer((4,), "float32"), out: T.Buffer((), "float32")):
        for k in range(4):
            with T.sblock("out"):
                vk = T.axis.reduce(4, k)
                with T.init():
                    out[()] = T.float32(0)
                out[()] = out[()] + g[vk]

    # The update stores into `p`, read at the element it writes: its output parameter is gone.
    @T.prim_func(private=True, s_tir=True)
    def sgd_inplace(p: T.Buffer((4,), "float32"), g: T.Buffer((4,), "float32")):
        for i in range(4):
            with T.sblock("out"):
                vi = T.axis.spatial(4, i)
                T.reads(p[vi], g[vi])
                T.writes(p[vi])
                p[vi] = p[vi] - T.float32(0.5) * g[vi]

    @R.function
    def main(g: R.Tensor((4,), "float32"), p: R.Tensor((4,), "float32")):
        R.func_attr({"num_input": 1, "tvm_ext.updates": [1]})
        cls = SgdStepInPlace
        with R.dataflow():
            loss = R.call_tir(cls.total, (g,), out_ty=R.Tensor((), "float32"))
            new_p = R.call_tir_inplace(cls.sgd_inplace, (p, g), out_ty=R.Tensor((4,), "float32"),
                                       inplace_indices=[0])
            out = (loss, new_p)
            R.output(out)
        return out


@I.ir_module
class ReadAfterUpdate:
    """Reads `p` after the update that overwrites it: refused, never reordered."""

    @T.prim_func(private=True, s_tir=True)
    def sgd(p: T.Buffer((4,), "float32"), g: T.Buffer((4,), "float32"),
            out: T.Buffer((4,), "float32")):
        for i in range(4):
            with T.sblock("out"):
                vi = T.axis.spatial(4, i)
                out[vi] = p[vi] - T.float32(0.5) * g[vi]

    @T.prim_func(private=True, s_tir=True)
    def total(g: T.Buffer((4,), "float32"), out: T.Buffer((), "float32")):
        for k in range(4):
            with T.sblock("out"):
                vk = T.axis.reduce(4, k)
                with T.init():
                    out[()] = T.float32(0)
                out[()] = out[()] + g[vk]

    @R.function
    def main(g: R.Tensor((4,), "float32"), p: R.Tensor((4,), "float32")):
        R.func_attr({"num_input": 1, "tvm_ext.updates": [1]})
        cls = ReadAfterUpdate
        with R.dataflow():
            new_p = R.call_tir(cls.sgd, (p, g), out_ty=R.Tensor((4,), "float32"))
            loss = R.call_tir(cls.total, (p,), out_ty=R.Tensor((), "float32"))
            out = (loss, new_p)
            R.output(out)
        return out


@pytest.mark.parametrize("before, expected", [
    (SgdStep, SgdStepInPlace),
    (ReadAfterUpdate, RuntimeError),  # an InternalError, through TVM
], ids=["update", "read_after_update"])
def test_golden_update_arguments_in_place(before, expected):
    if isinstance(expected, type) and issubclass(expected, Exception):
        with pytest.raises(expected, match="reads p after new_p overwrote it in place"):
            UpdateArgumentsInPlace()(before)
        return
    after = UpdateArgumentsInPlace()(before)
    tvm.ir.assert_structural_equal(after, expected)
    tvm.ir.assert_structural_equal(UpdateArgumentsInPlace()(after), after)  # idempotent
