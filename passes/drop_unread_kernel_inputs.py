"""DropUnreadKernelInputs: kernel arguments the kernel never reads leave the call.

Input: a module after fusion (`R.call_tir` of PrimFuncs, as `tvm_ext.pipeline.legalize_passes`
leaves it). A kernel parameter its body never names (`tvm_ext.ir.unread_params`: an embedding's
gradient, `take_backward`, is passed the embedding table for its shape only) is dropped from
the PrimFunc and from every call of it, so the planners see the kernel's real inputs: a swap
plan need not bring the table onto the device for the gradient, and PartitionOperators need not
place it. Only kernels that every Relax function calls through `R.call_tir` are rewritten (an
in-place call's indices and any other use of the kernel name positions); the kernel keeps its
name. Results are bit for bit those of the unmodified module.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, tirx

from tvm_ext.ir.kernel_calls import call_tir_args, call_tir_kernel
from tvm_ext.ir.unread_params import unread_params, without_params


@tvm.transform.module_pass(opt_level=0, name="DropUnreadKernelInputs")
class DropUnreadKernelInputs:
    """Drop the arguments a kernel never reads (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        unread = {gv.name_hint: unread_params(f) for gv, f in mod.functions_items()
                  if isinstance(f, tirx.PrimFunc)}
        unread = {name: pos for name, pos in unread.items() if pos}
        if not unread:
            return mod
        calls, inputs, refs = _call_sites(mod)
        drop = {}
        for name, pos in unread.items():
            counts = inputs.get(name, set())
            # Every use a call_tir with one input count; only inputs are dropped.
            if refs.get(name, 0) == calls.get(name, 0) and len(counts) == 1 and \
                    all(p < next(iter(counts)) for p in pos):
                drop[name] = pos
        if not drop:
            return mod
        mod = mod.clone()
        kernels = {}
        for name in drop:
            kernels[name] = mod[name]
            del mod[name]  # so that the slimmer kernel gets its name (and its own type)
        mutator = _DropArguments(mod, drop)
        for name, pos in drop.items():
            mutator.new_gv[name] = mutator.builder_.add_func(
                without_params(kernels[name], pos), name)
        for gv, func in list(mod.functions_items()):
            if isinstance(func, relax.Function):
                mutator.builder_.update_func(gv, mutator.visit_expr(func))
        return mutator.builder_.get()


def _call_sites(mod: tvm.IRModule):
    """Per kernel name: how many `call_tir`s call it, their input counts, and how many times
    any Relax function names it."""
    calls: dict[str, int] = {}
    inputs: dict[str, set[int]] = {}
    refs: dict[str, int] = {}

    def on_call(call):
        name = call_tir_kernel(call)
        if name is not None:
            calls[name] = calls.get(name, 0) + 1
            inputs.setdefault(name, set()).add(len(call_tir_args(call)))

    def on_gv(gv):
        refs[gv.name_hint] = refs.get(gv.name_hint, 0) + 1

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            tvm_ffi.structural_walk(func, [(relax.Call, on_call), (tvm.ir.GlobalVar, on_gv)])
    return calls, inputs, refs


@relax.expr_functor.mutator
class _DropArguments(relax.expr_functor.PyExprMutator):
    """Leaves the dropped positions out of every `call_tir` of the rewritten kernels."""

    def __init__(self, mod: tvm.IRModule, drop: dict[str, list[int]]):
        super().__init__(mod)
        self.drop = {name: set(pos) for name, pos in drop.items()}
        self.new_gv: dict[str, tvm.ir.GlobalVar] = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        name = call_tir_kernel(call)
        if name not in self.drop:
            return call
        args = [a for i, a in enumerate(call_tir_args(call)) if i not in self.drop[name]]
        return relax.Call(call.op, [self.new_gv[name], relax.Tuple(args), *call.args[2:]],
                          call.attrs, call.ty_args)
