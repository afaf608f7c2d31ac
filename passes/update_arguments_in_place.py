"""UpdateArgumentsInPlace: the kernels that compute new values of arguments (an optimizer
step's parameters and state) write them into the arguments' own buffers.

Input: a function that returns, after its loss, new values of some of its arguments and says
which in the attribute `tvm_ext.updates` (`tvm_ext.models.optimizer`), after the planning
phases (fusion, PartitionOperators, SwapOffload) and before the kernels are scheduled. Each
such value made by a kernel (`R.call_tir`) becomes an output of `R.call_tir_inplace` over the
argument: the kernel is rewritten to store it there (`tvm_ext.ir.inplace_kernels`, which proves
that no element is read after it is overwritten, or refuses); an argument the kernel does not
read is passed to it as the buffer to write. The function must not read an argument after the
call that overwrites it (the optimizer step reads each parameter last in its update; a
reordering would be an error here, never a silent wrong value).

Values made otherwise (a collective gathering a parameter's pieces, after partitioning) keep
their own output until `ReturnLossOnly` (after `CallTIRRewrite`) hands the argument's buffer
to the call that makes them. A function SwapOffload rewrote calls its in-place kernels itself.
"""

from __future__ import annotations

import tvm
from tvm import relax

from tvm_ext.errors import InternalError
from tvm_ext.ir.inplace_kernels import InPlaceError, drop_unused, inplace_kernel
from tvm_ext.ir.pass_records import SWAP_PLAN_ATTR, argument_writers, has_record
from tvm_ext.ir.relax_exprs import op_name, viewed


def _bindings(func: relax.Function) -> dict:
    return {b.var: b.value for block in func.body.blocks for b in block.bindings}


def in_place_writes(func: relax.Function) -> dict:
    """Call binding var -> {output index: the argument Var it overwrites}, for the `call_tir`s
    that make the new values of arguments."""
    values = _bindings(func)
    return {var: {index: func.params[arg] for index, arg in writes.items()}
            for var, writes in argument_writers(func, values).items()
            if op_name(values[var]) == "relax.call_tir"}


@tvm.transform.module_pass(opt_level=0, name="UpdateArgumentsInPlace")
class UpdateArgumentsInPlace:
    """Make the kernels that compute new values of arguments write them in place (see the
    module docstring). A function without `tvm_ext.updates`, or swapped, is left as it is."""

    def __init__(self, function: str = "main"):
        self.function = function

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if self.function not in [gv.name_hint for gv in mod.functions]:
            return mod
        func = mod[self.function]
        if not isinstance(func, relax.Function) or has_record(func, SWAP_PLAN_ATTR):
            return mod
        writes = in_place_writes(func)
        if not writes:
            return mod
        values = _bindings(func)
        _check_order(func, writes, values)
        mutator = _Replace(mod)
        mutator.replace = {var: _inplace_call(mutator.builder_, mod, values[var], w, values)
                           for var, w in writes.items()}
        new = mutator.visit_expr(func)
        mod = mutator.builder_.get()
        mod.update_func(mod.get_global_var(self.function), new)
        return drop_unused(mod, [values[v].args[0] for v in writes])


def _inplace_call(bb: relax.BlockBuilder, mod: tvm.IRModule, call: relax.Call, writes: dict,
                  values: dict):
    """`call_tir_inplace` of the kernel of `call` writing each output of `writes` over its
    argument."""
    gv, packed = call.args[0], call.args[1]
    if len(call.args) > 2:
        raise InternalError(f"{gv.name_hint}: in-place updates of kernels with symbolic "
                            "shape arguments are not supported")
    args = list(packed.fields) if isinstance(packed, relax.Tuple) else [packed]
    positions, new_args = {}, list(args)
    for j, arg in writes.items():
        if any(viewed(a, values).same_as(arg) and not a.same_as(arg) for a in args):
            raise InternalError(f"{gv.name_hint} reads {arg.name} through a view: it cannot "
                                "overwrite it in place")
        found = [i for i, a in enumerate(args) if a.same_as(arg)]
        positions[j] = found[0] if found else None
        if not found:
            new_args.append(arg)
    try:
        kernel = inplace_kernel(mod[gv], len(args), positions)
    except InPlaceError as err:
        raise InternalError(f"{gv.name_hint}: {err}") from err
    new_gv = bb.add_func(kernel.without_attr("global_symbol"), f"{gv.name_hint}_inplace")
    appended = iter(range(len(args), len(new_args)))
    out_tys = list(call.ty_args[0].fields) if isinstance(call.ty_args[0], relax.TupleType) \
        else [call.ty_args[0]]
    indices = []
    for j in range(len(out_tys)):
        if j not in positions:
            indices.append(-1)
        else:
            indices.append(positions[j] if positions[j] is not None else next(appended))
    out_ty = out_tys if isinstance(call.ty_args[0], relax.TupleType) else out_tys[0]
    return relax.op.call_tir_inplace(new_gv, relax.Tuple(new_args), indices, out_ty)


def _check_order(func: relax.Function, writes: dict, values: dict) -> None:
    """No binding after an in-place call reads the argument it overwrote."""
    done: dict = {}  # argument -> the call that overwrote it
    for block in func.body.blocks:
        for b in block.bindings:
            for v in relax.analysis.free_vars(b.value):
                base = viewed(v, values)
                if base in done and not b.var.same_as(done[base]):
                    raise InternalError(f"{b.var.name} reads {base.name} after "
                                        f"{done[base].name} overwrote it in place")
            if b.var in writes:
                for arg in writes[b.var].values():
                    done[arg] = b.var


@relax.expr_functor.mutator
class _Replace(relax.expr_functor.PyExprMutator):
    """Rebinds the variables of `replace` to their new values."""

    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.replace: dict = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.replace:
            value = self.builder_.normalize(self.replace[binding.var])
            self.builder_.emit_normalized(relax.VarBinding(binding.var, value))
            return
        super().visit_var_binding_(binding)
