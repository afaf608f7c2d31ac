"""Small readings of Relax expressions that the IR analyses share: which operator a call is,
a tensor's static shape and dtype, a scalar constant's value."""

from __future__ import annotations

import tvm
from tvm import relax

# Ops whose result is a view of their first operand's bytes (a reshape, once
# RewriteDataflowReshape has run).
VIEW_OPS = ("relax.reshape", "relax.memory.view", "relax.memory.ensure_zero_offset")


def op_name(expr) -> str:
    """The name of the Relax operator `expr` calls ("" when it is no operator call)."""
    return expr.op.name if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) \
        else ""


def viewed(var, values: dict):
    """The variable a chain of views (`VIEW_OPS`, bound in `values`: var -> value) of `var`
    starts from."""
    while op_name(values.get(var)) in VIEW_OPS:
        var = values[var].args[0]
    return var


def is_op(expr, name: str) -> bool:
    """Whether `expr` is a call of the Relax operator `name` ("relax.matmul")."""
    return op_name(expr) == name


def static_shape(expr) -> tuple[int, ...] | None:
    """The shape of a tensor-typed `expr`, None where it is not one or not static."""
    return type_shape(getattr(expr, "ty", None))


def type_shape(ty) -> tuple[int, ...] | None:
    """The shape of a tensor type `ty`, None where it is not one or not static."""
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    try:
        return tuple(int(s) for s in ty.shape)
    except (TypeError, ValueError):
        return None


def tensor_dtype(expr) -> str | None:
    ty = getattr(expr, "ty", None)
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else None


def scalar(expr) -> float | None:
    """The value of a constant with one element, else None."""
    if isinstance(expr, tvm.ir.Constant) and isinstance(expr.ty, relax.TensorType):
        value = expr.value.numpy()
        if value.size == 1:
            return float(value.reshape(()))
    return None
