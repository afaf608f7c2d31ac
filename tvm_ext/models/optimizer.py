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
argument (`tvm_ext.graph`).

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
from .base import Model, TensorSpec, kernels_of
from .mixed_precision import LossScaler

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


def update_kernel(opt: Optimizer, dtype: str, scaled: bool = False):
    """The TE function of one parameter's update: `(p, grad, *state, [step], [inv_scale,
    finite]) -> [p', *state']`. Each new value is its own stage, the state's first, so that
    every stage reads and writes the element it owns and the parameter is read by no stage
    after its own: the kernel may write each new value over the argument it replaces
    (`tvm_ext.ir.inplace_kernels`). `scaled` (float16 loss scaling): the gradient is
    multiplied by `inv_scale`, and where `finite` is 0 every value stays as it was."""
    def c(x: float) -> tirx.PrimExpr:
        return tirx.const(float(x), dtype)

    def split(extra):
        """(state, step, inv_scale, finite) from the arguments after p and grad."""
        extra = list(extra)
        scale = extra[-2:] if scaled else [None, None]
        extra = extra[:-2] if scaled else extra
        step = extra.pop() if opt.counts_steps else None
        return extra, step, *scale

    def kernel(p, grad, *extra):
        state, step, inv, finite = split(extra)

        def grad_at(i):
            """The gradient (unscaled), with coupled weight decay (SGD, Adam): torch's
            grad.add(p, alpha=wd)."""
            g = grad(*i) * inv().astype(dtype) if scaled else grad(*i)
            if opt.weight_decay and opt.kind != "adamw":
                return g + c(opt.weight_decay) * p(*i)
            return g

        def stage(new, old, name):
            """The stored value `new`, or `old` where the step is skipped (not finite)."""
            if not scaled:
                return te.compute(p.shape, new, name=name)
            return te.compute(p.shape, lambda *i: tirx.Select(
                finite() > tirx.const(0.0, finite.dtype), new(*i), old(*i)), name=name)

        return _STAGES[opt.kind](opt, c, p, grad_at, state, step, stage, dtype)
    return kernel


def _sgd(opt, c, p, grad_at, state, step, stage, dtype):
    return [stage(lambda *i: p(*i) + c(-opt.lr) * grad_at(i), p, "param")]


def _momentum(opt, c, p, grad_at, state, step, stage, dtype):
    (buf,) = state
    first = step() == tirx.const(1.0, step.dtype)
    buf_new = stage(lambda *i: tirx.Select(first, grad_at(i), buf(*i) * c(opt.momentum)
                                           + c(1.0 - opt.dampening) * grad_at(i)),
                    buf, "momentum_buffer")

    def param(*i):
        d = grad_at(i) + c(opt.momentum) * buf_new(*i) if opt.nesterov else buf_new(*i)
        return p(*i) + c(-opt.lr) * d
    return [stage(param, p, "param"), buf_new]


def _adam(opt, c, p, grad_at, state, step, stage, dtype):
    m, v = state
    neg_step_size, bias2_sqrt = _adam_scalars(opt, step, dtype)
    b1, b2 = opt.betas
    decay = opt.kind == "adamw" and opt.weight_decay
    # torch's lerp(m, g, 1 - beta1) for a weight below 0.5: m + w * (g - m).
    m_new = stage(lambda *i: m(*i) + c(1.0 - b1) * (grad_at(i) - m(*i)), m, "exp_avg")
    v_new = stage(lambda *i: v(*i) * c(b2) + c(1.0 - b2) * grad_at(i) * grad_at(i), v,
                  "exp_avg_sq")

    def param(*i):  # AdamW: p.mul_(1 - lr * wd) before the step
        decayed = p(*i) * c(1.0 - opt.lr * opt.weight_decay) if decay else p(*i)
        return decayed + neg_step_size * (m_new(*i) / (tirx.sqrt(v_new(*i)) / bias2_sqrt
                                                       + c(opt.eps)))
    return [stage(param, p, "param"), m_new, v_new]


_STAGES = {"sgd": _sgd, "momentum": _momentum, "adam": _adam, "adamw": _adam}


def _increment(step: te.Tensor, *finite: te.Tensor) -> te.Tensor:
    """step + 1 (+ finite: a skipped step does not count, as torch's GradScaler skips it)."""
    one = finite[0]() if finite else tirx.const(1.0, step.dtype)
    return te.compute((), lambda: step() + one, name="step_increment")


def _update_scale(scale: te.Tensor, tracker: te.Tensor, finite: te.Tensor,
                  scaler: LossScaler):
    """torch's GradScaler.update: back off after a non-finite step, grow after
    `growth_interval` finite ones in a row."""
    f32 = "float32"
    ok = finite() > tirx.const(0.0, f32)
    grown = tracker() + tirx.const(1.0, f32) >= tirx.const(float(scaler.growth_interval), f32)
    new_scale = te.compute((), lambda: tirx.Select(
        ok, tirx.Select(grown, scale() * tirx.const(scaler.growth_factor, f32), scale()),
        scale() * tirx.const(scaler.backoff_factor, f32)), name="loss_scale_new")
    new_tracker = te.compute((), lambda: tirx.Select(
        tirx.all(ok, tirx.Not(grown)), tracker() + tirx.const(1.0, f32),
        tirx.const(0.0, f32)), name="growth_tracker_new")
    return [new_scale, new_tracker]


# --------------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------------

def make_optimizer_step(step: Model, optimizer: Optimizer,
                        scaler: LossScaler | None = None) -> Model:
    """The training iteration of a training step `step` (see the module docstring):
    `main(inputs..., labels, params..., state...) -> (loss, params'..., state'...)`. A step
    that scales its loss (float16, `make_training_step(..., loss_scale=True)`) gets dynamic loss
    scaling (`scaler`, torch's GradScaler defaults): its scale and growth count are state."""
    if not step.training or "gradients" not in step.config:
        raise InputError(f"{step.name}: the optimizer step needs a training step "
                         "(make_training_step) to add the update to")
    by_name = {s.name: i for i, s in enumerate(step.params)}
    trainable = [by_name[n] for n in step.config["gradients"]]
    for i in trainable:
        dtype = step.params[i].dtype
        if dtype not in ("float16", "float32", "float64"):
            raise InputError(f"{step.name}: cannot update parameter {step.params[i].name} of "
                             f"dtype {dtype}")
    scaled = bool(step.config.get("loss_scaling"))
    scaler = (scaler or LossScaler()) if scaled else None
    inputs = step.inputs[:-1] if scaled else list(step.inputs)  # the scale is state here
    state_specs = _state_specs(step, trainable, optimizer, scaler)
    mod = _step_module(step, trainable, state_specs, optimizer, scaler)
    first = len(inputs) + len(step.params)  # the first state argument
    updates = [len(inputs) + i for i in trainable] + list(range(first,
                                                                first + len(state_specs)))
    mod["main"] = mod["main"].with_attr(UPDATES_ATTR, updates) \
        .with_attr(STATE_ATTR, len(state_specs))
    weights = None
    if step.weights is not None:
        weights = [*step.weights, *(s.sample(None) for s in state_specs)]
    config = dict(step.config, optimizer=optimizer.to_dict(), num_params=len(step.params),
                  state=[s.name for s in state_specs])
    if scaler is not None:
        config["loss_scaler"] = dataclasses.asdict(scaler)
    return Model(step.name, mod, inputs, [*step.params, *state_specs], True, config, weights)


def _state_specs(step: Model, trainable: list[int], opt: Optimizer,
                 scaler: LossScaler | None) -> list[TensorSpec]:
    specs = [TensorSpec(f"{step.params[i].name}.{name}", step.params[i].shape,
                        step.params[i].dtype, init="zeros")
             for name in opt.state_names for i in trainable]
    if opt.counts_steps:
        specs.append(TensorSpec("step", (), "float32", init="zeros"))
    if scaler is not None:
        specs += [TensorSpec("loss_scale", (), "float32", init="full", scale=scaler.init_scale),
                  TensorSpec("growth_tracker", (), "float32", init="zeros")]
    return specs


@dataclasses.dataclass
class _Emitted:
    """The values the updates read: the gradients' call, the step count, the scaling."""

    out: relax.Var
    count: relax.Var | None
    inv_scale: relax.Var | None
    finite: relax.Var | None


def _step_module(step: Model, trainable: list[int], state_specs: list[TensorSpec],
                 opt: Optimizer, scaler: LossScaler | None) -> tvm.IRModule:
    """The module of the optimizer step: `main` inlines the training step, then updates;
    the update kernels are its PrimFuncs."""
    grad_fn = step.main.without_attr("global_symbol")
    bb = relax.BlockBuilder(kernels_of(step.mod))  # the step may call kernels (dropout)
    gv = bb.add_func(grad_fn, "training_step")
    args = [relax.Var(p.name, p.ty) for p in grad_fn.params]
    state = [relax.Var(s.name, relax.TensorType(s.shape, s.dtype)) for s in state_specs]
    scaled = scaler is not None
    k = step.num_input - (1 if scaled else 0)  # inputs of the optimizer step
    inputs, params = args[:k], args[step.num_input:]
    n, per_param = len(trainable), len(opt.state_names)
    with bb.function("main", [*inputs, *params, *state]):
        with bb.dataflow():
            scale = [state[-2]] if scaled else []
            out = bb.emit(relax.Call(gv, [*inputs, *scale, *params]))
            loss = bb.emit(relax.TupleGetItem(out, 0))
            e = _Emitted(out, None, None, None)
            if scaled:
                e.inv_scale = bb.emit(relax.op.divide(relax.const(1.0, "float32"), scale[0]))
                e.finite = _all_finite(bb, [relax.TupleGetItem(out, j + 1) for j in range(n)])
                loss = bb.emit(relax.op.multiply(loss, e.inv_scale))
            if opt.counts_steps:
                step_var = state[per_param * n]
                e.count = bb.emit_te(_increment, step_var, *([e.finite] if scaled else []),
                                     primfunc_name_hint="step_increment")
            fields = [loss, *_updates(bb, step, trainable, params, state, opt, e, scaled)]
            if e.count is not None:
                fields.append(e.count)
            if scaled:
                new_scale = bb.emit_te(
                    lambda a, b, f: _update_scale(a, b, f, scaler), state[-2], state[-1],
                    e.finite, primfunc_name_hint="loss_scale_update")
                fields += [bb.emit(relax.TupleGetItem(new_scale, q)) for q in range(2)]
            result = bb.emit_output(relax.Tuple(fields))
        bb.emit_func_output(result)
    mod = bb.get()
    mod = relax.transform.InlinePrivateFunctions()(mod)
    mod = relax.transform.DeadCodeElimination(["main"])(mod)
    for gv, func in list(mod.functions_items()):
        if isinstance(func, tirx.PrimFunc):
            # Opaque: fusion leaves each update its own kernel, which planners can place
            # (and partition: ZeRO-style sharded state) apart from the gradient's.
            mod[gv] = func.with_attr("op_pattern", _OPAQUE)
    hints = (f"{opt.kind}_update", "step_increment", "loss_scale_update")
    main = _updates_early(mod["main"], {gv.name_hint for gv, f in mod.functions_items()
                                        if isinstance(f, tirx.PrimFunc)
                                        and gv.name_hint.startswith(hints)})
    mod["main"] = main.with_attr("global_symbol", "main").with_attr("num_input", k)
    return mod


_OPAQUE = 8  # relax's OpPatternKind kOpaque


def _updates_early(func: relax.Function, kernels: set[str]) -> relax.Function:
    """`func` with each update (a call of `kernels`, and what reads its result apart) placed
    right after its operands are made and every other reader of what it overwrites has run,
    so that each gradient dies at its update instead of at the end of the step."""
    (block,) = func.body.blocks
    movable = {}
    for b in block.bindings:
        value = b.value
        if isinstance(value, relax.Call) and value.op.same_as(tvm.ir.Op.get("relax.call_tir")) \
                and value.args[0].name_hint in kernels:
            movable[b.var] = b
        elif isinstance(value, relax.TupleGetItem) and value.tuple_value in movable:
            movable[b.var] = b
    readers: dict = {}  # argument -> bindings (not movable) that read it
    for b in block.bindings:
        if b.var not in movable:
            for v in relax.analysis.free_vars(b.value):
                readers.setdefault(v, set()).add(b.var)
    params = set(func.params)
    waiting: dict = {}  # var -> the movable bindings waiting for it
    unmet: dict = {}  # movable var -> how many of its dependencies are not yet defined
    for b in block.bindings:
        if b.var not in movable:
            continue
        used = relax.analysis.free_vars(b.value)
        deps = {*used, *(r for v in used if v in params for r in readers.get(v, ()))}
        deps -= params
        unmet[b.var] = len(deps)
        for v in deps:
            waiting.setdefault(v, []).append(b)
    position = {b.var: i for i, b in enumerate(block.bindings)}
    order, done = [], set()

    def define(var, ready: list) -> None:
        for m in waiting.get(var, ()):
            unmet[m.var] -= 1
            if unmet[m.var] == 0:
                ready.append(m)

    ready = [b for b in block.bindings if b.var in movable and unmet[b.var] == 0]
    for b in block.bindings:
        if b.var in movable:
            continue
        order.append(b)
        define(b.var, ready)
        # In rounds, as they become ready: each round in the order of the IR.
        while ready:
            batch = sorted(ready, key=lambda m: position[m.var])
            ready = []
            for m in batch:
                order.append(m)
                done.add(m.var)
                define(m.var, ready)
    pending = [b for b in block.bindings if b.var in movable and b.var not in done]
    order += pending
    seen = set(func.params)
    for b in order:  # every operand before its use, or keep the order as it was
        if not all(v in seen for v in relax.analysis.free_vars(b.value)):
            return func
        seen.add(b.var)
    body = relax.SeqExpr([relax.DataflowBlock(order)], func.body.body)
    return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)


def _all_finite(bb: relax.BlockBuilder, grads: list) -> relax.Var:
    """1.0 if every element of every gradient is finite, else 0.0 (a float32 scalar)."""
    flags = [bb.emit(relax.op.min(relax.op.astype(relax.op.isfinite(g), "float32")))
             for g in grads]
    flag = flags[0]
    for f in flags[1:]:
        flag = bb.emit(relax.op.minimum(flag, f))
    return flag


def _updates(bb, step: Model, trainable: list[int], params: list, state: list,
             opt: Optimizer, e: _Emitted, scaled: bool) -> list:
    """Emit every parameter's update; returns the new parameters, then the new state (per
    state name, per parameter)."""
    n, per_param = len(trainable), len(opt.state_names)
    new_params, new_state = [], [[None] * n for _ in range(per_param)]
    for j, i in enumerate(trainable):
        grad = bb.emit(relax.TupleGetItem(e.out, j + 1))
        kernel = update_kernel(opt, step.params[i].dtype, scaled)
        own = [state[q * n + j] for q in range(per_param)]
        extra = ([e.count] if e.count is not None else []) + \
            ([e.inv_scale, e.finite] if scaled else [])
        result = bb.emit_te(kernel, params[i], grad, *own, *extra,
                            primfunc_name_hint=f"{opt.kind}_update")
        if per_param == 0:  # one output: emit_te returns the tensor itself
            new_params.append(result)
            continue
        new_params.append(bb.emit(relax.TupleGetItem(result, 0)))
        for q in range(per_param):
            new_state[q][j] = bb.emit(relax.TupleGetItem(result, q + 1))
    return [*new_params, *(v for row in new_state for v in row)]
