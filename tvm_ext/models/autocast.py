"""Inference in bfloat16 or float16 with torch.autocast's semantics (`--dtype bf16|fp16`
without `--training`).

`autocast_inference(model, "bfloat16")` rewrites the inference function op by op, as CUDA's
autocast dispatches them:

* GEMMs and convolutions (`relax.matmul`, `relax.nn.conv*`) take their floating operands cast
  to the low dtype and accumulate in float32 (`out_dtype="float32"`); their result is rounded to
  the low dtype once, after the bias add that follows them where there is one (an add of one
  value per output channel computed from the weights alone: torch's `linear` / `addmm` /
  convolutions add the bias inside the low-precision op). A consumer that computes in float32
  anyway (a softmax of attention scores) reads the float32 result before rounding.
* Softmax, log-softmax, the norms, exp / log / pow / rsqrt, sums, means and the variance, the
  losses: float32 operands, float32 results.
* Every other op runs in the dtype its operands have; an op given tensors of two float dtypes
  computes in the wider one (torch's type promotion: a 0-d tensor takes the other operands'
  dtype instead).

The parameters stay float32 (cast where a GEMM reads them, as autocast does) and the module's
outputs have the dtype this gives them (logits out of a GEMM in the low dtype; the hidden states
after a norm in float32), as PyTorch's under autocast have.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import relax

from ..errors import InputError
from .base import Model
from .mixed_precision import GEMM_OPS, compute_dtype, float32_out

_FLOAT32_OPS = (
    "relax.nn.softmax", "relax.nn.log_softmax", "relax.nn.layer_norm", "relax.nn.group_norm",
    "relax.nn.rms_norm", "relax.nn.batch_norm", "relax.nn.instance_norm",
    "relax.nn.cross_entropy_with_logits", "relax.nn.nll_loss", "relax.exp", "relax.log",
    "relax.power", "relax.rsqrt", "relax.sum", "relax.mean", "relax.prod", "relax.variance",
    "relax.std", "relax.cumsum", "relax.cumprod", "relax.tan", "relax.sinh", "relax.cosh",
    "relax.asin", "relax.acos", "relax.nn.softplus",
)


def _ops(names) -> list[tvm.ir.Op]:
    ops = []
    for name in names:
        try:
            ops.append(tvm.ir.Op.get(name))
        except (AttributeError, ValueError):  # an op this TVM does not have (Op.get)
            pass
    return ops


def autocast_inference(model: Model, dtype: str) -> Model:
    """`model` (inference) computing with autocast's policy in `dtype` (see the module
    docstring); float32 returns it unchanged."""
    dtype = compute_dtype(dtype)
    if model.training:
        raise InputError(f"{model.name}: autocast applies to inference; a training step "
                         "takes --dtype with --optimizer (mixed precision training)")
    if dtype == "float32":
        return model
    rewriter = _Autocast(model.mod, dtype, model.num_input)
    mod = rewriter.transform()
    if not rewriter.gemms:
        raise InputError(f"{model.name}: no matmul or convolution to compute in {dtype}: "
                         "--dtype changes nothing on this model")
    config = dict(model.config, compute_dtype=dtype, autocast=True)
    return dataclasses.replace(model, mod=mod, config=config)


def _float_dtype(expr: relax.Expr) -> str | None:
    ty = getattr(expr, "ty", None)
    if isinstance(ty, relax.TensorType) and str(ty.dtype).startswith(("float", "bfloat")):
        return str(ty.dtype)
    return None


def _ndim(expr: relax.Expr) -> int:
    return int(expr.ty.ndim)


def _channel_axis(gemm: relax.Call) -> int:
    """The axis of a GEMM's output channels, from the last: a matmul's last; a convolution's
    `C` of its output layout."""
    if gemm.op.name == "relax.matmul":
        return -1
    layout = str(gemm.attrs.out_layout)
    return layout.index("C") - len(layout)


def _is_bias(other: relax.Expr, gemm: relax.Expr, axis: int) -> bool:
    """Whether `other`, added to the GEMM result `gemm`, is a bias: one value per output
    channel, the same at every other position (what torch adds inside the GEMM). Anything else
    computed from the weights alone (RAFT's constant pixel grid added to a predicted flow) is an
    add of its own, after autocast has rounded the GEMM's result."""
    shape = getattr(other.ty, "shape", None)
    if not isinstance(shape, relax.ShapeExpr) or _ndim(other) > _ndim(gemm):
        return False
    for i, extent in enumerate(shape.values):
        from_last = i - len(shape.values)
        if from_last != axis and not (isinstance(extent, tvm.tirx.IntImm) and
                                      int(extent) == 1):
            return False
    return True


@relax.expr_functor.mutator
class _Autocast(relax.expr_functor.PyExprMutator):
    """Rewrites `main` binding by binding; `pending` holds the float32 results of GEMMs (and of
    their bias adds) that are still to be rounded to the low dtype, each with the axis of its
    output channels (negative, from the last)."""

    def __init__(self, mod: tvm.IRModule, dtype: str, num_input: int):
        super().__init__(mod)
        self.mod_, self.dtype, self.num_input = mod, dtype, num_input
        self.gemm_ops = _ops(GEMM_OPS)
        self.float32_ops = _ops(_FLOAT32_OPS)
        self.add = tvm.ir.Op.get("relax.add")
        self.gemms = 0
        self.pending: dict = {}  # new var -> channel axis: float32 values autocast rounds
        self.rounded: dict = {}  # pending var -> its low-dtype cast
        self.weights: set = set()  # vars (old and new) computed from the parameters alone

    def transform(self) -> tvm.IRModule:
        main = self.mod_["main"]
        self.weights.update(main.params[self.num_input:])
        self.builder_.update_func(self.mod_.get_global_var("main"), self.visit_expr(main))
        return self.builder_.get()

    def _is(self, call: relax.Expr, ops) -> bool:
        return isinstance(call, relax.Call) and any(call.op.same_as(op) for op in ops)

    def _round(self, var: relax.Expr) -> relax.Expr:
        """The low-dtype value of `var` (a pending GEMM result is cast once)."""
        if var not in self.pending:
            return var
        if var not in self.rounded:
            self.rounded[var] = self.builder_.emit(relax.op.astype(var, self.dtype))
        return self.rounded[var]

    def _cast(self, expr: relax.Expr, dtype: str) -> relax.Expr:
        src = _float_dtype(expr)
        if src is None or src == dtype:
            return expr
        return self.builder_.emit(relax.op.astype(expr, dtype))

    def _remap(self, expr: relax.Expr) -> relax.Expr:
        """`expr` (a call's operand: a leaf in A-normal form) over the rewritten variables,
        not yet normalized (its dtypes may not agree before the casts)."""
        if isinstance(expr, relax.Var):
            new = self.get_var_remap(expr)
            return expr if new is None else new
        if isinstance(expr, relax.Tuple):
            return relax.Tuple([self._remap(f) for f in expr.fields])
        return expr

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        old = binding.value
        if isinstance(old, relax.Call) and isinstance(old.op, tvm.ir.Op):
            value = relax.Call(old.op, [self._remap(a) for a in old.args], old.attrs,
                               old.ty_args)
        else:
            value = self.visit_expr(old)
        free = relax.analysis.free_vars(binding.value)
        if all(v in self.weights for v in free):  # (constants too)
            self.weights.add(binding.var)
        value, pending = self._rewrite(value)
        if pending is not None and not isinstance(binding.var, relax.DataflowVar):
            # A function output is what autocast returns: rounded.
            value = relax.op.astype(self.builder_.emit(value), self.dtype)
            pending = None
        value = self.builder_.normalize(value)
        new = type(binding.var)(binding.var.name, value.ty)
        self.builder_.emit_normalized(relax.VarBinding(new, value))
        self.set_var_remap(binding.var, new)
        if pending is not None:
            self.pending[new] = pending
        if binding.var in self.weights:
            self.weights.add(new)

    def _rewrite(self, value: relax.Expr) -> tuple[relax.Expr, int | None]:
        """(the autocast value of the visited binding value, its channel axis if it is
        pending, else None)."""
        if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
            return self._round_fields(value), None
        args = list(value.args)
        if self._is(value, self.gemm_ops) and all(_float_dtype(a) for a in args[:2]):
            self.gemms += 1
            low = [self._cast(a, self.dtype) for a in (self._round(a) for a in args[:2])]
            return float32_out(value, *low), _channel_axis(value)
        if self._is(value, [self.add]) and len(args) == 2:
            for gemm, other in ((args[0], args[1]), (args[1], args[0])):
                if gemm in self.pending and other in self.weights and _float_dtype(other) \
                        and _is_bias(other, gemm, self.pending[gemm]):
                    return relax.op.add(gemm, self._cast(other, "float32")), self.pending[gemm]
        if self._is(value, self.float32_ops):
            args = [self._cast(a, "float32") for a in args]  # a pending value is float32
            return relax.Call(value.op, args, value.attrs, value.ty_args), None
        args = [self._round_fields(a) for a in args]
        return relax.Call(value.op, self._promoted(args), value.attrs, value.ty_args), None

    def _round_fields(self, expr: relax.Expr) -> relax.Expr:
        if isinstance(expr, relax.Tuple):
            return relax.Tuple([self._round_fields(f) for f in expr.fields])
        return self._round(expr)

    def _promoted(self, args: list) -> list:
        """Operands of one op in two float dtypes -> all in the wider (float32 if any tensor
        of rank > 0 is; 0-d tensors take the others' dtype)."""
        flat = [f for a in args for f in (a.fields if isinstance(a, relax.Tuple) else [a])]
        dtypes = {_float_dtype(f) for f in flat} - {None}
        if len(dtypes) < 2:
            return args
        ranked = {_float_dtype(f) for f in flat if _float_dtype(f) and _ndim(f) != 0}
        wide = "float32" if "float32" in (ranked or dtypes) else self.dtype
        out = []
        for a in args:
            if isinstance(a, relax.Tuple):
                out.append(relax.Tuple([self._cast(f, wide) for f in a.fields]))
            else:
                out.append(self._cast(a, wide))
        return out
