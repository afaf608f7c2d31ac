"""Where an attention bias computed from inputs is -inf whatever the inputs are.

A mask built from a model's `attention_mask` input and a causal pattern (transformers' sdpa
path: `where(and(causal, padding), 0, -inf)`) has no compile-time value, yet its causal part
has one: the padding can only mask more keys. `certain_bias` walks the bias's expression,
evaluates each part that depends on constants alone (`ConstantEvaluator`) and carries through
the operators what holds for every value of the inputs:

- of a boolean tensor, where it is surely true and where surely false;
- of a float tensor, where it is surely -inf.

An input, or an operator not listed in `_RULES`, makes nothing certain. The result is a
constant standing for the bias in `attention_mask.causal_offset`: -inf where the bias surely
is, 0 elsewhere. As with a constant mask, the one input for which a kernel skipping the keys
past the line differs from the unfused graph is a non-finite value under the mask (+inf in
an input-made addend turns the -inf into NaN there).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tvm
from tvm import relax

from .constant_eval import ConstantEvaluator
from .relax_exprs import static_shape as _shape
from .relax_exprs import tensor_dtype as _dtype

_FLOATS = ("float16", "bfloat16", "float32", "float64")
_NOTHING = np.zeros((), bool)  # certain nowhere, broadcast to any shape


@dataclasses.dataclass(frozen=True)
class _Certain:
    """What holds for every input, as boolean arrays broadcast (numpy's rules, as Relax's) to
    the expression's shape: surely true / surely false (boolean tensors), surely -inf (float
    tensors)."""

    true: np.ndarray = dataclasses.field(default_factory=lambda: _NOTHING)
    false: np.ndarray = dataclasses.field(default_factory=lambda: _NOTHING)
    neg_inf: np.ndarray = dataclasses.field(default_factory=lambda: _NOTHING)


_UNKNOWN = _Certain()


def _from_value(value: np.ndarray) -> _Certain:
    if value.dtype == np.bool_:
        return _Certain(true=value, false=~value)
    if np.issubdtype(value.dtype, np.floating):
        return _Certain(neg_inf=np.isneginf(value))
    return _UNKNOWN


def _where(c: _Certain, x: _Certain, y: _Certain) -> _Certain:
    def pick(a, b):
        return (c.true & a) | (c.false & b) | (a & b)
    return _Certain(pick(x.true, y.true), pick(x.false, y.false), pick(x.neg_inf, y.neg_inf))


def _and(a: _Certain, b: _Certain) -> _Certain:
    return _Certain(true=a.true & b.true, false=a.false | b.false)


def _or(a: _Certain, b: _Certain) -> _Certain:
    return _Certain(true=a.true | b.true, false=a.false & b.false)


def _relayout(fact: _Certain, source: tuple, target: tuple, move) -> _Certain:
    """`fact` of a tensor of shape `source` as facts of `move(tensor)` of shape `target`."""
    def one(a):
        return a if not a.any() else move(np.broadcast_to(a, source)).reshape(target)
    return _Certain(one(fact.true), one(fact.false), one(fact.neg_inf))


# Per operator: how the facts of its arguments give the facts of its result. Logical and
# bitwise operators count only on boolean tensors (checked by `_BOOLEAN`).
_RULES = {
    "relax.where": lambda f, call: _where(*f),
    "relax.logical_and": lambda f, call: _and(*f),
    "relax.bitwise_and": lambda f, call: _and(*f),
    "relax.logical_or": lambda f, call: _or(*f),
    "relax.bitwise_or": lambda f, call: _or(*f),
    "relax.logical_not": lambda f, call: _Certain(true=f[0].false, false=f[0].true),
    "relax.bitwise_not": lambda f, call: _Certain(true=f[0].false, false=f[0].true),
    # -inf plus or minus a finite value, the least of two values one of which is -inf
    "relax.add": lambda f, call: _Certain(neg_inf=f[0].neg_inf | f[1].neg_inf),
    "relax.subtract": lambda f, call: _Certain(neg_inf=f[0].neg_inf),
    "relax.minimum": lambda f, call: _Certain(neg_inf=f[0].neg_inf | f[1].neg_inf),
    "relax.maximum": lambda f, call: _Certain(neg_inf=f[0].neg_inf & f[1].neg_inf),
    "relax.broadcast_to": lambda f, call: f[0],
}
_BOOLEAN = {"relax.logical_and", "relax.bitwise_and", "relax.logical_or", "relax.bitwise_or",
            "relax.logical_not", "relax.bitwise_not"}
_LAYOUT = {"relax.reshape", "relax.expand_dims", "relax.squeeze", "relax.permute_dims"}


class MaskBounds:
    """The certain part of biases computed in one function's dataflow `bindings`."""

    def __init__(self, bindings: dict, constants: ConstantEvaluator):
        self.bindings, self.constants = bindings, constants
        self._memo: dict = {}

    def certain_bias(self, expr) -> np.ndarray | None:
        """The value of `expr` where it is a constant; otherwise a float32 array of its shape,
        -inf where `expr` is -inf for every input and 0 elsewhere; None where nothing is
        certain or its shape is not static."""
        value = self.constants.value(expr)
        if value is not None:
            return value
        shape = _shape(expr)
        if shape is None or _dtype(expr) not in _FLOATS:
            return None
        neg_inf = self._facts(expr).neg_inf
        if not neg_inf.any():
            return None
        return np.where(np.broadcast_to(neg_inf, shape), np.float32(-np.inf), np.float32(0))

    def _facts(self, expr) -> _Certain:
        if isinstance(expr, relax.Var) and expr in self._memo:
            return self._memo[expr]
        fact = self._compute(expr)
        if isinstance(expr, relax.Var):
            self._memo[expr] = fact
        return fact

    def _compute(self, expr) -> _Certain:
        shape = _shape(expr)
        if shape is None or int(np.prod(shape)) > self.constants.max_elements:
            return _UNKNOWN
        value = self.constants.value(expr)
        if value is not None:
            return _from_value(np.asarray(value))
        if isinstance(expr, relax.Var):
            value = self.bindings.get(expr)
            return _UNKNOWN if value is None else self._facts(value)
        if not isinstance(expr, relax.Call) or not isinstance(expr.op, tvm.ir.Op):
            return _UNKNOWN
        name = expr.op.name
        if name in _BOOLEAN and _dtype(expr) != "bool":
            return _UNKNOWN
        if name == "relax.astype":
            same_kind = (_dtype(expr) == "bool") == (_dtype(expr.args[0]) == "bool")
            return self._facts(expr.args[0]) if same_kind else _UNKNOWN
        if name in _LAYOUT:
            source = _shape(expr.args[0])
            if source is None:
                return _UNKNOWN
            if name == "relax.permute_dims":
                axes = None if expr.attrs.axes is None else [int(a) for a in expr.attrs.axes]
                return _relayout(self._facts(expr.args[0]), source, shape,
                                 lambda a: np.transpose(a, axes))
            return _relayout(self._facts(expr.args[0]), source, shape, lambda a: a)
        rule = _RULES.get(name)
        if rule is None:
            return _UNKNOWN
        args = [a for a in expr.args if isinstance(a, relax.Expr) and _shape(a) is not None]
        if len(args) != len(expr.args) - (1 if name == "relax.broadcast_to" else 0):
            return _UNKNOWN
        return rule([self._facts(a) for a in args], expr)
