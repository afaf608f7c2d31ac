"""The optimizer update in the graph: one Relax function runs forward, loss, backward and the
update of every trainable parameter and its optimizer state, with torch.optim's semantics.

`make_optimizer_step(step, optimizer)` takes a training step (`make_training_step`:
`main(inputs..., labels, params...) -> (loss, grads...)`) and returns the model whose `main`
takes the optimizer state after the parameters,

    main(inputs..., labels, params..., state...) -> (loss, params'..., state'...)

and records in the function attribute `tvm_ext.updates` (`UPDATES_ATTR`) which argument each
output after the loss overwrites. The new values are computed by one element-wise kernel per
parameter (`update_kernel`, a TE compute of one block: every element is read and written at
the same index, so the kernel may write into the buffers it reads), and the pipeline makes
those writes land in the argument's own buffer (`tvm_ext.passes.UpdateArgumentsInPlace`, after
`CallTIRRewrite`): the compiled function returns the loss only, and no second copy of the
parameters or the state is ever allocated. Until then the function is pure and returns the new
values, so every pass before (fusion, partitioning, swapping) sees plain data dependencies;
the graph builder reads the attribute and makes each new value an in-place version of the
argument (`tvm_ext.ir.graph`).

Semantics follow `torch.optim` (torch 2.x, single-tensor path, `maximize=False`,
`amsgrad=False`), operation by operation in the parameter's dtype, scalars computed in double
as torch computes them in Python:

    sgd       g = grad + wd * p;  p -= lr * g
    momentum  g = grad + wd * p;  buf = g at step 1, else momentum * buf + (1 - dampening) * g
              p -= lr * (g + momentum * buf if nesterov else buf)
    adam      g = grad + wd * p (coupled); adamw: p *= 1 - lr * wd (decoupled)
              m = lerp(m, g, 1 - beta1);  v = v * beta2 + (1 - beta2) * g * g
              p += -(lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

The step count t is state (`step`, a float32 scalar as torch keeps it), incremented before the
updates read it; every parameter shares it (torch keeps one per parameter, all equal).
State tensors start at zero (`Model.random_params` gives zeros for them).
"""

from __future__ import annotations

import dataclasses
import math

import tvm
from tvm import relax, te, tirx

from ..errors import InputError
from ..ir.pass_records import STATE_ATTR, UPDATES_ATTR
from .base import Model, TensorSpec

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
# The state each optimizer keeps per parameter (torch's names), and whether it counts steps.
_STATE = {"sgd": (), "momentum": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq"),
          "adamw": ("exp_avg", "exp_avg_sq")}
_DEFAULT_LR = {"sgd": 0.01, "momentum": 0.01, "adam": 1e-3, "adamw": 1e-3}


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """An optimizer and its hyperparameters (compile-time constants of the step).

    kind: "sgd", "momentum" (SGD with momentum), "adam", "adamw". `lr` defaults to torch's
    (1e-3 for Adam/AdamW; 0.01 for SGD, which torch requires explicitly); `weight_decay`
    defaults to torch's (0, or 0.01 for AdamW).
    """

    kind: str = "adamw"
    lr: float | None = None
    momentum: float = 0.9
    dampening: float = 0.0
    nesterov: bool = False
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float | None = None

    def __post_init__(self):
        if self.kind not in OPTIMIZERS:
            raise InputError(f"unknown optimizer {self.kind!r}; optimizers: "
                             f"{', '.join(OPTIMIZERS)}")
        if self.lr is None:
            object.__setattr__(self, "lr", _DEFAULT_LR[self.kind])
        if self.weight_decay is None:
            object.__setattr__(self, "weight_decay", 0.01 if self.kind == "adamw" else 0.0)
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        problems = []
        if not (math.isfinite(self.lr) and self.lr >= 0):
            problems.append(f"lr {self.lr} (needs >= 0)")
        if self.weight_decay < 0:
            problems.append(f"weight_decay {self.weight_decay} (needs >= 0)")
        if self.eps < 0:
            problems.append(f"eps {self.eps} (needs >= 0)")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            problems.append(f"betas {self.betas} (needs two values in [0, 1))")
        if self.momentum < 0:
            problems.append(f"momentum {self.momentum} (needs >= 0)")
        if self.nesterov and (self.kind != "momentum" or self.dampening != 0):
            problems.append("nesterov (needs momentum SGD with dampening 0)")
        if problems:
            raise InputError(f"optimizer {self.kind}: invalid " + "; ".join(problems))

    @property
    def state_names(self) -> tuple[str, ...]:
        """The state kept per parameter, in argument order."""
        return _STATE[self.kind]

    @property
    def counts_steps(self) -> bool:
        """Whether the state includes the step count (every optimizer but plain SGD)."""
        return self.kind != "sgd"

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["betas"] = list(self.betas)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Optimizer:
        data = dict(data)
        data["betas"] = tuple(data.get("betas", (0.9, 0.999)))
        return cls(**data)

    def describe(self) -> str:
        parts = [f"lr {self.lr:g}"]
        if self.kind == "momentum":
            parts.append(f"momentum {self.momentum:g}")
            if self.dampening:
                parts.append(f"dampening {self.dampening:g}")
            if self.nesterov:
                parts.append("nesterov")
        if self.kind in ("adam", "adamw"):
            parts += [f"betas ({self.betas[0]:g}, {self.betas[1]:g})", f"eps {self.eps:g}"]
        if self.weight_decay:
            parts.append(f"weight decay {self.weight_decay:g}")
        return f"{self.kind} ({', '.join(parts)})"


# --------------------------------------------------------------------------------------------
# The update kernels
# --------------------------------------------------------------------------------------------

def _f64(x: float) -> tirx.PrimExpr:
    return tirx.const(float(x), "float64")


def _adam_scalars(opt: Optimizer, step: te.Tensor, dtype: str):
    """(-step_size, sqrt(1 - beta2^t)) in the parameter's dtype, computed in double from the
    step count as torch computes them in Python."""
    t = step().astype("float64")
    b1, b2 = opt.betas
    bias1 = _f64(1.0) - tirx.power(_f64(b1), t)
    bias2 = _f64(1.0) - tirx.power(_f64(b2), t)
    step_size = (_f64(opt.lr) / bias1).astype(dtype)
    return -step_size, tirx.sqrt(bias2).astype(dtype)


def update_kernel(opt: Optimizer, dtype: str):
    """The TE function of one parameter's update: `(p, grad, *state, [step]) -> [p', *state']`.
    Each new value is its own stage, the state's first, so that every stage reads and writes
    the element it owns and the parameter is read by no stage after its own: the kernel may
    write each new value over the argument it replaces (`tvm_ext.ir.inplace_kernels`)."""
    def c(x: float) -> tirx.PrimExpr:
        return tirx.const(float(x), dtype)

    def grad_at(p, grad, i):
        """The gradient with coupled weight decay (SGD, Adam): torch's grad.add(p, alpha=wd)."""
        if opt.weight_decay and opt.kind != "adamw":
            return grad(*i) + c(opt.weight_decay) * p(*i)
        return grad(*i)

    def sgd(p, grad):
        return [te.compute(p.shape, lambda *i: p(*i) + c(-opt.lr) * grad_at(p, grad, i),
                           name="param")]

    def momentum(p, grad, buf, step):
        first = step() == tirx.const(1.0, step.dtype)
        buf_new = te.compute(p.shape, lambda *i: tirx.Select(
            first, grad_at(p, grad, i),
            buf(*i) * c(opt.momentum) + c(1.0 - opt.dampening) * grad_at(p, grad, i)),
            name="momentum_buffer")

        def direction(i):
            if opt.nesterov:
                return grad_at(p, grad, i) + c(opt.momentum) * buf_new(*i)
            return buf_new(*i)
        p_new = te.compute(p.shape, lambda *i: p(*i) + c(-opt.lr) * direction(i), name="param")
        return [p_new, buf_new]

    def adam(p, grad, m, v, step):
        neg_step_size, bias2_sqrt = _adam_scalars(opt, step, dtype)
        b1, b2 = opt.betas
        decay = opt.kind == "adamw" and opt.weight_decay

        def decayed(i):  # AdamW: p.mul_(1 - lr * wd) before the step
            return p(*i) * c(1.0 - opt.lr * opt.weight_decay) if decay else p(*i)

        # torch's lerp(m, g, 1 - beta1) for a weight below 0.5: m + w * (g - m).
        m_new = te.compute(p.shape, lambda *i: m(*i) + c(1.0 - b1) * (
            grad_at(p, grad, i) - m(*i)), name="exp_avg")
        v_new = te.compute(p.shape, lambda *i: v(*i) * c(b2) + c(1.0 - b2) * grad_at(
            p, grad, i) * grad_at(p, grad, i), name="exp_avg_sq")
        p_new = te.compute(p.shape, lambda *i: decayed(i) + neg_step_size * (
            m_new(*i) / (tirx.sqrt(v_new(*i)) / bias2_sqrt + c(opt.eps))), name="param")
        return [p_new, m_new, v_new]

    return {"sgd": sgd, "momentum": momentum, "adam": adam, "adamw": adam}[opt.kind]


def _increment(step: te.Tensor) -> te.Tensor:
    return te.compute((), lambda: step() + tirx.const(1.0, step.dtype), name="step_increment")


# --------------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------------

def make_optimizer_step(step: Model, optimizer: Optimizer) -> Model:
    """The training iteration of a training step `step` (see the module docstring):
    `main(inputs..., labels, params..., state...) -> (loss, params'..., state'...)`."""
    if not step.training or "gradients" not in step.config:
        raise InputError(f"{step.name}: the optimizer step needs a training step "
                         "(make_training_step) to add the update to")
    grad_names = list(step.config["gradients"])
    by_name = {s.name: i for i, s in enumerate(step.params)}
    trainable = [by_name[n] for n in grad_names]
    for i in trainable:
        dtype = step.params[i].dtype
        if dtype not in ("float16", "float32", "float64"):
            raise InputError(f"{step.name}: cannot update parameter {step.params[i].name} of "
                             f"dtype {dtype}")
    state_specs = _state_specs(step, trainable, optimizer)
    mod = _step_module(step, trainable, state_specs, optimizer)
    num_params = len(step.params)
    n = len(trainable)
    updates = [step.num_input + i for i in trainable]
    per_param = optimizer.state_names
    updates += [step.num_input + num_params + k * n + j for k in range(len(per_param))
                for j in range(n)]
    if optimizer.counts_steps:
        updates.append(step.num_input + num_params + len(per_param) * n)
    mod["main"] = mod["main"].with_attr(UPDATES_ATTR, updates) \
        .with_attr(STATE_ATTR, len(state_specs))
    weights = None
    if step.weights is not None:
        weights = [*step.weights, *(s.sample(None) for s in state_specs)]
    config = dict(step.config, optimizer=optimizer.to_dict(), num_params=num_params,
                  state=[s.name for s in state_specs])
    return Model(step.name, mod, list(step.inputs),
                 [*step.params, *state_specs], True, config, weights)


def _state_specs(step: Model, trainable: list[int], opt: Optimizer) -> list[TensorSpec]:
    specs = [TensorSpec(f"{step.params[i].name}.{name}", step.params[i].shape,
                        step.params[i].dtype, init="zeros")
             for name in opt.state_names for i in trainable]
    if opt.counts_steps:
        specs.append(TensorSpec("step", (), "float32", init="zeros"))
    return specs


def _step_module(step: Model, trainable: list[int], state_specs: list[TensorSpec],
                 opt: Optimizer) -> tvm.IRModule:
    """The module of the optimizer step: `main` inlines the training step, then updates;
    the update kernels are its PrimFuncs."""
    grad_fn = step.main.without_attr("global_symbol")
    bb = relax.BlockBuilder()
    gv = bb.add_func(grad_fn, "training_step")
    args = [relax.Var(p.name, p.ty) for p in grad_fn.params]
    state = [relax.Var(s.name, relax.TensorType(s.shape, s.dtype)) for s in state_specs]
    params = args[step.num_input:]
    n = len(trainable)
    per_param = len(opt.state_names)
    with bb.function("main", [*args, *state]):
        with bb.dataflow():
            out = bb.emit(relax.Call(gv, args))
            loss = bb.emit(relax.TupleGetItem(out, 0))
            count = bb.emit_te(_increment, state[-1], primfunc_name_hint="step_increment") \
                if opt.counts_steps else None
            new_params, new_state = [], [[None] * n for _ in range(per_param)]
            for j, i in enumerate(trainable):
                grad = bb.emit(relax.TupleGetItem(out, j + 1))
                kernel = update_kernel(opt, step.params[i].dtype)
                own = [state[k * n + j] for k in range(per_param)]
                extra = [count] if count is not None else []
                result = bb.emit_te(kernel, params[i], grad, *own, *extra,
                                    primfunc_name_hint=f"{opt.kind}_update")
                if per_param == 0:  # one output: emit_te returns the tensor itself
                    new_params.append(result)
                    continue
                new_params.append(bb.emit(relax.TupleGetItem(result, 0)))
                for k in range(per_param):
                    new_state[k][j] = bb.emit(relax.TupleGetItem(result, k + 1))
            fields = [loss, *new_params, *(v for row in new_state for v in row)]
            if count is not None:
                fields.append(count)
            result = bb.emit_output(relax.Tuple(fields))
        bb.emit_func_output(result)
    mod = bb.get()
    mod = relax.transform.InlinePrivateFunctions()(mod)
    mod = relax.transform.DeadCodeElimination(["main"])(mod)
    mod["main"] = mod["main"].with_attr("global_symbol", "main") \
        .with_attr("num_input", step.num_input)
    return mod
