"""The gradient of a softmax whose fully masked rows are zeroed, as PyTorch computes it.

torch.export writes scaled dot-product attention with PyTorch's `_safe_softmax`:
`where(R, 0, softmax(S))`, R true on the rows where every key is masked (-inf), so that such a
row (a left-padded sequence's first queries under a causal mask) gives zeros, not NaN.
PyTorch's backward of `_safe_softmax` reads the zeroed result and gives those rows a zero
gradient. `relax.transform.Gradient` differentiates the two ops apart: softmax's gradient
`y * (g - sum(g * y))` reads y = softmax(S), NaN on those rows, and NaN * 0 is NaN, so every
gradient upstream of the attention turns NaN.

`zeroed_row_softmaxes` finds, in the forward, the softmaxes read only by such a `where` (R of
extent 1 along the softmax's axis, the other branch zeros) and by `full_like` (their zeros);
`read_zeroed_rows` then makes every other reader of y in the differentiated step (the
gradient's) read the `where`'s result instead. Where R is false the two are equal; where it is
true the incoming gradient is 0 on the whole row, so the softmax gradient there is 0, not NaN:
PyTorch's numbers, the forward unchanged.
"""

from __future__ import annotations

from tvm import relax

from ..ir.relax_exprs import is_op, scalar, static_shape
from ..ir.var_readers import readers


def _is_zero(expr, values: dict) -> bool:
    """Whether `expr` is a scalar 0 constant, or (through its binding) full_like(x, 0)."""
    value = values.get(expr) if isinstance(expr, relax.Var) else expr
    if is_op(value, "relax.full_like"):
        return _is_zero(value.args[1], values)
    return scalar(expr) == 0.0


def _zeroing_where(y, value, values: dict) -> bool:
    """Whether `value` is where(R, zeros, y) with R of extent 1 along y's softmax axis."""
    if not is_op(value, "relax.where") or not value.args[2].same_as(y) or \
            not _is_zero(value.args[1], values):
        return False
    shape, rows = static_shape(y), static_shape(value.args[0])
    if shape is None or rows is None or len(rows) > len(shape):
        return False
    axis = int(values[y].attrs.axis) % len(shape)
    offset = len(shape) - len(rows)
    return axis < offset or rows[axis - offset] == 1


def _zeroed_softmaxes(func: relax.Function):
    """(values, [(softmax var, its zeroing where, its other readers)]) for each softmax of
    `func` read by exactly one `where` zeroing whole rows; its readers that are not that
    `where` or `full_like` (its zeros) are the others (None: the function's output)."""
    values = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    uses = readers(func)
    found = []
    for var, value in values.items():
        if not is_op(value, "relax.nn.softmax"):
            continue
        users = uses.get(var, [])
        wheres = [u for u in users if u is not None and _zeroing_where(var, values[u], values)]
        if len(wheres) == 1:
            others = [u for u in users if u is None or
                      (u not in wheres and not is_op(values[u], "relax.full_like"))]
            found.append((var, wheres[0], others))
    return values, found


def zeroed_row_softmaxes(func: relax.Function) -> set[str]:
    """Names of the softmax results of `func` read only by a `where` zeroing whole rows and
    by `full_like` (that `where`'s zeros)."""
    return {var.name for var, _, others in _zeroed_softmaxes(func)[1] if not others}


def read_zeroed_rows(step: relax.Function, names: set[str]) -> relax.Function:
    """`step` with every reader of the softmaxes `names` (found in its forward by
    `zeroed_row_softmaxes`) other than their `where` and `full_like` reading that `where`'s
    result instead."""
    if not names:
        return step
    values, found = _zeroed_softmaxes(step)
    swap: dict = {}  # reader -> {softmax var: where var}
    for var, where, grads in found:
        if var.name not in names:
            continue
        if None in grads or not all(isinstance(values[u], relax.Call) and
                                    any(a.same_as(var) for a in values[u].args) for u in grads):
            continue  # returned, or read inside a tuple: left as it is
        for user in grads:
            swap.setdefault(user, {})[var] = where
    if not swap:
        return step
    blocks = []
    for block in step.body.blocks:
        bindings = [relax.VarBinding(b.var, _with_args(b.value, swap[b.var]))
                    if b.var in swap else b for b in block.bindings]
        blocks.append(type(block)(bindings))
    return relax.Function(step.params, relax.SeqExpr(blocks, step.body.body), step.ret_ty,
                          step.is_pure, step.attrs)


def _with_args(value, mapping: dict):
    """`value` (a call: the gradient's products read y directly) reading `mapping`'s vars."""
    args = [mapping.get(a, a) if isinstance(a, relax.Var) else a for a in value.args]
    return relax.Call(value.op, args, value.attrs, value.ty_args, ret_ty=value.ty)
