"""ReturnLossOnly: an optimizer step returns its loss; its new parameters and state are in the
arguments' buffers.

Input: a function with the attribute `tvm_ext.updates` (`tvm_ext.models.optimizer`) after
`CallTIRRewrite` (destination-passing calls, explicit allocations). Each output that overwrites
an argument must by now be that argument (`UpdateArgumentsInPlace` made its kernel write it
there, or SwapOffload did) or a fresh allocation that an extern call (a collective gathering the
pieces of a parameter) fills: that call gets the argument's buffer as its destination instead,
provided it does not read the argument and nothing reads the argument after it. The function
then returns the loss alone, so the caller keeps no reference beyond its own arguments and a
partitioned run gathers nothing but the loss. A function without the attribute is left alone.
"""

from __future__ import annotations

import tvm
from tvm import relax

from tvm_ext.errors import InternalError
from tvm_ext.ir.pass_records import argument_updates


def _origin(var, values: dict):
    """Follow rebindings (`a = b`, `a = t[i]` of a tuple `t = (...)`) back to the first
    variable."""
    while True:
        value = values.get(var)
        if isinstance(value, relax.TupleGetItem) and isinstance(
                values.get(value.tuple_value), relax.Tuple):
            value = values[value.tuple_value].fields[value.index]
        if not isinstance(value, relax.Var):
            return var
        var = value


@tvm.transform.module_pass(opt_level=0, name="ReturnLossOnly")
class ReturnLossOnly:
    """Return the loss alone from an optimizer step (see the module docstring)."""

    def __init__(self, function: str = "main"):
        self.function = function

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if self.function not in [gv.name_hint for gv in mod.functions]:
            return mod
        func = mod[self.function]
        updates = argument_updates(func) if isinstance(func, relax.Function) else {}
        if not updates:
            return mod
        values = {b.var: b.value for block in func.body.blocks for b in block.bindings}
        ret = func.body.body
        if isinstance(values.get(ret), relax.Tuple):
            ret = values[ret]
        if not isinstance(ret, relax.Tuple):
            return mod  # already returns the loss alone
        fields = list(ret.fields)
        subst: dict = {}
        for position, arg in updates.items():
            var = _origin(fields[position], values)
            param = func.params[arg]
            if var.same_as(param):
                continue
            if not _is_alloc(values.get(var)) or _filled_by_kernel(func, var):
                raise InternalError(f"{self.function}: output {position} should overwrite "
                                    f"{param.name} in place; run UpdateArgumentsInPlace before "
                                    "dataflow lowering")
            subst[var] = param
        loss = fields[0]
        new = _rebuild(func, subst, loss)
        mod = mod.clone()
        mod.update_func(mod.get_global_var(self.function), new)
        return mod


def _filled_by_kernel(func: relax.Function, alloc) -> bool:
    """Whether the first call that takes `alloc` calls a kernel of the module (which
    UpdateArgumentsInPlace makes write in place) rather than an extern function."""
    for block in func.body.blocks:
        for b in block.bindings:
            if isinstance(b.value, relax.Call) and any(
                    v.same_as(alloc) for v in relax.analysis.free_vars(b.value)):
                return isinstance(b.value.op, tvm.ir.GlobalVar)
    return False


def _is_alloc(value) -> bool:
    return isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and \
        value.op.name in ("relax.builtin.alloc_tensor", "relax.memory.alloc_tensor")


def _rebuild(func: relax.Function, subst: dict, loss) -> relax.Function:
    """`func` with each allocation of `subst` replaced by its argument (checked: the call
    filling it does not read the argument, nothing reads the argument after), returning
    `loss`."""
    blocks = []
    written: dict = {}  # argument -> the binding that wrote it
    for block in func.body.blocks:
        bindings = []
        for b in block.bindings:
            if b.var in subst:
                continue  # the allocation: the argument's buffer takes its place
            value = b.value
            used = relax.analysis.free_vars(value)
            for param, writer in written.items():
                if any(v.same_as(param) for v in used):
                    raise InternalError(f"{b.var.name} reads {param.name} after {writer} "
                                        "overwrote it")
            hits = [subst[v] for v in used if v in subst]
            if hits:
                if any(p.same_as(v) for p in hits for v in used):
                    raise InternalError(f"{b.var.name} reads {hits[0].name} while writing it")
                value = _replace(value, subst)
                for p in hits:
                    written[p] = b.var.name
            bindings.append(relax.VarBinding(b.var, value) if isinstance(b, relax.VarBinding)
                            else b)
        blocks.append(relax.BindingBlock(bindings))
    body = relax.SeqExpr(blocks, loss)
    new = relax.Function(func.params, body, loss.ty, func.is_pure, func.attrs)
    return relax.BlockBuilder().normalize(new)


def _replace(expr, subst: dict):
    """`expr` with the variables of `subst` replaced."""
    if isinstance(expr, relax.Var):
        return subst.get(expr, expr)
    if isinstance(expr, relax.Tuple):
        return relax.Tuple([_replace(f, subst) for f in expr.fields])
    if isinstance(expr, relax.Call):
        return relax.Call(expr.op, [_replace(a, subst) for a in expr.args], expr.attrs,
                          expr.ty_args)
    return expr
