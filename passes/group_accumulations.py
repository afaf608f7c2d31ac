"""GroupAccumulations: each product of a sum of products fused with the add that takes it.

Input: a module after `LegalizeOps` and `AnnotateTIROpPattern`, before `FuseOps`. A gradient
summed over several products makes a chain of adds,

    acc1 = add(p0, p1);  acc2 = add(acc1, p2);  ...   (each p_i a GEMM's output)

as `relax.transform.Gradient` writes the gradient of a weight used in several places (a head
applied to chunks of tokens; the query, key and value projections reading one input). FuseOps
fuses the first product with every add of the chain into one kernel, which must then wait for
all the other products: all of them are live at once. A head over a 128k vocabulary applied
in 8 chunks keeps 8 gradients of 1 GB each. Grouped here instead, each product runs with the
add that takes it (`fused_<gemm>_<add>`, one kernel, which the library dispatch computes as a
GEMM and its epilogue), so a product lives only inside its kernel and the sum is the only
tensor of its size that stays live.

A chain is at least two adds, each elementwise (`op_pattern` 0) over two tensors of its own
shape and dtype, the partial product an output-fusable kernel's result (`op_pattern` 4, a
GEMM) that only this add reads, the other operand a GEMM's result or the previous add of the
chain. The first add takes the later of its two products. Each fused kernel runs where its
product was made (or right after the sum it adds to, where that comes later): the sums are
the same additions in the same order, so results are bit for bit those of the unmodified
module.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, tirx

from tvm_ext.ir.kernel_calls import call_tir_args, call_tir_kernel
from tvm_ext.ir.var_readers import readers

_ELEMWISE, _OUT_EWISE_FUSABLE = 0, 4


@tvm.transform.module_pass(opt_level=0, name="GroupAccumulations")
class GroupAccumulations:
    """Fuse each product of a chain of adds with its add (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        patterns = {gv.name_hint: _pattern(f) for gv, f in mod.functions_items()
                    if isinstance(f, tirx.PrimFunc)}
        builder = relax.BlockBuilder(mod)
        changed = False
        for gv, func in list(mod.functions_items()):
            if not isinstance(func, relax.Function) or (
                    func.attrs is not None and "Primitive" in func.attrs):
                continue
            new = _group(builder, func, patterns)
            if new is not None:
                builder.update_func(gv, new)
                changed = True
        # (the functions built here get their types from the builder's normalization)
        return relax.transform.Normalize()(builder.get()) if changed else mod


def _pattern(func: tirx.PrimFunc) -> int | None:
    if func.attrs is None or "op_pattern" not in func.attrs:
        return None
    return int(func.attrs["op_pattern"])


def _group(builder: relax.BlockBuilder, func: relax.Function, patterns: dict):
    """`func` with its chains grouped, or None where it has none."""
    if not isinstance(func.body, relax.SeqExpr):
        return None
    uses = readers(func)
    blocks, changed = [], False
    for block in func.body.blocks:
        pairs = _pairs(block, patterns, uses) if isinstance(block, relax.DataflowBlock) else {}
        if not pairs:
            blocks.append(block)
            continue
        changed = True
        blocks.append(relax.DataflowBlock(_placed(builder, block, pairs)))
    if not changed:
        return None
    return relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty,
                          func.is_pure, func.attrs)


def _placed(builder: relax.BlockBuilder, block: relax.DataflowBlock, pairs: dict) -> list:
    """`block`'s bindings with each add of `pairs` replaced by its fused kernel, which runs
    where its product was made, or right after the sum it adds to where that comes later:
    differentiation may write a weight's sum of gradients after all of its products (the
    products then all live until it), and each product is read there, once."""
    values = {b.var: b for b in block.bindings}
    by_product = {}
    for add, product in pairs.items():
        add_binding = values[add]
        other = next(a for a in call_tir_args(add_binding.value) if not a.same_as(product))
        by_product[product] = (_fused_binding(builder, add_binding, values[product]), other)
    made = set(values)
    out, seen, waiting = [], set(), {}

    def emit(binding) -> None:
        out.append(binding)
        seen.add(binding.var)
        for ready in waiting.pop(binding.var, []):
            emit(ready)

    for binding in block.bindings:
        if binding.var in pairs:
            continue  # emitted with its product
        if binding.var in by_product:
            fused, other = by_product[binding.var]
            if other in made and other not in seen:
                waiting.setdefault(other, []).append(fused)
            else:
                emit(fused)
            continue
        emit(binding)
    return out


def _pairs(block: relax.DataflowBlock, patterns: dict, uses: dict) -> dict:
    """{add's var: the product's var it takes} for every chain of `block`."""
    kind = {}  # var -> "gemm" or "acc"
    order = {}
    candidates = {}
    for i, binding in enumerate(block.bindings):
        order[binding.var] = i
        value = binding.value
        name = call_tir_kernel(value) if isinstance(value, relax.Call) else None
        if name is None or _has_tir_vars(value):
            continue
        pattern = patterns.get(name)
        if pattern == _OUT_EWISE_FUSABLE:
            kind[binding.var] = "gemm"
            continue
        args = call_tir_args(value)
        if pattern != _ELEMWISE or len(args) != 2 or \
                not all(_same_type(a, binding.var) for a in args):
            continue
        gemms = [a for a in args if kind.get(a) == "gemm" and len(uses.get(a, ())) == 1]
        if not gemms or not all(kind.get(a) in ("gemm", "acc") for a in args):
            continue
        partial = max(gemms, key=lambda a: order[a])
        other = args[1] if partial.same_as(args[0]) else args[0]
        candidates[binding.var] = (partial, other)
        kind[binding.var] = "acc"
    # Only chains: an add whose sum feeds the next add, or that takes the previous one's.
    chained = {other for _, other in candidates.values() if other in candidates}
    return {var: partial for var, (partial, other) in candidates.items()
            if var in chained or other in chained}


def _has_tir_vars(call: relax.Call) -> bool:
    return len(call.args) > 2


def _same_type(arg, var) -> bool:
    if not isinstance(arg, relax.Var):
        return False
    a, b = arg.ty, var.ty
    return isinstance(a, relax.TensorType) and isinstance(b, relax.TensorType) and \
        a.shape is not None and b.shape is not None and str(a.dtype) == str(b.dtype) and \
        tvm_ffi.structural_equal(a.shape, b.shape)


def _fused_binding(builder: relax.BlockBuilder, add: relax.VarBinding,
                   gemm: relax.VarBinding) -> relax.VarBinding:
    """`add`'s var bound to a call of a new primitive function computing `gemm` then `add`."""
    # Constants are arguments too (an LSTM's first step multiplies its zero initial state):
    # FuseTIR takes no tensor constant inside a primitive function.
    outer = [a for a in [*call_tir_args(gemm.value), *call_tir_args(add.value)]
             if not a.same_as(gemm.var)]
    outer = list(dict.fromkeys(outer))
    params = {v: relax.Var(v.name if isinstance(v, relax.Var) else f"c{i}", v.ty)
              for i, v in enumerate(outer)}
    inner = relax.Var(gemm.var.name, gemm.var.ty)
    params_and_inner = dict(params)
    params_and_inner[gemm.var] = inner
    gemm_call = _with_args(gemm.value, params_and_inner)
    add_call = _with_args(add.value, params_and_inner)
    out = relax.Var(add.var.name, add.var.ty)
    body = relax.SeqExpr([relax.DataflowBlock([relax.VarBinding(inner, gemm_call),
                                               relax.VarBinding(out, add_call)])], out)
    func = relax.Function(list(params.values()), body, add.var.ty, True)
    func = func.with_attr("Primitive", True)
    name = f"fused_{call_tir_kernel(gemm.value)}_{call_tir_kernel(add.value)}"
    gv = builder.add_func(func, name)
    return relax.VarBinding(add.var, relax.Call(gv, outer))


def _with_args(call: relax.Call, mapping: dict) -> relax.Call:
    args = [mapping.get(a, a) for a in call_tir_args(call)]
    return relax.Call(call.op, [call.args[0], relax.Tuple(args), *call.args[2:]], call.attrs,
                      call.ty_args)
