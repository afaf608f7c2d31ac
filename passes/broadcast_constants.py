"""BroadcastConstants: kernel arguments that are constants repeating along some axes are passed
at their distinct extent, and single values become literals in the kernel.

Input: a module after fusion (`R.call_tir` of PrimFuncs, as `tvm_ext.pipeline.legalize_passes`
leaves it). For each constant argument of a `call_tir` in any Relax function, the axes along
which it repeats bit for bit are cut to extent 1 (`tvm_ext.ir.broadcast_constants`): the call
passes the smaller constant to a copy of its kernel that reads it at index 0 there, or, when
one value is left, drops the argument and reads the value as a literal. Results are bit for bit
those of the unmodified module; the device keeps (the VM loads every constant onto it) and the
planners see only the distinct values: a training step's seed gradient and a mask repeated over
the batch stop taking a swap budget's room. A kernel whose parameter cannot be rewritten (it
writes it, or passes a pointer to it on) keeps its full constant.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from tvm_ext.ir.broadcast_constants import (
    BroadcastError,
    broadcast_param,
    distinct_extent,
    is_literal,
)
from tvm_ext.ir.inplace_kernels import drop_unused


def _value(arg) -> np.ndarray | None:
    """The numpy value of a tensor constant, else None."""
    if isinstance(arg, tvm.ir.Constant) and isinstance(arg.ty, relax.TensorType):
        return arg.value.numpy()
    return None


@tvm.transform.module_pass(opt_level=0, name="BroadcastConstants")
class BroadcastConstants:
    """Pass constant kernel arguments at their distinct extent (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mutator = _Rewrite(mod)
        funcs = [(gv, f) for gv, f in mod.functions_items() if isinstance(f, relax.Function)]
        for gv, func in funcs:
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
        if not mutator.rewritten:
            return mod
        return drop_unused(mutator.builder_.get(), mutator.rewritten)


@relax.expr_functor.mutator
class _Rewrite(relax.expr_functor.PyExprMutator):
    """Rewrites `call_tir`s with repeating constant arguments, one kernel copy per kernel and
    set of rewritten arguments."""

    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.mod = mod
        self.kernels: dict = {}  # (kernel name, per argument: shape and bits or None) -> gv
        self.rewritten: list = []  # the kernels replaced at some call

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.call_tir"):
            return call
        gv, packed = call.args[0], call.args[1]
        args = list(packed.fields) if isinstance(packed, relax.Tuple) else [packed]
        small = {}
        for i, arg in enumerate(args):
            value = _value(arg)
            if value is None:
                continue
            distinct = distinct_extent(value)
            if distinct.shape != value.shape or is_literal(distinct):
                small[i] = distinct
        if not small:
            return call
        key = (gv.name_hint, tuple((i, v.shape, v.tobytes()) for i, v in sorted(small.items())))
        if key not in self.kernels:
            kernel = self.mod[gv]
            try:
                for i in sorted(small, reverse=True):  # literals drop their parameter
                    kernel = broadcast_param(kernel, i, small[i])
            except BroadcastError:
                self.kernels[key] = None
            else:
                self.kernels[key] = self.builder_.add_func(
                    kernel.without_attr("global_symbol"), f"{gv.name_hint}_bc")
        new_gv = self.kernels[key]
        if new_gv is None:
            return call
        self.rewritten.append(gv)
        # (relax.const narrows int64 to int32 unless told the dtype)
        new_args = [relax.const(small[i], str(small[i].dtype)) if i in small else a
                    for i, a in enumerate(args)
                    if not (i in small and is_literal(small[i]))]
        return relax.Call(call.op, [new_gv, relax.Tuple(new_args), *call.args[2:]], call.attrs,
                          call.ty_args)
