"""Kernel fission: a fused kernel run as its unfused parts, one kernel per top-level loop nest.

Fusion makes a kernel of several operators, with intermediates that live inside it. A split in
time (`time_splits`) cuts a dim of the whole kernel, so an intermediate that one block computes
whole and a later block reads across chunks (a bilinear resize's input, read at computed rows)
stops every dim it touches; a concatenation of two such results along the channels reads one
part or the other per chunk, which the index analysis does not express. Then no split of the
fused kernel fits a small budget, while each of its operators alone splits finely: the
transposes and resizes along their channels, the concatenation along its rows. A swap plan
whose budget no split of a fused kernel fits runs that kernel as its parts
(`SwapPlan.fissioned`): `split_kernel` cuts it after every top-level loop nest, the
intermediates a later part reads becoming tensors of the graph, so the planner places, swaps
and splits them like any other. Each part computes what the fused kernel computed, by the same
expressions: the results are bit for bit the fused kernel's. Which kernels a budget needs cut is
swap planning's choice (`tvm_ext.ir.swap_planning.fission_to_fit`).
"""

from __future__ import annotations

from collections.abc import Iterable

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.s_tir import SBlock, SBlockRealize

from .kernel_calls import call_tir_args, call_tir_kernel
from .local_kernels import LoweringError, split_kernel


def kernel_parts(func: tirx.PrimFunc, num_outputs: int) -> list:
    """The kernel cut after every top-level loop nest but the last (`split_kernel`'s parts);
    raises LoweringError where it has one nest, or a nest without exactly one block."""
    if any(getattr(p, "shape", None) is None for p in func.params):
        raise LoweringError("the kernel takes scalar arguments")
    root = func.body
    if not isinstance(root, SBlockRealize) or root.block.iter_vars:
        raise LoweringError("the kernel has no root block to cut")
    body = root.block.body
    stmts = list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]
    if len(stmts) < 2:
        raise LoweringError("the kernel is one loop nest")
    names = []
    for st in stmts[:-1]:
        blocks: list[str] = []
        tvm_ffi.structural_walk(st, [(SBlock, lambda b, out=blocks: out.append(b.name_hint))])
        if len(blocks) != 1:
            raise LoweringError(f"a loop nest holds {len(blocks)} blocks")
        names.append(blocks[0])
    return split_kernel(func, num_outputs, set(names))


def fission_kernels(mod: tvm.IRModule, kernels: Iterable[str],
                    function: str = "main") -> tvm.IRModule:
    """`mod` with every `call_tir` of the named kernels in `function` replaced by calls of the
    kernel's parts (`kernel_parts`, named `<kernel>_part<k>`), the intermediates between them
    new tensors. Raises LoweringError naming a kernel that does not cut."""
    kernels = sorted(set(kernels))
    if not kernels:
        return mod
    parts = {}
    defined = {gv.name_hint for gv in mod.functions}
    for name in kernels:
        if name not in defined:
            raise LoweringError(f"the module has no kernel {name}")
        func = mod[name]
        if not isinstance(func, tirx.PrimFunc):
            raise LoweringError(f"{name} is not a kernel")
        n_out = _num_outputs(mod[function], name)
        try:
            parts[name] = kernel_parts(func, n_out)
        except LoweringError as err:
            raise LoweringError(f"kernel {name} cannot run as its parts: {err}") from err
    mutator = _Fission(mod, parts)
    for name, kparts in parts.items():
        mutator.part_gvs[name] = [
            mutator.builder_.add_func(p.func.with_attr("global_symbol", f"{name}_part{k}"),
                                      f"{name}_part{k}") for k, p in enumerate(kparts)]
    gv = mod.get_global_var(function)
    mutator.builder_.update_func(gv, mutator.visit_expr(mod[function]))
    out = mutator.builder_.get()
    named: set[str] = set()
    for _, func in out.functions_items():
        if isinstance(func, relax.Function):
            tvm_ffi.structural_walk(func, [(tvm.ir.GlobalVar, lambda v: named.add(v.name_hint))])
    for name in kernels:  # no longer called: not compiled
        if name not in named:
            out = _without(out, name)
    return out


def _without(mod: tvm.IRModule, name: str) -> tvm.IRModule:
    mod = mod.clone()
    del mod[name]
    return mod


def _num_outputs(func: relax.Function, kernel: str) -> int:
    """How many outputs the calls of `kernel` in `func` have (one count for all); raises
    LoweringError where it is not called by `call_tir`, or called with symbolic arguments."""
    counts: set[int] = set()
    symbolic = []

    def on_call(call):
        if call_tir_kernel(call) == kernel:
            ty = call.ty
            counts.add(len(ty.fields) if isinstance(ty, relax.TupleType) else 1)
            symbolic.append(len(call.args) > 2)

    tvm_ffi.structural_walk(func, [(relax.Call, on_call)])
    if len(counts) != 1:
        raise LoweringError(f"kernel {kernel} is not called by call_tir in the function")
    if any(symbolic):
        raise LoweringError(f"kernel {kernel} is called with symbolic arguments")
    return counts.pop()


def _out_type(buf) -> relax.TensorType:
    return relax.TensorType([int(s) for s in buf.ty.shape], str(buf.ty.dtype))


@relax.expr_functor.mutator
class _Fission(relax.expr_functor.PyExprMutator):
    """Replaces each call of a cut kernel by its parts' calls."""

    def __init__(self, mod: tvm.IRModule, parts: dict):
        super().__init__(mod)
        self.parts = parts
        self.part_gvs: dict[str, list] = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        name = call_tir_kernel(call)
        if name not in self.parts:
            return call
        values: dict = {("in", i): a for i, a in enumerate(call_tir_args(call))}
        for part, gv in zip(self.parts[name], self.part_gvs[name], strict=True):
            params = [p for p in part.func.params if getattr(p, "shape", None) is not None]
            out_bufs = params[len(part.inputs):]
            if not out_bufs:
                # A loop nest whose results nothing reads (a batch norm's running statistics
                # in inference) computes nothing the kernel returns.
                continue
            types = [_out_type(b) for b in out_bufs]
            result = self.builder_.emit(relax.op.call_tir(
                gv, relax.Tuple([values[k] for k in part.inputs]),
                types if len(types) > 1 else types[0]))
            if len(types) == 1:
                values[part.outputs[0]] = result
            else:
                for k, key in enumerate(part.outputs):
                    values[key] = self.builder_.emit(relax.TupleGetItem(result, k))
        outs = sorted(k for k in values if k[0] == "out")
        if len(outs) == 1:
            return values[outs[0]]
        return relax.Tuple([values[k] for k in outs])
