"""ReturnLossOnly: golden IR of an optimizer step after CallTIRRewrite, returning its loss alone;
an extern call that fills a new value writes the argument's buffer instead; an update a kernel
made outside the argument is refused (UpdateArgumentsInPlace did not run)."""

from __future__ import annotations

import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_ext.passes import ReturnLossOnly


@I.ir_module
class InPlace:
    @T.prim_func(private=True, s_tir=True)
    def total(g: T.Buffer((4,), "float32"), out: T.Buffer((), "float32")):
        with T.sblock("out"):
            out[()] = g[0] + g[1] + g[2] + g[3]

    @T.prim_func(private=True, s_tir=True)
    def sgd_inplace(p: T.Buffer((4,), "float32"), g: T.Buffer((4,), "float32")):
        for i in range(4):
            with T.sblock("out"):
                vi = T.axis.spatial(4, i)
                p[vi] = p[vi] - T.float32(0.5) * g[vi]

    @R.function
    def main(g: R.Tensor((4,), "float32"), p: R.Tensor((4,), "float32")):
        R.func_attr({"num_input": 1, "relax.force_pure": True, "tvm_ext.updates": [1]})
        cls = InPlace
        alloc = R.builtin.alloc_tensor(R.shape([]), R.dtype("float32"), 0, R.str("global"))
        cls.total(g, alloc)
        loss = alloc
        cls.sgd_inplace(p, g)
        new_p = p
        out = (loss, new_p)
        return out


@I.ir_module
class InPlaceExpected:
    @T.prim_func(private=True, s_tir=True)
    def total(g: T.Buffer((4,), "float32"), out: T.Buffer((), "float32")):
        with T.sblock("out"):
            out[()] = g[0] + g[1] + g[2] + g[3]

    @T.prim_func(private=True, s_tir=True)
    def sgd_inplace(p: T.Buffer((4,), "float32"), g: T.Buffer((4,), "float32")):
        for i in range(4):
            with T.sblock("out"):
                vi = T.axis.spatial(4, i)
                p[vi] = p[vi] - T.float32(0.5) * g[vi]

    @R.function
    def main(g: R.Tensor((4,), "float32"), p: R.Tensor((4,), "float32")) -> R.Tensor((), "float32"):
        R.func_attr({"num_input": 1, "relax.force_pure": True, "tvm_ext.updates": [1]})
        cls = InPlaceExpected
        alloc = R.builtin.alloc_tensor(R.shape([]), R.dtype("float32"), 0, R.str("global"))
        cls.total(g, alloc)
        loss = alloc
        cls.sgd_inplace(p, g)
        new_p = p
        out = (loss, new_p)  # noqa: F841 (left for dead-code elimination)
        return loss  # the new parameter is in p's buffer: only the loss goes back


@I.ir_module
class Gathered:
    @T.prim_func(private=True, s_tir=True)
    def total(g: T.Buffer((4,), "float32"), out: T.Buffer((), "float32")):
        with T.sblock("out"):
            out[()] = g[0] + g[1] + g[2] + g[3]

    @R.function
    def main(g: R.Tensor((4,), "float32"), p: R.Tensor((4,), "float32")):
        R.func_attr({"num_input": 1, "relax.force_pure": True, "tvm_ext.updates": [1]})
        cls = Gathered
        alloc = R.builtin.alloc_tensor(R.shape([]), R.dtype("float32"), 0, R.str("global"))
        cls.total(g, alloc)
        loss = alloc
        alloc1 = R.builtin.alloc_tensor(R.shape([4]), R.dtype("float32"), 0, R.str("global"))
        R.call_packed("test.gather", g, alloc1, ty_args=R.Tuple([]))
        new_p = alloc1
        out = (loss, new_p)
        return out


@I.ir_module
class GatheredExpected:
    @T.prim_func(private=True, s_tir=True)
    def total(g: T.Buffer((4,), "float32"), out: T.Buffer((), "float32")):
        with T.sblock("out"):
            out[()] = g[0] + g[1] + g[2] + g[3]

    @R.function
    def main(g: R.Tensor((4,), "float32"), p: R.Tensor((4,), "float32")) -> R.Tensor((), "float32"):
        R.func_attr({"num_input": 1, "relax.force_pure": True, "tvm_ext.updates": [1]})
        cls = GatheredExpected
        alloc = R.builtin.alloc_tensor(R.shape([]), R.dtype("float32"), 0, R.str("global"))
        cls.total(g, alloc)
        loss = alloc
        # The extern call (a collective gathering the pieces of p) fills p's buffer itself.
        R.call_packed("test.gather", g, p, ty_args=R.Tuple([]))
        new_p = p
        out = (loss, new_p)  # noqa: F841 (left for dead-code elimination)
        return loss


@I.ir_module
class NotInPlace:
    @T.prim_func(private=True, s_tir=True)
    def total(g: T.Buffer((4,), "float32"), out: T.Buffer((), "float32")):
        with T.sblock("out"):
            out[()] = g[0] + g[1] + g[2] + g[3]

    @T.prim_func(private=True, s_tir=True)
    def sgd(p: T.Buffer((4,), "float32"), g: T.Buffer((4,), "float32"),
            out: T.Buffer((4,), "float32")):
        for i in range(4):
            with T.sblock("out"):
                vi = T.axis.spatial(4, i)
                out[vi] = p[vi] - T.float32(0.5) * g[vi]

    @R.function
    def main(g: R.Tensor((4,), "float32"), p: R.Tensor((4,), "float32")):
        R.func_attr({"num_input": 1, "relax.force_pure": True, "tvm_ext.updates": [1]})
        cls = NotInPlace
        alloc = R.builtin.alloc_tensor(R.shape([]), R.dtype("float32"), 0, R.str("global"))
        cls.total(g, alloc)
        loss = alloc
        alloc1 = R.builtin.alloc_tensor(R.shape([4]), R.dtype("float32"), 0, R.str("global"))
        cls.sgd(p, g, alloc1)
        new_p = alloc1
        out = (loss, new_p)
        return out


@pytest.mark.parametrize("before, expected", [
    (InPlace, InPlaceExpected),
    (Gathered, GatheredExpected),
    (NotInPlace, RuntimeError),  # an InternalError, through TVM
], ids=["in_place", "gathered", "not_in_place"])
def test_golden_return_loss_only(before, expected):
    if isinstance(expected, type) and issubclass(expected, Exception):
        with pytest.raises(expected, match="output 1 should overwrite p in place; run "
                                           "UpdateArgumentsInPlace before dataflow lowering"):
            ReturnLossOnly()(before)
        return
    after = ReturnLossOnly()(before)
    tvm.ir.assert_structural_equal(after, expected)
    tvm.ir.assert_structural_equal(ReturnLossOnly()(after), after)  # idempotent
