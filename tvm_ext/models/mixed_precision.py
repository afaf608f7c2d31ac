"""Mixed precision training: GEMMs and convolutions in bfloat16 or float16, everything else,
the parameters (the master weights) and the optimizer state in float32.

`low_precision_step(step, "bfloat16")` rewrites a training step (`make_training_step`, after
differentiation, so the backward GEMMs are rewritten too): every matmul and convolution whose
operands are float32 takes them cast to the low dtype and accumulates in float32
(`out_dtype="float32"`), the policy of `relax.transform.ToMixedPrecision` (and of torch's
autocast) for these ops. TVM's pass itself is not used: it converts to float16 only, and it
fails on training graphs whose bindings include shapes ("Expected TensorType, but got
R.Shape", e.g. the zoo gpt's step), while these two rewrites are all it would do here.

Float16 overflows where bfloat16 does not, so a float16 step scales its loss (`make_training_step
(..., loss_scale=True)`: the loss is multiplied by a scale input before differentiating) and
its optimizer step (`make_optimizer_step`) does what torch's `GradScaler` does, in the graph:
gradients unscaled by 1/scale in the update kernels; if any is not finite the update is
skipped (parameters, state and step count unchanged) and the scale halved, else after every
2000 finite steps in a row it doubles (`LossScaler`). The scale and that count are optimizer
state; the step returns the unscaled loss.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import relax

from ..errors import InputError
from .base import Model
from .chunked_loss import reads_head

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
GEMM_OPS = ("relax.matmul", "relax.nn.conv1d", "relax.nn.conv2d", "relax.nn.conv3d",
          "relax.nn.conv1d_transpose", "relax.nn.conv2d_transpose")


@dataclasses.dataclass(frozen=True)
class LossScaler:
    """torch.amp.GradScaler's dynamic loss scaling (its defaults)."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


def compute_dtype(name: str) -> str:
    """"bf16" -> "bfloat16" (and "fp16", "fp32"; full names pass through)."""
    dtype = DTYPES.get(name, name)
    if dtype not in DTYPES.values():
        raise InputError(f"unknown compute dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return dtype


def low_precision_step(step: Model, dtype: str) -> Model:
    """`step` with its GEMMs and convolutions computed from `dtype` operands, accumulating in
    float32 (see the module docstring)."""
    dtype = compute_dtype(dtype)
    if not step.training:
        raise InputError(f"{step.name}: mixed precision applies to a training step")
    if dtype == "float32":
        return step
    if dtype == "float16" and not step.config.get("loss_scaling"):
        raise InputError(f"{step.name}: a float16 step needs loss scaling (make_training_step("
                         "..., loss_scale=True))")
    mod = _LowPrecisionGemms(step.mod, dtype).transform()
    config = dict(step.config, compute_dtype=dtype)
    return dataclasses.replace(step, mod=mod, config=config)


@relax.expr_functor.mutator
class _LowPrecisionGemms(relax.expr_functor.PyExprMutator):
    """matmul / convolution of float32 operands -> of `dtype` operands, out_dtype float32."""

    def __init__(self, mod: tvm.IRModule, dtype: str):
        super().__init__(mod)
        self.mod_, self.dtype = mod, dtype
        self.ops = {tvm.ir.Op.get(name) for name in GEMM_OPS}
        self.count = 0
        self.binding = ""  # the name of the binding being rewritten
        self.head_casts: dict = {}  # operand -> its cast, shared by a head's chunks

    def transform(self) -> tvm.IRModule:
        for gv, func in self.mod_.functions_items():
            if isinstance(func, relax.Function):
                self.builder_.update_func(gv, self.visit_expr(func))
        if not self.count:
            raise InputError("the training step has no float32 matmul or convolution to compute "
                             f"in {self.dtype}")
        return self.builder_.get()

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if not any(call.op.same_as(op) for op in self.ops):
            return call
        operands = call.args[:2]
        if not all(isinstance(a.ty, relax.TensorType) and str(a.ty.dtype) == "float32"
                   for a in operands):
            return call
        self.count += 1
        return float32_out(call, *[self._cast(a) for a in operands])

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.DataflowBlock:
        self.head_casts = {}  # (a cast is a value of its own block)
        return super().visit_dataflow_block_(block)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        self.binding = binding.var.name
        super().visit_var_binding_(binding)

    def _cast(self, operand: relax.Expr) -> relax.Expr:
        """`operand` in `dtype`; the head's weight cast once for all the chunks of a loss in
        chunks (tvm_ext.models.chunked_loss), not once a chunk."""
        if not (isinstance(operand, relax.Var) and reads_head(self.binding)):
            return self.builder_.emit(relax.op.astype(operand, self.dtype))
        if operand not in self.head_casts:
            self.head_casts[operand] = self.builder_.emit(relax.op.astype(operand, self.dtype))
        return self.head_casts[operand]


def float32_out(call: relax.Call, data: relax.Expr, weight: relax.Expr) -> relax.Expr:
    """`call` on new operands, accumulating and returning float32."""
    name = call.op.name.split(".")[-1]
    if name == "matmul":
        return relax.op.matmul(data, weight, out_dtype="float32")
    a = call.attrs
    kwargs = dict(strides=a.strides, padding=a.padding, dilation=a.dilation, groups=a.groups,
                  data_layout=a.data_layout, kernel_layout=a.kernel_layout,
                  out_layout=a.out_layout, out_dtype="float32")
    if name.endswith("_transpose"):
        kwargs["output_padding"] = a.output_padding
    return getattr(relax.op.nn, name)(data, weight, **kwargs)
