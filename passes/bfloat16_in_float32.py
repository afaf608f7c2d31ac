"""Bfloat16InFloat32: the ops TVM cannot compute on bfloat16 data computed on its float32
values: those that order it (`sort`, `argsort`, `topk`, `argmax`, `argmin`) and those that
test it (`isnan`, `isinf`, `isfinite`).

TVM's CPU sorts (`tvm.contrib.sort`, which DispatchSortScan sends them to) do not order
bfloat16: measured on llvm, `topk(k=1)` of [-1.5, 0.25, -3, 2, 0.5, -0.1] gives -3 at index 1,
and `sort` returns a permutation that is not sorted; a `max(dim)` (imported as a `topk`) of
Hiera's query pooling sent its bfloat16 build's logits off by their own size. float16 sorts
right. `argmax` / `argmin` of bfloat16 do not compile (TVM's lowering of their reduction
fails a type check, plain `tvm.compile` too), nor do the finiteness tests ("Data type
bfloat16 not supported for finiteness ops": the tiny autoencoder's latents, quantised where
finite, under `--dtype bf16`). Every bfloat16 value is a float32 value, NaNs and infinities
included, so ordering or testing the widened data and rounding the values back gives the same
values, indices and flags exactly; the rewrite is the same on every target.
"""

from __future__ import annotations

import tvm
from tvm import relax

_ORDERS = ("relax.sort", "relax.argsort", "relax.topk", "relax.argmax", "relax.argmin")
_TESTS = ("relax.isnan", "relax.isinf", "relax.isfinite")
_LOW = "bfloat16"


@tvm.transform.module_pass(opt_level=0, name="Bfloat16InFloat32")
class Bfloat16InFloat32:
    """Order and test bfloat16 data by its float32 values (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mutator = _Widen(mod)
        for gv, func in list(mod.functions_items()):
            if isinstance(func, relax.Function):
                mutator.builder_.update_func(gv, mutator.visit_expr(func))
        return mutator.builder_.get() if mutator.changed else mod


@relax.expr_functor.mutator
class _Widen(relax.expr_functor.PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.changed = False

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name in _ORDERS + _TESTS):
            return call
        data = call.args[0]
        if not (isinstance(data.ty, relax.TensorType) and str(data.ty.dtype) == _LOW):
            return call
        self.changed = True
        bb, op, attrs = self.builder_, relax.op, call.attrs
        wide = bb.emit(op.astype(data, "float32"))
        if call.op.name in _TESTS:
            return relax.Call(call.op, [wide])
        if call.op.name == "relax.sort":
            return op.astype(bb.emit(op.sort(wide, int(attrs.axis), bool(attrs.descending))),
                             _LOW)
        if call.op.name in ("relax.argmax", "relax.argmin"):
            extreme = op.argmax if call.op.name == "relax.argmax" else op.argmin
            axis = None if attrs.axis is None else int(attrs.axis)
            return extreme(wide, axis, bool(attrs.keepdims))
        if call.op.name == "relax.argsort":
            return op.argsort(wide, int(attrs.axis), bool(attrs.descending), str(attrs.dtype))
        ret = str(attrs.ret_type)
        picked = bb.emit(op.topk(wide, int(attrs.k), int(attrs.axis), ret, bool(attrs.largest),
                                 str(attrs.dtype)))
        if ret == "indices":
            return picked
        if ret == "values":
            return op.astype(picked, _LOW)
        values = bb.emit(op.astype(relax.TupleGetItem(picked, 0), _LOW))
        return relax.Tuple([values, bb.emit(relax.TupleGetItem(picked, 1))])
