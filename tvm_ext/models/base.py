"""The `Model` every tvm_ext entry point works on, and the training-step builder.

A model is one Relax function `main(inputs..., params...)` with the `num_input` attribute, plus
the specs of its inputs and parameters (shape, dtype, how to draw random values). The training
step of a model is built from its forward function the same way whatever its source (zoo,
torch.export, ONNX): add a loss, decompose what has no gradient, differentiate with
`relax.transform.Gradient`, and return `(loss, grad_0, grad_1, ...)` flat.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np
import tvm
from tvm import relax

from ..runtime import random_arrays
from . import dropout, gradients
from .chunked_loss import chunk_logits_loss, interleave_chunks
from .masked_softmax import read_zeroed_rows, zeroed_row_softmaxes


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One argument of a model: its shape, dtype and how random values are drawn.

    init: "normal" (std `scale`), "uniform" ([-scale, scale]), "ones", "zeros", "full" (every
    element `scale`), or "randint" (integers in [0, high)).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    init: str = "normal"
    scale: float = 1.0
    high: int = 0

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def sample(self, rng: np.random.Generator) -> np.ndarray:
        try:
            return random_arrays.sample(rng, self.shape, self.dtype, self.init, self.scale,
                                        self.high)
        except ValueError as err:
            raise ValueError(f"{self.name}: {err}") from None


@dataclasses.dataclass
class Model:
    """A compiled-ready model: `mod["main"]` takes `inputs` then `params`."""

    name: str
    mod: tvm.IRModule
    inputs: list[TensorSpec]
    params: list[TensorSpec]
    training: bool = False
    config: dict = dataclasses.field(default_factory=dict)
    # Trained weights that came with the model (files); random parameters otherwise.
    weights: list[np.ndarray] | None = None

    @property
    def main(self) -> relax.Function:
        return self.mod["main"]

    @property
    def num_input(self) -> int:
        return len(self.inputs)

    @property
    def specs(self) -> list[TensorSpec]:
        return [*self.inputs, *self.params]

    @property
    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    def random_inputs(self, seed: int = 0) -> list[np.ndarray]:
        rng = np.random.default_rng(seed)
        return [s.sample(rng) for s in self.inputs]

    def random_params(self, seed: int = 0) -> list[np.ndarray]:
        """The model's own weights if it has them, else random values drawn per spec."""
        if self.weights is not None:
            return [np.array(w) for w in self.weights]
        rng = np.random.default_rng(seed + 1_000_003)
        return [s.sample(rng) for s in self.params]

    def random_arguments(self, seed: int = 0) -> list[np.ndarray]:
        """Inputs then parameters, as `main` takes them."""
        return [*self.random_inputs(seed), *self.random_params(seed)]

    def summary(self) -> dict:
        summary = {
            "name": self.name,
            "training": self.training,
            "inputs": [(s.name, list(s.shape), s.dtype) for s in self.inputs],
            "num_params": len(self.params),
            "param_bytes": self.param_bytes,
            "config": dict(self.config),
        }
        if self.training:
            summary["training_semantics"] = self.config.get("training_semantics", "n/a")
        return summary


def default_param_spec(name: str, shape: Sequence[int], dtype: str) -> TensorSpec:
    """A sensible random init for a parameter known only by name and shape."""
    shape = tuple(int(s) for s in shape)
    lowered = name.lower()
    if not dtype.startswith(("float", "bfloat")):
        return TensorSpec(name, shape, dtype, init="zeros")
    if "running_var" in lowered or lowered.endswith("_var") or "moving_var" in lowered:
        return TensorSpec(name, shape, dtype, init="ones")
    if "running_mean" in lowered or "moving_mean" in lowered:
        return TensorSpec(name, shape, dtype, init="zeros")
    if len(shape) <= 1:
        # Biases and norm scales: small random values, so that gradients are informative.
        return TensorSpec(name, shape, dtype, init="uniform", scale=0.1)
    fan_in = int(np.prod(shape[1:]))
    return TensorSpec(name, shape, dtype, init="normal", scale=1.0 / math.sqrt(max(fan_in, 1)))


def model_from_function(
    name: str,
    func: relax.Function,
    num_input: int,
    input_specs: Sequence[TensorSpec] | None = None,
    param_specs: Sequence[TensorSpec] | None = None,
    config: dict | None = None,
    module: tvm.IRModule | None = None,
) -> Model:
    """Wrap a forward Relax function (inputs first) as a `Model` named `main`; `module`: the
    one it came from, whose kernels it may call (`kernels_of`)."""
    func = func.with_attr("num_input", num_input).with_attr("global_symbol", "main")
    params = list(func.params)
    if input_specs is None:
        extents = _indexed_extents(func)
        input_specs = [_spec_of_var(v, init="normal", high=extents.get(v.name, 2))
                       for v in params[:num_input]]
    if param_specs is None:
        param_specs = [
            default_param_spec(v.name, _shape_of(v), str(v.ty.dtype)) for v in params[num_input:]
        ]
    if len(input_specs) + len(param_specs) != len(params):
        raise ValueError(
            f"{name}: {len(params)} function parameters but {len(input_specs)} input and "
            f"{len(param_specs)} parameter specs"
        )
    mod = with_main(func, module)
    return Model(name, mod, list(input_specs), list(param_specs), False, dict(config or {}))


def kernels_of(mod: tvm.IRModule | None) -> tvm.IRModule:
    """The PrimFuncs of `mod` (kernels a frontend made, such as dropout masks), without its
    Relax functions: a module to build a new `main` in."""
    if mod is None:
        return tvm.IRModule({})
    return tvm.IRModule({gv: f for gv, f in mod.functions_items()
                         if isinstance(f, tvm.tirx.PrimFunc)})


def with_main(func: relax.Function, kernels_from: tvm.IRModule | None = None) -> tvm.IRModule:
    """A module of `func` as `main` with the kernels of `kernels_from` it may call."""
    mod = kernels_of(kernels_from)
    mod["main"] = func
    return mod


def _shape_of(var: relax.Var) -> tuple[int, ...]:
    ty = var.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        raise ValueError(f"argument {var.name} is not a tensor of known shape: {ty}")
    try:
        return tuple(int(d) for d in ty.shape.values)
    except TypeError as err:
        raise ValueError(
            f"argument {var.name} has a symbolic shape {ty.shape}: tvm_ext plans static shapes only"
        ) from err


def _spec_of_var(var: relax.Var, init: str, high: int = 2) -> TensorSpec:
    """Integers are drawn in [0, high): token ids across the table they index, other integer
    inputs (masks) as 0 or 1."""
    dtype = str(var.ty.dtype)
    if var.name == dropout.SEED_INPUT:  # any seed: its own masks
        return TensorSpec(var.name, (), dtype, init="randint", high=2**31 - 1)
    if dtype.startswith("int") or dtype.startswith("uint"):
        return TensorSpec(var.name, _shape_of(var), dtype, init="randint", high=high)
    return TensorSpec(var.name, _shape_of(var), dtype, init=init)


# Ops whose result holds values of their first argument unchanged: ids reshaped on their way
# to a lookup are still ids.
_KEEPS_VALUES = ("relax.reshape", "relax.expand_dims", "relax.squeeze", "relax.permute_dims",
                 "relax.broadcast_to", "relax.flatten")


def _indexed_extents(func: relax.Function) -> dict[str, int]:
    """Parameter name -> the smallest extent of a table axis its values index (`take`) in
    `func`, for the parameters used as indices (possibly reshaped first)."""
    origin = {v: v.name for v in func.params}
    extents: dict[str, int] = {}
    body = func.body
    for block in getattr(body, "blocks", []):
        for binding in block.bindings:
            value = getattr(binding, "value", None)
            if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op) or \
                    not value.args:
                continue
            name = value.op.name
            if name == "relax.astype" and str(value.attrs.dtype).startswith(("int", "uint")):
                name = _KEEPS_VALUES[0]  # a cast between integer types (ids to int32)
            if name in _KEEPS_VALUES and value.args[0] in origin:
                origin[binding.var] = origin[value.args[0]]
            elif name == "relax.take" and value.args[1] in origin:
                extent = _axis_extent(value.args[0], value.attrs.axis)
                if extent is not None:
                    source = origin[value.args[1]]
                    extents[source] = min(extents.get(source, extent), extent)
    return extents


def _axis_extent(table: relax.Expr, axis) -> int | None:
    """The static extent of `table` along `axis` (all of it when None), else None."""
    ty = table.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    try:
        shape = [int(d) for d in ty.shape.values]
    except TypeError:
        return None
    return int(np.prod(shape)) if axis is None else shape[int(axis)]


# --------------------------------------------------------------------------------------------
# Training step
# --------------------------------------------------------------------------------------------

LOSSES = ("cross_entropy", "mse")


def make_training_step(
    model: Model,
    loss: str = "cross_entropy",
    trainable: Sequence[str] | None = None,
    num_classes: int | None = None,
    loss_scale: bool = False,
) -> Model:
    """The training step of `model`: `main(inputs..., labels, params...) -> (loss, grads...)`.

    The step computes the loss of the forward function as it stands, in the mode it was built or
    exported in: a batch norm built for inference (a torch module exported after `eval()`)
    normalizes with its running statistics, which stay fixed and get no gradient, as PyTorch's
    loss of the eval-mode module does; one built for training uses batch statistics. A
    train-mode export's dropouts apply the seeded masks of `dropout` (its `dropout_seed`
    input), so the step is deterministic for a seed.
    `config["training_semantics"]` records which: "eval", "train", "mixed" (both kinds of batch
    norm), or "n/a" (nothing depends on the mode).

    Args:
        model: a forward model; its first output (or only output) feeds the loss.
        loss: "cross_entropy" (labels are class indices over the last output axis) or "mse"
            (labels have the output's shape).
        trainable: names of the parameters to differentiate (default: all float parameters not
            named like running statistics).
        num_classes: the label range for cross entropy (default: the last output axis).
        loss_scale: take a scalar `loss_scale` input after the labels and differentiate the
            loss times it (float16 training, see `tvm_ext.models.mixed_precision`): the step
            returns the scaled loss and the scaled gradients.
    """
    if loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}; choose one of {LOSSES}")
    gradients.register_all()
    fwd = model.main.without_attr("global_symbol").with_attr("num_input", model.num_input)
    out_shape, out_dtype = _forward_output(model.name, fwd)
    label_spec = _label_spec(loss, out_shape, out_dtype, num_classes)
    if trainable is None:
        trainable = _default_trainable(model)
    trainable = set(trainable)
    scale_spec = [TensorSpec("loss_scale", (), "float32", init="ones")] if loss_scale else []
    mod = _decompose_for_training(_loss_module(model, fwd, loss, label_spec, out_shape,
                                               scale_spec))
    if loss == "cross_entropy" and not scale_spec:
        mod["main"] = chunk_logits_loss(mod["main"])  # large logits: head and loss in chunks
    num_input = model.num_input + 1 + len(scale_spec)  # the labels follow the inputs
    wrt = _params_to_differentiate(model.name, mod["main"], num_input, trainable)
    zeroed = zeroed_row_softmaxes(mod["main"])
    mod = _differentiate(model.name, mod, wrt)
    step = interleave_chunks(read_zeroed_rows(_flatten_return(mod["main_adjoint"]), zeroed))
    step = step.with_attr("global_symbol", "main").with_attr("num_input", num_input)
    grad_names = [v.name for v in wrt]
    config = dict(model.config, loss=loss, gradients=grad_names,
                  training_semantics=training_semantics(model), loss_scaling=loss_scale)
    return Model(
        model.name,
        with_main(step, mod),
        [*model.inputs, label_spec, *scale_spec],
        list(model.params),
        True,
        config,
        model.weights,
    )


def _forward_output(name: str, fwd: relax.Function) -> tuple[tuple[int, ...], str]:
    """The shape and dtype of the forward output that feeds the loss (the first of a tuple)."""
    out_ty = fwd.ret_ty
    if isinstance(out_ty, relax.TupleType):
        out_ty = out_ty.fields[0]
    if not isinstance(out_ty, relax.TensorType):
        raise ValueError(f"{name}: the forward output is not a tensor: {out_ty}")
    return tuple(int(d) for d in out_ty.shape.values), str(out_ty.dtype)


def _label_spec(loss: str, out_shape: tuple[int, ...], out_dtype: str,
                num_classes: int | None) -> TensorSpec:
    """The spec of the labels input: class indices for cross entropy, targets for mse."""
    if loss == "cross_entropy":
        classes = num_classes or out_shape[-1]
        return TensorSpec("labels", out_shape[:-1], "int64", init="randint", high=classes)
    return TensorSpec("labels", out_shape, out_dtype, init="normal")


def _default_trainable(model: Model) -> list[str]:
    """The names of the float parameters of `model` that are not running statistics."""
    return [
        p.name
        for p in model.params
        if p.dtype.startswith(("float", "bfloat")) and not _is_running_stat(p.name)
    ]


def _loss_module(model: Model, fwd: relax.Function, loss: str, label_spec: TensorSpec,
                 out_shape: tuple[int, ...], scale_spec: list[TensorSpec]) -> tvm.IRModule:
    """A module whose `main(inputs..., labels, [loss_scale], params...)` returns the loss of
    `fwd` (times the scale)."""
    bb = relax.BlockBuilder(kernels_of(model.mod))
    fwd_gv = bb.add_func(fwd, "forward")
    inputs = [relax.Var(s.name, relax.TensorType(s.shape, s.dtype)) for s in model.inputs]
    labels = relax.Var("labels", relax.TensorType(label_spec.shape, label_spec.dtype))
    scale = [relax.Var(s.name, relax.TensorType(s.shape, s.dtype)) for s in scale_spec]
    params = [relax.Var(s.name, relax.TensorType(s.shape, s.dtype)) for s in model.params]
    with bb.function("main", [*inputs, labels, *scale, *params]):
        with bb.dataflow():
            out = bb.emit(relax.Call(fwd_gv, [*inputs, *params]))
            if isinstance(fwd.ret_ty, relax.TupleType):
                out = bb.emit(relax.TupleGetItem(out, 0))
            value = _emit_loss(bb, loss, out, labels, out_shape)
            if scale:
                value = relax.op.multiply(bb.emit(value), scale[0])
            value = bb.emit_output(value)
        bb.emit_func_output(value)
    return bb.get()


def _decompose_for_training(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` with the forward inlined into `main` and its ops in forms Gradient handles."""
    mod = relax.transform.InlinePrivateFunctions()(mod)
    mod = relax.transform.DeadCodeElimination(["main"])(mod)
    mod = relax.transform.ConvertToDataflow()(mod)
    # DecomposeOpsForTraining gives every batch norm batch statistics, whatever its mode.
    mod = _ForTraining(mod).transform()
    return relax.transform.DecomposeOpsForTraining()(mod)


def _params_to_differentiate(name: str, main: relax.Function, num_input: int,
                             trainable: set[str]) -> list[relax.Var]:
    """The parameters of `main` after its `num_input` inputs that are in `trainable`."""
    wrt = [v for v in main.params[num_input:] if v.name in trainable]
    if not wrt:
        raise ValueError(f"{name}: no trainable parameter to differentiate")
    unsupported = sorted({str(v.ty.dtype) for v in wrt} - {"float16", "float32", "float64"})
    if unsupported:
        raise ValueError(f"{name}: cannot build the training step: relax.transform.Gradient "
                         f"differentiates float16/32/64 parameters only, not {unsupported}")
    return wrt


def _differentiate(name: str, mod: tvm.IRModule, wrt: list[relax.Var]) -> tvm.IRModule:
    """`mod` with `main_adjoint`, the gradient of `main` wrt `wrt`, or a ValueError saying why
    TVM could not build it."""
    try:
        return relax.transform.Gradient("main", require_grads=wrt)(mod)
    except tvm.error.InternalError as err:
        missing = re.search(r"FPrimalGradient has not been registered for (\S+)", str(err))
        if missing is None and "Differentiation of call_tir" in str(err):
            kernels = sorted({gv.name_hint for gv, f in mod.functions_items()
                              if isinstance(f, tvm.tirx.PrimFunc)})
            raise ValueError(f"{name}: cannot build the training step: the frontend wrote "
                             f"kernels that have no gradient ({', '.join(kernels[:6])}"
                             f"{' ...' if len(kernels) > 6 else ''})") from err
        if missing is None:
            raise
        raise ValueError(f"{name}: cannot build the training step: no gradient for "
                         f"{missing.group(1)}") from err
    except ValueError as err:  # a type error inside TVM's gradient rewrite
        reason = str(err).strip().splitlines()[-1]
        raise ValueError(f"{name}: cannot build the training step: "
                         f"relax.transform.Gradient failed: {reason}") from err


def training_semantics(model: Model) -> str:
    """"eval", "train", "mixed" or "n/a": how the training step of `model` normalizes (see
    `make_training_step`), from its batch norms and the mode a file was exported in."""
    modes = {"train" if bool(call.attrs.training) else "eval"
             for call in _calls_of(model.main, "relax.nn.batch_norm")}
    if model.config.get("export_mode"):
        modes.add(model.config["export_mode"])
    if not modes:
        return "n/a"
    return modes.pop() if len(modes) == 1 else "mixed"


def _calls_of(func: relax.Function, op_name: str) -> list[relax.Call]:
    op = tvm.ir.Op.get(op_name)
    calls: list[relax.Call] = []

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op.same_as(op):
            calls.append(expr)

    relax.analysis.post_order_visit(func, visit)
    return calls


@relax.expr_functor.mutator
class _ForTraining(relax.expr_functor.PyExprMutator):
    """Ops that `DecomposeOpsForTraining` leaves without a gradient or decomposes wrongly,
    written out in primitives: a batch norm in inference mode (it would get batch statistics),
    a group norm and an instance norm (they have no gradient)."""

    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.mod_ = mod
        self.batch_norm_ = tvm.ir.Op.get("relax.nn.batch_norm")
        self.group_norm_ = tvm.ir.Op.get("relax.nn.group_norm")
        self.instance_norm_ = tvm.ir.Op.get("relax.nn.instance_norm")

    def transform(self) -> tvm.IRModule:
        for gv, func in self.mod_.functions_items():
            if isinstance(func, relax.Function):
                self.builder_.update_func(gv, self.visit_expr(func))
        return self.builder_.get()

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if call.op.same_as(self.batch_norm_) and not bool(call.attrs.training):
            return self._inference_batch_norm(call)
        if call.op.same_as(self.group_norm_):
            return self._group_norm(call)
        if call.op.same_as(self.instance_norm_):
            return self._instance_norm(call)
        return call

    def _per_channel(self, v: relax.Expr, ndim: int, axis: int) -> relax.Expr:
        """A (C,) tensor broadcastable along `axis` of an `ndim`-d tensor."""
        others = [i for i in range(ndim) if i != axis]
        return self.builder_.emit(relax.op.expand_dims(v, others)) if others else v

    def _scale_shift(self, out, gamma, beta, attrs, ndim, axis):
        op = relax.op
        if attrs.scale:
            out = self.builder_.emit(op.multiply(out, self._per_channel(gamma, ndim, axis)))
        if attrs.center:
            out = self.builder_.emit(op.add(out, self._per_channel(beta, ndim, axis)))
        return out

    def _inference_batch_norm(self, call: relax.Call) -> relax.Expr:
        op, attrs, emit = relax.op, call.attrs, self.builder_.emit
        x, gamma, beta, mean, var = call.args
        ndim = len(x.ty.shape)
        axis = int(attrs.axis) % ndim
        eps = relax.const(float(attrs.epsilon), str(x.ty.dtype))
        inv_std = emit(op.rsqrt(op.add(var, eps)))
        centred = emit(op.subtract(x, self._per_channel(mean, ndim, axis)))
        out = emit(op.multiply(centred, self._per_channel(inv_std, ndim, axis)))
        out = self._scale_shift(out, gamma, beta, attrs, ndim, axis)
        return relax.Tuple([out, mean, var])

    def _group_norm(self, call: relax.Call) -> relax.Expr:
        op, attrs, emit = relax.op, call.attrs, self.builder_.emit
        x, gamma, beta = call.args
        shape = [int(d) for d in x.ty.shape.values]
        ndim = len(shape)
        axis = int(attrs.channel_axis) % ndim
        groups = int(attrs.num_groups)
        grouped = [*shape[:axis], groups, shape[axis] // groups, *shape[axis + 1 :]]
        spatial = [int(a) % ndim for a in attrs.axes]
        reduce = [axis + 1] + [a + 1 if a > axis else a for a in spatial]
        xg = emit(op.reshape(x, grouped))
        mean = emit(op.mean(xg, reduce, keepdims=True))
        var = emit(op.variance(xg, reduce, keepdims=True))
        eps = relax.const(float(attrs.epsilon), str(x.ty.dtype))
        normed = emit(op.multiply(op.subtract(xg, mean), op.rsqrt(op.add(var, eps))))
        out = emit(op.reshape(normed, shape))
        return self._scale_shift(out, gamma, beta, attrs, ndim, axis)

    def _instance_norm(self, call: relax.Call) -> relax.Expr:
        """Each channel of each sample normalised over `axes` (RAFT's feature encoder)."""
        op, attrs, emit = relax.op, call.attrs, self.builder_.emit
        x, gamma, beta = call.args
        ndim = len(x.ty.shape)
        axes = [int(a) % ndim for a in attrs.axes]
        mean = emit(op.mean(x, axes, keepdims=True))
        var = emit(op.variance(x, axes, keepdims=True))
        eps = relax.const(float(attrs.epsilon), str(x.ty.dtype))
        out = emit(op.multiply(op.subtract(x, mean), op.rsqrt(op.add(var, eps))))
        return self._scale_shift(out, gamma, beta, attrs, ndim, int(attrs.channel_axis) % ndim)


def _is_running_stat(name: str) -> bool:
    lowered = name.lower()
    return any(k in lowered for k in ("running_mean", "running_var", "moving_mean", "moving_var"))


def _emit_loss(bb, loss, out, labels, out_shape):
    op = relax.op
    if loss == "cross_entropy":
        classes = out_shape[-1]
        rows = int(np.prod(out_shape[:-1], dtype=np.int64))
        logits = bb.emit(op.reshape(out, (rows, classes))) if len(out_shape) != 2 else out
        flat_labels = bb.emit(op.reshape(labels, (rows,))) if len(out_shape) != 2 else labels
        logp = bb.emit(op.nn.log_softmax(logits, axis=-1))
        return op.nn.nll_loss(logp, flat_labels, reduction="mean")
    if str(out.ty.dtype) in ("float16", "bfloat16"):
        # A mean over more than 65504 terms has no float16 divisor; sum in float32 (as torch's
        # reduced-precision reductions accumulate), the loss float32 too.
        out, labels = bb.emit(op.astype(out, "float32")), bb.emit(op.astype(labels, "float32"))
    diff = bb.emit(op.subtract(out, labels))
    return op.mean(op.multiply(diff, diff))


def _flatten_return(func: relax.Function) -> relax.Function:
    """`(loss, (g0, g1, ...))` -> `(loss, g0, g1, ...)`."""
    body = func.body
    ret = body.body
    if (
        isinstance(ret, relax.Tuple)
        and len(ret.fields) == 2
        and isinstance(ret.fields[1], relax.Tuple)
    ):
        flat = relax.Tuple([ret.fields[0], *ret.fields[1].fields])
        ret_ty = relax.TupleType([f.ty for f in flat.fields])
        func = relax.Function(
            func.params, relax.SeqExpr(body.blocks, flat), ret_ty, func.is_pure, func.attrs
        )
        return relax.BlockBuilder().normalize(func)
    raise ValueError("unexpected return of relax.transform.Gradient: " + str(type(ret)))
