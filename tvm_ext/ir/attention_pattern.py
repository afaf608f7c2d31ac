"""Scaled dot-product attention in a Relax function, as the frontends write it.

`find_attention(func)` finds every

    P = softmax(scale?(Q' @ K'^T) + bias?, axis=-1)        [+ PyTorch's zeroed -inf rows]
    O = P @ V'

in the function's dataflow blocks, where:

* the products are 4-D `matmul`s, or 3-D ones over the (batch, heads) axes merged by `reshape`
  (and a same-shape `broadcast_to`), split back by a `reshape` (torch.export's bmm form);
* Q' is Q times scalar constants; K'^T is `permute_dims(K', [0, 1, 3, 2])` times scalar
  constants (either order); `scale?` multiplies or divides the scores by a scalar constant;
  the scale is the product of all of them;
* K' and V' are K and V or, for grouped-query attention, K and V repeated over groups of heads
  (`expand_dims` at axis 2, `broadcast_to`, `reshape`: transformers' `repeat_kv`);
* `bias` is one or two float tensors broadcast to the scores' shape (a causal or padding mask,
  T5's position bias and mask) added after the scaling; where a bias masks every key past a
  line parallel to the diagonal for every input (computed from constants alone, or its part
  that is: a causal mask combined with an input's padding, `mask_bounds`), the spec's
  `causal_offset` says where (`attention_mask`), and the kernels skip the tiles past it;
* in a mixed-precision training step (`tvm_ext.models.mixed_precision`) every operand of both
  products is cast from float32 to bfloat16 or float16 (accumulating in float32): the kernel
  reads the float32 tensors and rounds them as the casts do;
* under autocast's policy (`tvm_ext.models.autocast`, bf16/fp16 inference) V and the output
  are in the low dtype, Q and K too or float32 cast to it for the product (Llama's rotary
  embedding promotes them), the float32 probabilities are cast to it for the second product,
  each product's float32 result is cast to it, and a scale may be a constant cast to it: the
  kernel rounds its operands as the casts do and casts its output; the scores, which
  autocast rounds to the low dtype and back before the float32 softmax, stay float32
  (`_Reader.widened`);
* PyTorch's scaled_dot_product_attention zeroes rows whose every score is -inf:
  `where(not(any(S != -inf)), 0, P)` (the `equal` / `logical_not` / `max` chain over int8 that
  torch.export writes) is matched as that option.

Intermediates something outside the pattern reads (a training step's backward reads the
probabilities and the operands' views) are `kept`: FuseAttention computes them where they are
first read instead, so the probabilities are made again for the backward rather than held
from the forward to it. A match is refused where an intermediate is a function output or is
read in another dataflow block. Q, K, V and the output share one float dtype
(float32, float16 or bfloat16; Q and K may be float32 under autocast, above) and static
shapes. Nothing else is assumed; anything else is no
match.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
from tvm import relax

from .attention_kernel import AttentionSpec
from .attention_mask import causal_offset
from .constant_eval import ConstantEvaluator
from .mask_bounds import MaskBounds
from .relax_exprs import is_op as _op
from .relax_exprs import scalar as _scalar
from .relax_exprs import static_shape as _shape
from .relax_exprs import tensor_dtype as _dtype
from .var_readers import readers

_FLOATS = ("float32", "float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class AttentionMatch:
    """One attention found: its inputs (4-D Q [B, H, Sq, D], K [B, Hk, Sk, D], V [B, Hk, Sk,
    Dv]; `biases`, up to two, of rank <= 4 broadcast to [B, H, Sq, Sk]), the variable bound to
    its 4-D output, and the kernel's spec."""

    output: relax.Var
    q: relax.Expr
    k: relax.Expr
    v: relax.Expr
    biases: tuple
    spec: AttentionSpec
    internal: frozenset  # the pattern's intermediates (scores, probabilities, views)
    values: dict = dataclasses.field(default_factory=dict, compare=False)  # their bindings
    # the intermediates read outside the pattern (a backward) and what they are made from:
    # computed where they are first read instead (see FuseAttention); the others die
    kept: frozenset = frozenset()


def _rounded(value: float, dtype: str) -> float:
    """`value` rounded to float16 or bfloat16 (to nearest even), as a cast rounds it."""
    low = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    return float(np.float32(value).astype(low))


class _Reader:
    """Follows bindings backwards, recording every var it looks through."""

    def __init__(self, bindings: dict):
        self.bindings = bindings
        self.seen: list = []
        self.rounded: list = []  # per product operand read: the low dtype it was cast to

    def value(self, var):
        """The bound value of `var` (recorded as an intermediate), or None for a parameter or a
        binding outside the dataflow blocks."""
        if isinstance(var, relax.Var) and var in self.bindings:
            self.seen.append(var)
            return self.bindings[var]
        return None

    def peek(self, var):
        return self.bindings.get(var) if isinstance(var, relax.Var) else None

    def scalar(self, expr) -> float | None:
        """`_scalar`, or the value of a variable bound to a scalar constant cast to a low
        float dtype (autocast's scale), rounded as the cast rounds it."""
        value = _scalar(expr)
        if value is not None:
            return value
        bound = self.peek(expr)
        low = _dtype(expr)
        if _op(bound, "relax.astype") and low in _FLOATS[1:] and \
                _scalar(bound.args[0]) is not None:
            return _rounded(_scalar(bound.args[0]), low)
        return None

    def take_scalar(self, expr) -> float:
        """`scalar(expr)`, recording the cast's binding as an intermediate."""
        if _scalar(expr) is None:
            self.value(expr)
        return self.scalar(expr)

    def scaled(self, expr, allow_transpose: bool) -> tuple[relax.Expr, float, bool]:
        """(the operand under scalar multiplies and at most one last-two-axes transpose,
        their product, whether it was transposed)."""
        scale, transposed = 1.0, False
        while True:
            value = self.peek(expr)
            if _op(value, "relax.multiply"):
                a, b = value.args
                c, other = (b, a) if self.scalar(b) is not None else (a, b)
                if self.scalar(c) is None or _shape(other) != _shape(expr):
                    break
                self.value(expr)
                scale, expr = scale * self.take_scalar(c), other
                continue
            if allow_transpose and not transposed and _op(value, "relax.permute_dims") and \
                    value.attrs.axes is not None and \
                    [int(a) for a in value.attrs.axes] == [0, 1, 3, 2]:
                self.value(expr)
                transposed, expr = True, value.args[0]
                continue
            break
        return expr, scale, transposed

    def merged(self, expr):
        """The 4-D tensor whose (batch, heads) axes a 3-D operand merges (through a reshape
        and an identity broadcast_to), or the operand itself when it is 4-D."""
        shape = _shape(expr)
        if shape is not None and len(shape) == 4:
            return expr
        value = self.peek(expr)
        if shape is None or len(shape) != 3 or not _op(value, "relax.reshape"):
            return None
        self.value(expr)
        src = value.args[0]
        s4 = _shape(src)
        if s4 is None or len(s4) != 4 or s4[0] * s4[1] != shape[0] or s4[2:] != shape[1:]:
            return None
        inner = self.peek(src)
        if _op(inner, "relax.broadcast_to"):
            # The same tensor, or one head broadcast over all (multi-query attention).
            b = _shape(inner.args[0])
            if b is not None and len(b) == 4 and b[0] == s4[0] and b[1] in (1, s4[1]) and \
                    b[2:] == s4[2:]:
                self.value(src)
                src = inner.args[0]
        return src

    def split(self, expr):
        """A 4-D scores/output tensor: (the matmul, its two operands as 4-D tensors); operands
        cast to a low float dtype for the product (mixed precision) are read before the cast,
        the dtype noted in `rounded`."""
        shape = _shape(expr)
        if shape is None or len(shape) != 4:
            return None
        value = self.peek(expr)
        reshaped = _op(value, "relax.reshape")
        product = self.rounded_product(value.args[0] if reshaped else expr)
        inner = self.peek(product)
        if not _op(inner, "relax.matmul"):
            return None
        self.value(expr)
        self.value(product)
        if reshaped:
            a, b = (self.merged(self.unrounded(x)) for x in inner.args)
        else:
            a, b = (self.unrounded(x) for x in inner.args)
            if _shape(a) is None or len(_shape(a)) != 4 or len(_shape(b) or ()) != 4:
                return None
        if a is None or b is None:
            return None
        return a, b

    def widened(self, expr):
        """The low-precision tensor a float32 one is cast from (autocast's product, rounded to
        the low dtype, then cast back for a float32 op: the kernel keeps its scores float32,
        unrounded, as PyTorch's fused kernels do), or `expr`."""
        value = self.peek(expr)
        if _op(value, "relax.astype") and _dtype(expr) == "float32" and \
                _dtype(value.args[0]) in _FLOATS[1:]:
            self.value(expr)
            return value.args[0]
        return expr

    def rounded_product(self, expr):
        """The float32 matmul whose result `expr` is cast to a low dtype (autocast rounds
        each product's result once; the kernel casts its output likewise), or `expr`."""
        value = self.peek(expr)
        if _op(value, "relax.astype") and _dtype(expr) in _FLOATS[1:] and \
                _dtype(value.args[0]) == "float32" and \
                _op(self.peek(value.args[0]), "relax.matmul"):
            self.value(expr)
            return value.args[0]
        return expr

    def unrounded(self, expr):
        """The float32 tensor a low-precision product operand is cast from (noting the low
        dtype), or `expr`."""
        value = self.peek(expr)
        if _op(value, "relax.astype") and _dtype(expr) in _FLOATS[1:] and \
                _dtype(value.args[0]) == "float32":
            self.value(expr)
            self.rounded.append(_dtype(expr))
            return value.args[0]
        self.rounded.append(None)
        return expr

    def ungrouped(self, expr):
        """(K, group) for K' = repeat_kv(K, group) (`expand_dims` at 2, `broadcast_to`,
        `reshape`), or (K', 1)."""
        value = self.peek(expr)
        if not _op(value, "relax.reshape"):
            return expr, 1
        bcast = self.peek(value.args[0])
        if not _op(bcast, "relax.broadcast_to"):
            return expr, 1
        expand = self.peek(bcast.args[0])
        if not _op(expand, "relax.expand_dims") or \
                [int(a) for a in expand.attrs.axis] != [2]:
            return expr, 1
        src, out, wide = expand.args[0], _shape(expr), _shape(value.args[0])
        s = _shape(src)
        if s is None or out is None or wide is None or len(s) != 4 or \
                wide != (s[0], s[1], wide[2], s[2], s[3]) or \
                out != (s[0], s[1] * wide[2], s[2], s[3]):
            return expr, 1
        self.value(expr)
        self.value(value.args[0])
        self.value(bcast.args[0])
        return src, wide[2]


def _is_masked_row_guard(cond, scores, reader: _Reader) -> bool:
    """`cond` = not(any(scores != -inf) over the last axis), as torch.export writes it:
    logical_not(astype(max(astype(logical_not(equal(S, -inf)), int8), -1, keepdims), bool))."""
    chain = [("relax.logical_not", None), ("relax.astype", "bool"), ("relax.max", None),
             ("relax.astype", None), ("relax.logical_not", None), ("relax.equal", None)]
    expr = cond
    for name, dtype in chain:
        value = reader.peek(expr)
        if not _op(value, name) or (dtype is not None and _dtype(expr) != dtype):
            return False
        if name == "relax.max" and ([int(a) for a in value.attrs.axis] not in ([-1], [3])
                                    or not value.attrs.keepdims):
            return False
        reader.value(expr)
        if name == "relax.equal":
            a, b = value.args
            return a.same_as(scores) and _scalar(b) == float("-inf")
        expr = value.args[0]
    return False


def _probabilities(p_expr, reader: _Reader):
    """(scores, zero_masked_rows) for the probabilities operand of the second product."""
    value = reader.peek(p_expr)
    zero_rows = False
    if _op(value, "relax.where"):
        cond, zeros, p = value.args
        zero_value = reader.peek(zeros)
        is_zero = _scalar(zeros) == 0.0 or (
            _op(zero_value, "relax.full_like") and zero_value.args[0].same_as(p)
            and _scalar(zero_value.args[1]) == 0.0)
        if not is_zero or not _op(reader.peek(p), "relax.nn.softmax"):
            return None
        reader.value(p_expr)
        if not _is_masked_row_guard(cond, reader.peek(p).args[0], reader):
            return None
        if zero_value is not None:
            reader.value(zeros)
        p_expr, value, zero_rows = p, reader.peek(p), True
    if not _op(value, "relax.nn.softmax") or int(value.attrs.axis) not in (-1, 3):
        return None
    reader.value(p_expr)
    return value.args[0], zero_rows


def _scaled_scores(expr, reader: _Reader):
    """(Q, K', scale) of scores = scale * (Q' @ K'^T) (scaled by scalar multiplies or a
    division, on the product or on its operands)."""
    scale = 1.0
    expr = reader.widened(expr)
    value = reader.peek(expr)
    if _op(value, "relax.divide") and reader.scalar(value.args[1]):
        reader.value(expr)
        scale, expr = 1.0 / reader.take_scalar(value.args[1]), value.args[0]
    else:
        expr, scale, _ = reader.scaled(expr, allow_transpose=False)
    operands = reader.split(expr)
    if operands is None:
        return None
    q, q_scale, q_transposed = reader.scaled(operands[0], allow_transpose=False)
    k, k_scale, transposed = reader.scaled(operands[1], allow_transpose=True)
    if not transposed or q_transposed:
        return None
    return q, k, scale * q_scale * k_scale


def _scores(s_expr, reader: _Reader, adds: int = 0):
    """(Q, K', biases, scale) of the scores operand of softmax: scaled scores, plus up to two
    biases."""
    value = reader.peek(s_expr)
    shape = _shape(s_expr)
    if not _op(value, "relax.add"):
        found = _scaled_scores(s_expr, reader)
        return None if found is None else (found[0], found[1], (), found[2])
    if adds == 2:
        return None
    for scores, bias in (value.args, value.args[::-1]):
        trial = _Reader(reader.bindings)
        found = _scores(scores, trial, adds + 1)
        if found is not None and _shape(scores) == shape and _broadcasts(bias, shape):
            reader.value(s_expr)
            reader.seen.extend(trial.seen)
            reader.rounded.extend(trial.rounded)
            return found[0], found[1], (*found[2], bias), found[3]
    return None


def _broadcasts(bias, shape: tuple[int, ...]) -> bool:
    """A float tensor of rank <= 4 whose every axis is 1 or the scores' (right-aligned)."""
    b = _shape(bias)
    if b is None or len(b) > len(shape) or _dtype(bias) not in (*_FLOATS, "float64"):
        return False
    return all(x in (1, y) for x, y in zip(b[::-1], shape[::-1], strict=False))


def _match(out_var, value, bindings: dict, bounds: MaskBounds) -> AttentionMatch | None:
    """The attention whose output `out_var` (bound to `value`) is, if it is one."""
    reader = _Reader(bindings)
    operands = reader.split(out_var)
    if operands is None:
        return None
    p_expr, v_expr = operands
    probs = _probabilities(p_expr, reader)
    if probs is None:
        return None
    scores = _scores(probs[0], reader)
    if scores is None:
        return None
    q, k, biases, scale = scores
    k, group = reader.ungrouped(k)
    v, v_group = reader.ungrouped(v_expr)
    qs, ks, vs, os_ = _shape(q), _shape(k), _shape(v), _shape(out_var)
    dtype, qk = _dtype(v), _dtype(q)
    if None in (qs, ks, vs, os_) or dtype not in _FLOATS or _dtype(k) != qk or \
            _dtype(out_var) != dtype or group != v_group or qk not in (dtype, "float32"):
        return None
    b, h, sq, d = qs
    # Head h reads key head h // group: repeat_kv's groups, or one head broadcast to all.
    if group == 1 and ks[1] == 1:
        group = h
    if ks[0] != b or ks[1] * group != h or vs[:3] != ks[:3] or ks[3] != d or \
            os_ != (b, h, sq, vs[3]) or _shape(probs[0]) != (b, h, sq, ks[2]):
        return None
    rounded = set(reader.rounded)
    # reader.rounded: P and V (the output's product), then Q' and K' (the scores')
    if qk != dtype and (len(reader.rounded) != 4 or reader.rounded[2:] != [dtype, dtype]):
        return None  # float32 Q or K read unrounded by a product of the low dtype
    if dtype in _FLOATS[1:] and dtype in rounded and rounded <= {None, dtype}:
        # autocast: V in the low dtype, the float32 probabilities (and Q and K where they
        # are float32) cast to it
        operand = dtype
    elif len(rounded) != 1 or qk != dtype:
        return None  # some operands of the products cast to a low dtype, others not
    else:
        operand = reader.rounded[0]
    shapes = tuple((1,) * (4 - len(_shape(x))) + _shape(x) for x in biases)
    spec = AttentionSpec(b, h, ks[1], sq, ks[2], d, vs[3], dtype, float(scale), shapes,
                         tuple(_dtype(x) for x in biases), probs[1], operand,
                         causal_offset([bounds.certain_bias(x) for x in biases], sq, ks[2]),
                         qk if qk != dtype else None)
    internal = frozenset(v for v in reader.seen if not v.same_as(out_var))
    return AttentionMatch(out_var, q, k, v, biases, spec, internal,
                          {x: bindings[x] for x in internal})


def _kept(match: AttentionMatch, uses: dict, block_of: dict, values: dict) -> frozenset | None:
    """The intermediates something outside the pattern reads (a training step's backward:
    the probabilities, the operands' views) with the intermediates they are computed from;
    None where one is a function output (or packed into one) or is read in another dataflow
    block."""
    inside = set(match.internal) | {match.output}
    read = [v for v in match.internal if not set(uses.get(v, ())) <= inside]
    kept: set = set()
    while read:
        var = read.pop()
        if var in kept:
            continue
        users = set(uses.get(var, ())) - inside
        if None in users or any(block_of.get(u) != block_of[var] or
                                isinstance(values.get(u), relax.Tuple) for u in users):
            return None  # returned (as is or in a tuple), or read in another block
        kept.add(var)
        read.extend(v for v in relax.analysis.free_vars(match.values[var])
                    if v in match.internal)
    return frozenset(kept)


def find_attention(func: relax.Function) -> list[AttentionMatch]:
    """Every attention of `func` that one fused kernel can compute (see the module doc), with
    the intermediates something else reads (`AttentionMatch.kept`)."""
    if not isinstance(func.body, relax.SeqExpr):
        return []
    bindings, block_of = {}, {}
    for i, block in enumerate(func.body.blocks):
        if not isinstance(block, relax.DataflowBlock):
            continue
        for b in block.bindings:
            if isinstance(b, relax.VarBinding):
                bindings[b.var] = b.value
                block_of[b.var] = i
    uses = readers(func)
    bounds = MaskBounds(bindings, ConstantEvaluator(bindings))
    found = []
    for var, value in bindings.items():
        if not (_op(value, "relax.reshape") or _op(value, "relax.matmul")
                or _op(value, "relax.astype")):  # autocast's rounding of the product
            continue
        match = _match(var, value, bindings, bounds)
        if match is None:
            continue
        kept = _kept(match, uses, block_of, bindings)
        if kept is not None:
            found.append(dataclasses.replace(match, kept=kept))
    return found
