"""The backward of a fused attention in a training step, as `relax.transform.Gradient` writes it.

For an attention `find_attention` matched (scores S = Q' K'^T, scaled and biased, P =
softmax(S), O = P V'), `find_attention_backward(match, bindings, uses)` finds the bindings
that compute

    dP  = dO V'^T                            (M1)
    dV' = P^T dO                             (M2)
    dS  = P * (dP - sum(dP * P, axis=-1))    (softmax's gradient)
    dQ' = a dS K'                            (M3: the adjoint of the scores' left operand)
    dK' = a dS^T Q'  (or its transpose)      (M4: of the right operand, K'^T's source)

whatever views the frontend put between them. Every tensor is read through its *canonical
view*: (base, transposed, factor) after following aliases, reshapes that only merge or split
the (batch, heads) axes, same-shape broadcast_to / collapse_sum_to, last-two-axes transposes,
multiplications or divisions by scalar constants and casts of a float32 tensor to a low float
dtype (the view notes the rounding). Two operands are the same when their canonical views
are. With PyTorch's zeroed -inf rows, dP passes through the same where() as the forward's
probabilities, and softmax's gradient reads P zeroed so (`tvm_ext.models.masked_softmax`) or
as softmax made it. In a mixed-precision step (the forward's products read operands rounded to a
low dtype) every product of the backward must read its operands rounded to that dtype too,
and softmax's gradient must read dP and P unrounded: what the kernels compute then.

The match is refused unless M1 and the softmax gradient are found exactly once, M2, M3 and M4
at most once each and M3 or M4 at all (a gradient the step does not compute, its input not
trained, has no product), dO and P enter unscaled, and nothing outside these bindings reads
dP, dS or what lies between (a trainable bias's gradient reads dS: then the score matrix is
needed anyway; so does a product of a form not recognised). Then M2, M3 and M4 are what the
fused backward kernels compute (dq_scale and dk_scale gather the scalar factors), and
everything of size q_len x kv_len in the backward dies with them.
"""

from __future__ import annotations

import dataclasses

from tvm import relax

from .attention_backward_kernel import BackwardSpec
from .attention_pattern import AttentionMatch, _Reader
from .relax_exprs import is_op as _op
from .relax_exprs import scalar as _scalar
from .relax_exprs import static_shape as _shape
from .relax_exprs import tensor_dtype as _dtype

_LOW = ("float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class BackwardMatch:
    """One attention's backward: the output's adjoint (`d_out`, a tensor whose canonical view
    is [batch, heads, q_len, value_dim] or its 3-D merge) and the bindings the kernels
    replace, each with whether it holds the transpose of the kernel's output; None where the
    step does not compute that gradient (nothing trainable reads it)."""

    forward: AttentionMatch
    spec: BackwardSpec
    d_out: relax.Expr
    d_q: relax.Var | None
    d_k: relax.Var | None
    d_k_transposed: bool
    d_v: relax.Var | None
    d_v_transposed: bool


@dataclasses.dataclass(frozen=True)
class _View:
    base: relax.Expr
    transposed: bool
    factor: float
    low: str | None = None  # the dtype the base is rounded to (cast and read in float32)

    def same(self, other: _View) -> bool:
        return self.base.same_as(other.base) and self.transposed == other.transposed

    def plain(self, base) -> bool:
        """Whether this is `base` itself: not transposed, scaled or rounded."""
        return self.base.same_as(base) and not self.transposed and self.factor == 1.0 and \
            self.low is None


class CanonicalViews:
    """Canonical views of the vars of one dataflow block (`bindings`: var -> value), computed
    as asked, then kept."""

    def __init__(self, bindings: dict):
        self.bindings = bindings
        self.cache: dict = {}

    def of(self, expr) -> _View:
        if isinstance(expr, relax.Var) and expr in self.cache:
            return self.cache[expr]
        view = self._walk(expr)
        if isinstance(expr, relax.Var):
            self.cache[expr] = view
        return view

    def _walk(self, expr) -> _View:
        value = self.bindings.get(expr) if isinstance(expr, relax.Var) else None
        shape = _shape(expr)
        if isinstance(value, relax.Var):
            return self.of(value)
        if shape is None or value is None:
            return _View(expr, False, 1.0)
        inner = value.args[0] if isinstance(value, relax.Call) and value.args else None
        s_in = _shape(inner) if inner is not None else None
        if s_in is not None and (_op(value, "relax.broadcast_to")
                                 or _op(value, "relax.collapse_sum_to")
                                 or _op(value, "relax.reshape")) and _same_rows(s_in, shape):
            return self.of(inner)
        if _op(value, "relax.permute_dims") and s_in is not None and \
                value.attrs.axes is not None:
            axes = [int(a) for a in value.attrs.axes]
            n = len(axes)
            if n >= 2 and axes == [*range(n - 2), n - 1, n - 2]:
                v = self.of(inner)
                return dataclasses.replace(v, transposed=not v.transposed)
        if _op(value, "relax.multiply") or _op(value, "relax.divide"):
            a, b = value.args
            c, other = (_scalar(b), a) if _scalar(b) is not None else (None, None)
            if c is None and _op(value, "relax.multiply") and _scalar(a) is not None:
                c, other = _scalar(a), b
            if c is not None and c != 0 and _shape(other) == shape:
                v = self.of(other)
                return dataclasses.replace(
                    v, factor=v.factor * (c if _op(value, "relax.multiply") else 1.0 / c))
        if _op(value, "relax.astype") and s_in == shape and _dtype(inner) == "float32" and \
                _dtype(expr) in _LOW:
            v = self.of(inner)
            if v.low is None:
                return dataclasses.replace(v, low=_dtype(expr))
        return _View(expr, False, 1.0)


def _same_rows(src: tuple, dst: tuple) -> bool:
    """A reshape that keeps the last two axes and only merges or splits the ones before (the
    element order is unchanged; transposed views stay transposed), or changes nothing."""
    if src == dst:
        return True
    if len(src) < 2 or len(dst) < 2 or src[-2:] != dst[-2:]:
        return False
    lead_s, lead_d = src[:-2], dst[:-2]
    prod_s = prod_d = 1
    for x in lead_s:
        prod_s *= x
    for x in lead_d:
        prod_d *= x
    return prod_s == prod_d and (len(lead_s) == 1 or len(lead_d) == 1)


def _product(views: CanonicalViews, value, left: _View, right: _View, low: str | None):
    """(factor, transposed) if the matmul `value` is factor * left @ right (transposed False)
    or its transpose (True), its operands rounded to `low`, else None."""
    if not _op(value, "relax.matmul"):
        return None
    x, y = (views.of(a) for a in value.args)
    if x.low != low or y.low != low:
        return None
    if x.same(left) and y.same(right):
        return x.factor * y.factor, False
    flip = (_View(right.base, not right.transposed, 1.0),
            _View(left.base, not left.transposed, 1.0))
    if x.same(flip[0]) and y.same(flip[1]):
        return x.factor * y.factor, True
    return None


@dataclasses.dataclass(frozen=True)
class _Forward:
    """The forward's operands as canonical views, and the scalars between the kernel's Q and
    K and the scores' operands."""

    p_soft: relax.Var  # softmax's output
    guard: relax.Expr | None  # of the where() zeroing -inf rows
    p: _View
    v: _View
    q: _View
    kt: _View
    q_scale: float
    k_scale: float


def _forward(match: AttentionMatch, bindings: dict, views: CanonicalViews) -> _Forward | None:
    values = {**match.values, match.output: bindings.get(match.output)}
    matmuls = [e for e in values.values() if _op(e, "relax.matmul")]
    softmax = [v for v, e in values.items() if _op(e, "relax.nn.softmax")]
    if len(matmuls) != 2 or len(softmax) != 1:
        return None
    p_soft = softmax[0]
    # The output's product reads the probabilities (or their zeroed rows); the scores' the
    # query and key operands.
    reads_p = [e for e in matmuls if views.of(e.args[0]).base.same_as(p_soft) or
               _zeroed(bindings, views.of(e.args[0]).base, p_soft) is not None]
    if len(reads_p) != 1:
        return None
    scores_mm = next(e for e in matmuls if e is not reads_p[0])
    p, v = (views.of(a) for a in reads_p[0].args)
    q, kt = (views.of(a) for a in scores_mm.args)
    # The transposes of K'^T (and of V' or Q') may sit below a broadcast of one key head to
    # all (multi-query attention): a view's base is then the broadcast, transposed or not.
    low = match.spec.operand_dtype
    if p.transposed or p.factor != 1.0 or v.factor != 1.0 or \
            any(x.low != low for x in (p, v, q, kt)):
        return None
    reader = _Reader(bindings)
    operands = reader.split(_scores_product_var(values, scores_mm))
    if operands is None:
        return None
    _, q_scale, _ = reader.scaled(operands[0], allow_transpose=False)
    _, k_scale, _ = reader.scaled(operands[1], allow_transpose=True)
    return _Forward(p_soft, _zeroed(bindings, p.base, p_soft), p, v, q, kt, q_scale, k_scale)


def find_attention_backward(match: AttentionMatch, bindings: dict, uses: dict,
                            views: CanonicalViews | None = None) -> BackwardMatch | None:
    """The backward of `match` that the fused backward kernels compute (dQ', dK' and dV', or
    those of them the step computes), or None (see the module doc). `bindings`: var -> value
    of the bindings of the dataflow block of the forward (one of `dataflow_bindings`): the
    backward must be in it too; `uses`: var -> the vars whose bindings read it; `views`: the
    block's canonical views (shared between its attentions)."""
    inputs = (match.q, match.k, match.v, *match.biases)
    if not all(_reachable(x, bindings) for x in inputs):
        return None
    views = views or CanonicalViews(bindings)
    fwd = _forward(match, bindings, views)
    if fwd is None:
        return None
    spec, low = match.spec, match.spec.operand_dtype
    backward = [(v, e) for v, e in bindings.items() if v not in match.values and
                v is not match.output and isinstance(e, relax.Call | relax.Var)]
    # M1: dP = dO V'^T, with dO unscaled and not transposed.
    m1 = [(v, e) for v, e in backward if _op(e, "relax.matmul") and
          views.of(e.args[1]).same(_View(fwd.v.base, not fwd.v.transposed, 1.0)) and
          views.of(e.args[0]).low == views.of(e.args[1]).low == low]
    if len(m1) != 1:
        return None
    m1_var, m1_value = m1[0]
    d_out = views.of(m1_value.args[0])
    if d_out.transposed or d_out.factor * views.of(m1_value.args[1]).factor != 1.0 or \
            views.of(m1_var).transposed or _dtype(d_out.base) != spec.dtype or \
            _lead(d_out.base) != spec.batch * spec.heads or \
            (_shape(d_out.base) or ())[-2:] != (spec.q_len, spec.value_dim) or \
            not _reachable(d_out.base, bindings):
        return None
    # M2: dV' = P^T dO (or its transpose)
    m2 = _products(views, backward, _View(fwd.p.base, True, 1.0), _View(d_out.base, False, 1.0),
                   low)
    if len(m2) > 1 or (m2 and m2[0][1][0] != 1.0):
        return None
    # dP of the softmax: dP itself, or where(guard, 0, dP) with zeroed rows
    dp_base = views.of(m1_var).base
    if fwd.guard is not None:
        wheres = [v for v, e in backward if _op(e, "relax.where") and
                  e.args[0].same_as(fwd.guard) and _scalar(e.args[1]) == 0.0 and
                  views.of(e.args[2]).plain(dp_base)]
        if len(wheres) != 1:
            return None
        dp_base = wheres[0]
    # P as softmax's gradient reads it: softmax's result, or (tvm_ext.models.masked_softmax)
    # its zeroed rows
    p_reads = (fwd.p_soft,) if fwd.guard is None else (fwd.p_soft, fwd.p.base)
    d_scores = _softmax_gradient(views, backward, dp_base, p_reads)
    if d_scores is None:
        return None
    ds, inner = d_scores
    # M3: dQ' = a dS K'; M4: dK' = a dS^T Q' (or its transpose)
    m3 = [(v, r) for v, r in _products(views, backward, _View(ds, False, 1.0),
                                        _View(fwd.kt.base, not fwd.kt.transposed, 1.0), low)
          if not r[1]]
    m4 = _products(views, backward, _View(ds, True, 1.0),
                   _View(fwd.q.base, fwd.q.transposed, 1.0), low)
    if len(m3) > 1 or len(m4) > 1 or not (m3 or m4):
        return None
    # A gradient the step does not compute has no product (its input is not trained): the
    # kernels' output goes unread. A product of a form not found fails _closed below.
    d_q, (f3, _) = m3[0] if m3 else (None, (1.0, False))
    d_k, (f4, k_t) = m4[0] if m4 else (None, (1.0, False))
    d_v, (_, v_t) = m2[0] if m2 else (None, (1.0, False))
    found = {x for x in (d_q, d_k, d_v) if x is not None}
    if any(_dtype(x) != spec.dtype for x in found) or \
            not _closed(views, backward, uses, {m1_var, *inner, ds}, found):
        return None
    # K'^T is kt.factor times its view of the base and k_scale times the kernel's K (repeated):
    # M3 = f3 dS (that view)^T = f3 k_scale / kt.factor dS K; likewise M4 with Q.
    bspec = BackwardSpec(spec, f3 * fwd.k_scale / fwd.kt.factor,
                         f4 * fwd.q_scale / fwd.q.factor)
    return BackwardMatch(match, bspec, d_out.base, d_q, d_k, k_t, d_v, v_t)


def _products(views: CanonicalViews, backward: list, left: _View, right: _View,
              low: str | None) -> list:
    """[(var, (factor, transposed))] of the matmuls of `backward` computing left @ right, their
    operands rounded to `low`."""
    found = [(v, _product(views, e, left, right, low)) for v, e in backward]
    return [(v, r) for v, r in found if r is not None]


def _closed(views: CanonicalViews, backward: list, uses: dict, region: set, exits: set) -> bool:
    """Whether nothing but `region`, its views and `exits` reads `region` or its views (the
    score-sized tensors of the backward die once the exits are the kernels')."""
    for var, e in backward:
        if var not in region and not _op(e, "relax.matmul") and views.of(var).base in region:
            region.add(var)
    return all(reader is not None and (reader in region or reader in exits)
               for var in region for reader in uses.get(var, ()))


def _reachable(expr, bindings: dict) -> bool:
    """Whether the block of `bindings` can read `expr`: not a var of another dataflow
    block."""
    return not isinstance(expr, relax.DataflowVar) or expr in bindings


def _lead(expr) -> int:
    """The product of the axes before the last two (0 for a tensor of rank < 2)."""
    shape = _shape(expr)
    if shape is None or len(shape) < 2:
        return 0
    out = 1
    for x in shape[:-2]:
        out *= x
    return out


def _zeroed(bindings: dict, expr, p_soft):
    """The guard of `expr` = where(guard, 0, p_soft) (PyTorch's zeroed rows), else None."""
    value = bindings.get(expr) if isinstance(expr, relax.Var) else None
    if _op(value, "relax.where") and value.args[2].same_as(p_soft):
        return value.args[0]
    return None


def _scores_product_var(values: dict, scores_mm):
    """The 4-D scores var of the scores' product: the matmul's var, or the reshape of it."""
    var = next(v for v, e in values.items() if e is scores_mm)
    if len(_shape(var) or ()) == 4:
        return var
    return next((v for v, e in values.items() if _op(e, "relax.reshape") and
                 e.args[0].same_as(var)), var)


def _softmax_gradient(views: CanonicalViews, backward: list, dp, p_reads: tuple):
    """(dS, its intermediates) for dS = P * (dP - sum(dP * P, -1, keepdims)) in `backward`, P
    read as one of `p_reads` (the same one in both products)."""
    def is_(expr, base) -> bool:
        return views.of(expr).plain(base)

    def pair(e, a_base, b_base) -> bool:
        x, y = e.args
        return (is_(x, a_base) and is_(y, b_base)) or (is_(y, a_base) and is_(x, b_base))

    for p in p_reads:
        t1 = [v for v, e in backward if _op(e, "relax.multiply") and pair(e, dp, p)]
        if len(t1) != 1:
            continue
        t2 = [v for v, e in backward if _op(e, "relax.sum") and e.args[0].same_as(t1[0]) and
              e.attrs.keepdims and e.attrs.axis is not None and
              [int(a) for a in e.attrs.axis] in ([-1], [3])]
        if len(t2) != 1:
            return None
        t3 = [v for v, e in backward if _op(e, "relax.subtract") and is_(e.args[0], dp) and
              e.args[1].same_as(t2[0])]
        if len(t3) != 1:
            return None
        ds = [v for v, e in backward if _op(e, "relax.multiply") and pair(e, t3[0], p)]
        if len(ds) != 1:
            return None
        return ds[0], (t1[0], t2[0], t3[0], dp)
    return None


def dataflow_bindings(func: relax.Function) -> list[dict]:
    """Per dataflow block of the function: var -> value of its bindings."""
    if not isinstance(func.body, relax.SeqExpr):
        return []
    return [{b.var: b.value for b in block.bindings if isinstance(b, relax.VarBinding)}
            for block in func.body.blocks if isinstance(block, relax.DataflowBlock)]

