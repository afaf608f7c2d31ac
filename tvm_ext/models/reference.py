"""PyTorch eager as the reference of a model loaded from a torch `ExportedProgram` (.pt2).

`torch_reference(path, inputs, params, param_names)` runs `torch.export.load(path).module()` on
the same numpy inputs and parameters the compiled module gets, and returns its tensor outputs
flattened in order, as numpy arrays; `torch_training_step` does the same for the training step
`make_training_step` builds (loss of the first output, then the gradients, by autograd).

Parameters are matched by name: the Relax frontend names each parameter argument after the
exported program's placeholder (`spec.arg.name`, e.g. `p_fc1_weight`) and keeps the graph
signature's order, which maps each placeholder to its state-dict key (`spec.target`, e.g.
`fc1.weight`). Buffers and constants are bound into the Relax module from the same file, so
torch uses its own copies of them.

Tolerances (`tolerance(dtype)`): TVM and PyTorch run different kernels (another summation
order, other fused multiply-adds), so the comparison allows a few ulps of the result's dtype
accumulated over a reduction, not bit equality:

    float64            rtol 1e-7   atol 1e-9
    float32            rtol 1e-4   atol 1e-5
    float16            rtol 1e-2   atol 1e-3
    bfloat16           rtol 5e-2   atol 1e-2
    integers, bool     exact

`compile.py --check --rtol R --atol A` replaces them for every output.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import os
from collections.abc import Sequence

import numpy as np

from ..errors import require
from . import dropout, pt2_files, selection_ties

TOLERANCES = {
    "float64": (1e-7, 1e-9),
    "float32": (1e-4, 1e-5),
    "float16": (1e-2, 1e-3),
    "bfloat16": (5e-2, 1e-2),
}


def tolerance(dtype, least: tuple[float, float] | None = None) -> tuple[float, float]:
    """(rtol, atol) for comparing an output of `dtype` with PyTorch eager, at least `least`
    for a float output (an autocast model's float32 outputs carry its low dtype's roundings);
    integer and boolean outputs are exact."""
    try:
        name = np.dtype(dtype).name
    except TypeError:  # bfloat16 without ml_dtypes registered
        name = str(dtype)
    rtol, atol = TOLERANCES.get(name, (0.0, 0.0))
    if least is None or name not in TOLERANCES:
        return rtol, atol
    return max(rtol, least[0]), max(atol, least[1])


def torch_reference(
    path: str,
    inputs: Sequence[np.ndarray],
    params: Sequence[np.ndarray] = (),
    param_names: Sequence[str] = (),
    autocast: str | None = None,
    float64: bool = False,
) -> list[np.ndarray]:
    """Outputs of the exported program in `path`, run eagerly on `inputs` (its user inputs in
    order) with `params` (named by their Relax argument names) in place of its weights; under
    `torch.autocast` to `autocast` ("bfloat16", "float16") where given; `float64`: its float32
    weights, buffers and inputs in float64 (a closer answer to judge float32 noise by)."""
    torch = _torch()

    cast = contextlib.nullcontext() if autocast is None else torch.autocast(
        "cpu", dtype=getattr(torch, autocast))
    with torch.no_grad(), cast:
        return [_to_numpy(t) for t in _run(path, inputs, params, param_names,
                                             autocast=autocast is not None,
                                             float64=float64)[0]]


def torch_training_step(
    path: str,
    inputs: Sequence[np.ndarray],
    labels: np.ndarray,
    params: Sequence[np.ndarray],
    param_names: Sequence[str],
    gradients: Sequence[str],
    loss: str = "mse",
    float64: bool = False,
) -> list[np.ndarray]:
    """`[loss, *grads]`: the loss of the first output against `labels` and its gradients with
    respect to the parameters named in `gradients`, in that order (`float64`: as
    `torch_reference`'s)."""
    args = (path, inputs, labels, params, param_names, gradients, loss, float64)
    try:
        return _training_step(*args, functional=False)
    except RuntimeError as err:
        # A program exported without gradients may write into a tensor autograd saved (RWKV's
        # state, updated in place along the sequence); its functional form computes the same.
        if "modified by an inplace operation" not in str(err):
            raise
        return _training_step(*args, functional=True)


def _training_step(path, inputs, labels, params, param_names, gradients, loss, float64,
                   functional: bool) -> list[np.ndarray]:
    torch = _torch()

    outputs, weights = _run(path, inputs, params, param_names, requires_grad=gradients,
                            float64=float64, functional=functional)
    out, target = outputs[0], _widened(_to_torch(labels), float64)
    if loss == "mse":  # in float32 for reduced-precision outputs, as the compiled step
        if out.dtype in (torch.float16, torch.bfloat16):
            out, target = out.float(), target.float()
        value = ((out - target) ** 2).mean()
    elif loss == "cross_entropy":
        value = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]),
                                                  target.reshape(-1))
    else:
        raise ValueError(f"unknown loss {loss!r}")
    wrt = [weights[n] for n in gradients]
    # A parameter the graph never reads (e.g. a tied weight exported twice) has no gradient in
    # torch; its gradient is zero, which the compiled step must give too.
    grads = torch.autograd.grad(value, wrt, allow_unused=True)
    grads = [torch.zeros_like(w) if g is None else g for w, g in zip(wrt, grads, strict=True)]
    return [_to_numpy(value), *(_to_numpy(g) for g in grads)]


def torch_optimizer(optimizer, tensors):
    """The `torch.optim` optimizer of a `tvm_ext.models.optimizer.Optimizer` over `tensors`
    (single-tensor path, as the compiled update follows)."""
    torch = _torch()

    o = optimizer
    if o.kind in ("sgd", "momentum"):
        return torch.optim.SGD(tensors, lr=o.lr, momentum=o.momentum if o.kind == "momentum"
                               else 0.0, dampening=o.dampening, nesterov=o.nesterov,
                               weight_decay=o.weight_decay, foreach=False)
    cls = torch.optim.Adam if o.kind == "adam" else torch.optim.AdamW
    return cls(tensors, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
               foreach=False)


# A gradient element this far below the largest gradient of its step is rounding noise: two
# correct implementations may differ in its sign (e.g. a key bias, whose exact gradient through
# softmax is zero), and Adam's normalisation turns either sign into a step of lr.
NOISE_FLOOR = 1e-6


@dataclasses.dataclass
class OptimizerSteps:
    """What `optimizer_steps` returns: the loss of each step, the parameters and the state
    after (state in `make_optimizer_step`'s argument order: per state name, per trainable
    parameter, then the step count), and per parameter where its gradient was rounding noise
    in some step (see NOISE_FLOOR; None for a parameter that is not trained)."""

    losses: list[float]
    params: list[np.ndarray]
    state: list[np.ndarray]
    noise: list[np.ndarray | None]


def optimizer_steps(gradient, params: Sequence[np.ndarray], trainable: Sequence[int],
                    optimizer, batches: Sequence,
                    state: Sequence[np.ndarray] | None = None) -> OptimizerSteps:
    """`len(batches)` steps of `torch.optim` from `params` and zero state, as torch starts, or
    from `state` (in the step's argument order, its count the steps it has taken):
    `gradient(params, batch)` gives (loss, gradients of the parameters at `trainable`), the
    optimizer updates those."""
    torch = _torch()

    values = [_to_torch(p, copy=True) for p in params]
    opt = torch_optimizer(optimizer, [values[i] for i in trainable])
    taken = int(np.asarray(state[-1])) if state is not None and optimizer.counts_steps else 0
    if taken:  # torch sets its state up on the first step: from zero state it is its own
        m = len(trainable)
        for s, name in enumerate(optimizer.state_names):
            for j, i in enumerate(trainable):
                opt.state[values[i]][name] = _to_torch(state[s * m + j], copy=True)
        if optimizer.kind in ("adam", "adamw"):
            for i in trainable:
                opt.state[values[i]]["step"] = torch.tensor(float(taken))
    losses = []
    noise: list = [None] * len(values)
    for batch in batches:
        loss, grads = gradient([_to_numpy(v) for v in values], batch)
        losses.append(float(loss))
        grads = [np.asarray(g, dtype=np.float64) for g in grads]
        floor = NOISE_FLOOR * max((float(np.abs(g).max()) for g in grads if g.size),
                                  default=0.0)
        for i, g in zip(trainable, grads, strict=True):
            below = np.abs(g) <= floor
            noise[i] = below if noise[i] is None else noise[i] | below
            values[i].grad = _to_torch(g.astype(np.asarray(params[i]).dtype), copy=True)
        with torch.no_grad():
            opt.step()
    after = []
    for name in optimizer.state_names:
        after += [_to_numpy(opt.state[values[i]][name]) for i in trainable]
    if optimizer.counts_steps:  # torch's SGD keeps no count: the steps taken
        after.append(np.asarray(taken + len(batches), dtype=np.float32))
    return OptimizerSteps(losses, [_to_numpy(v) for v in values], after, noise)


def file_weight_mismatches(path: str, params: Sequence[np.ndarray],
                           param_names: Sequence[str]) -> list[str]:
    """State-dict keys whose value in `path` differs from the parameter given under that name:
    a sign that the weights were attached to the wrong arguments."""
    program = _load(path)
    targets = _parameter_targets(program, list(param_names), len(params))
    bad = []
    for target, p in zip(targets, params, strict=True):
        own = _to_numpy(program.state_dict[target])
        if own.shape != np.shape(p) or not np.array_equal(own, p):
            bad.append(target)
    return bad


def has_batch_norm(path: str) -> bool:
    """Whether the program has a batch norm (whose statistics depend on the mode)."""
    return any("batch_norm" in _op_name(node) for node in _calls(_load(path)))


# Ops that draw random numbers when PyTorch runs them; the compiled module leaves dropout out.
_RANDOM_OPS = {"bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like", "randint",
               "randint_like", "randperm", "normal", "normal_", "uniform", "uniform_",
               "multinomial", "exponential_", "geometric_", "poisson"}
# Dropouts the compiled module does not apply (whole channels, alpha): random in PyTorch.
_UNSEEDED_DROPOUTS = {"feature_dropout", "alpha_dropout"}


def random_ops(path: str) -> list[str]:
    """The ops of the program that are random in eager mode and the compiled module does not
    reproduce (a sampling op, a dropout of channels exported in train mode): PyTorch's
    outputs then differ from run to run. A train-mode dropout is not one: both apply the
    seeded mask of `dropout`."""
    found = []
    for node in _calls(_load(path)):
        name = _op_name(node)
        if name in _UNSEEDED_DROPOUTS and dropout.active(node) is not None:
            found.append(name)
        elif name in _RANDOM_OPS:
            found.append(name)
    return sorted(set(found))


def _active_dropouts(program) -> list:
    """The dropout nodes that drop (train mode, p > 0), in graph order."""
    return [n for n in program.graph.nodes if n.op == "call_function"
            and _op_name(n) in dropout.OPS and dropout.active(n) is not None]


class _SeededDropout:
    """A dropout node of the program run with the seeded mask the compiled module applies."""

    __name__ = "seeded_dropout"

    def __init__(self, seed: int, op: int, p: float, returns_kept: bool):
        self.seed, self.op, self.p, self.returns_kept = seed, op, p, returns_kept

    def __call__(self, x, *_args, **_kwargs):
        torch = _torch()
        mask = torch.from_numpy(dropout.mask_numpy(self.seed, self.op, tuple(x.shape),
                                                   self.p)).to(x.dtype)
        out = x * mask
        return (out, mask != 0) if self.returns_kept else out


def _with_seeded_dropouts(program, inputs: list) -> tuple[object, list]:
    """(the program's module, its inputs) with each train-mode dropout applying the seeded
    mask of `dropout` (the last input, `dropout_seed`, is the seed), numbered as the import
    numbers them: in the order of the decomposed program."""
    if not _active_dropouts(program):
        return program.module(), inputs
    decomposed = program.run_decompositions()
    seed = int(np.asarray(inputs[-1]))
    module = decomposed.module()
    for op, node in enumerate(_active_dropouts(module)):
        node.target = _SeededDropout(seed, op, dropout.active(node),
                                     _op_name(node) == "native_dropout")
    module.recompile()
    return module, inputs[:-1]


def _calls(program) -> list:
    return [node for node in program.graph.nodes if node.op == "call_function"]


def _op_name(node) -> str:
    """`dropout` for `aten.dropout.default`."""
    name = getattr(node.target, "__name__", str(node.target))
    return name.split(".")[0]


def _torch():
    return require("torch", "comparing with PyTorch")


def _load(path: str):
    """The program in `path`, deserialized once per version of the file (a check reads it
    three times: its random ops, its weights, its run) and copied for each caller (a run in
    train mode updates batch norm statistics in place)."""
    stat = os.stat(path)
    original = _load_version(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)
    with pt2_files.quiet_torch():
        program = copy.deepcopy(original)
    # Read before copying: a deep copy gives tied parameters a storage each.
    program.tvm_ext_tied = pt2_files.tied_aliases(original)
    return program


def _tied(program) -> dict[str, str]:
    """`pt2_files.tied_aliases` of a program `_load` gave."""
    return program.tvm_ext_tied


@functools.lru_cache(maxsize=2)
def _load_version(path: str, _mtime_ns: int, _size: int):
    return pt2_files.load_program(path)


def tied_selections(path: str, inputs: Sequence[np.ndarray], params: Sequence[np.ndarray],
                    param_names: Sequence[str]) -> dict:
    """{node: (op, tied rows, rows)} of the program's selections (topk, sort, argmax ...) that
    chose among tied values in one eager call on `inputs` (see `selection_ties.py`)."""
    found: dict = {}
    with _torch().no_grad():
        _run(path, inputs, params, param_names, watch=found)
    return found


def _run(path, inputs, params, param_names, requires_grad: Sequence[str] = (),
         autocast: bool = False, float64: bool = False, functional: bool = False,
         watch: dict | None = None):
    """(tensor outputs flattened, {param name: tensor fed}) of one eager call (`autocast`:
    one under `torch.autocast`, without the export's dtype checks; `float64`: float32 widened
    to float64, likewise; `functional`: the program through torch.export's decompositions,
    which leave no in-place write; `watch`: a dict each selection that chose among ties is
    written into)."""
    torch = _torch()
    from torch.utils import _pytree

    program = _load(path)
    if functional:
        tied = program.tvm_ext_tied
        with pt2_files.quiet_torch():
            program = program.run_decompositions()
        program.tvm_ext_tied = tied
    names = list(param_names) or [f"param{i}" for i in range(len(params))]
    targets = _parameter_targets(program, list(param_names), len(params))
    fed = {n: _widened(_to_torch(p, copy=True), float64)
           for n, p in zip(names, params, strict=True)}
    for n in requires_grad:
        fed[n].requires_grad_()
    with pt2_files.quiet_torch():
        module, inputs = _with_seeded_dropouts(program, list(inputs))
    _views_as_reshapes(module)
    if watch is not None:
        selection_ties.watch(module, watch)
    if functional:
        _copies_differentiable(module)
    if autocast or float64:
        _drop_dtype_checks(module)
    if autocast:
        _fills_within_range(module)
    if float64:
        module = module.double()
        _widen_made_tensors(module)
    tensors = [_widened(_to_torch(x), float64) for x in inputs]
    in_spec = program.call_spec.in_spec
    args, kwargs = (_pytree.tree_unflatten(tensors, in_spec) if in_spec is not None
                    else (tuple(tensors), {}))
    weights = _with_tied(program, {t: fed[n] for n, t in zip(names, targets, strict=True)})
    with pt2_files.quiet_torch():
        out = torch.func.functional_call(module, weights, tuple(args), dict(kwargs),
                                         strict=False)
    leaves = _pytree.tree_leaves(out)
    # In the order the loader gives the compiled module's outputs (the logits first).
    leaves = [leaves[i] for i in pt2_files.logits_first(pt2_files.output_names(program)[1])] \
        if len(leaves) == len(pt2_files.output_names(program)[1]) else leaves
    return [t for t in leaves if isinstance(t, torch.Tensor)], fed


def _widened(tensor, float64: bool):
    """`tensor` in float64 where `float64` and it is float32; else itself."""
    return tensor.double() if float64 and tensor.dtype == _torch().float32 else tensor


def _views_as_reshapes(module) -> None:
    """Each `view` of `module`'s graph as a `reshape`: the export traced strides of a run
    without gradients, and with them some ops return other strides (`sdpa`'s output, which
    Data2VecVision's `view` then cannot take); a reshape is that view wherever one exists."""
    torch = _torch()
    _retarget(module, torch.ops.aten.view.default, torch.ops.aten.reshape.default)


def _copy(dst, src, non_blocking=False):
    """`aten.copy(dst, src)` (the functional form of `dst.copy_(src)`: src in dst's shape and
    dtype) written with ops autograd differentiates; aten's has no derivative."""
    return src.to(dst.dtype).expand(dst.shape).clone()


def _copies_differentiable(module) -> None:
    _retarget(module, _torch().ops.aten.copy.default, _copy)


def _retarget(module, old, new) -> None:
    """Every call of `old` in `module`'s graph a call of `new`, with the same arguments."""
    nodes = [n for n in module.graph.nodes if n.op == "call_function" and n.target is old]
    for node in nodes:
        node.target = new
    if nodes:
        module.recompile()


def _drop_dtype_checks(module) -> None:
    """Remove the export's `_assert_tensor_metadata` checks from `module`'s graph: they pin
    the input of each cast the model makes (`x.to(torch.float32)` in an RMSNorm) to its
    export-time dtype, which autocast changes by design (a bfloat16 product there); the casts
    themselves stay."""
    target = _torch().ops.aten._assert_tensor_metadata.default
    checks = [n for n in module.graph.nodes if n.op == "call_function" and n.target is target]
    for node in checks:
        module.graph.erase_node(node)
    if checks:
        module.recompile()


def _fill_within_range(fill):
    """`fill` (a masked_fill) with its value clamped to the range of the filled tensor's dtype."""

    def clamped(x, mask, value):
        torch = _torch()
        if x.dtype.is_floating_point:
            info = torch.finfo(x.dtype)
            value = value.clamp(info.min, info.max) if isinstance(value, torch.Tensor) \
                else min(max(value, info.min), info.max)
        return fill(x, mask, value)

    return clamped


def _fills_within_range(module) -> None:
    """Each masked_fill of `module`'s graph with its value clamped to the filled tensor's
    range: the export wrote `torch.finfo(x.dtype).min` as float32's (SEW-D's attention mask),
    which autocast's bfloat16 scores cannot hold (PyTorch refuses the fill); run eagerly, the
    model takes bfloat16's own."""
    aten = _torch().ops.aten
    for fill in (aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.masked_fill_.Scalar,
                 aten.masked_fill_.Tensor):
        _retarget(module, fill, _fill_within_range(fill))


def _widen_made_tensors(module) -> None:
    """The float32 tensors `module`'s graph makes itself (`torch.arange(h, dtype=torch.float)`:
    RAFT's pixel grid) made in float64, as its weights and inputs are for a float64 run: ops
    that take two tensors of one dtype (grid_sample) would refuse the mix."""
    torch = _torch()
    changed = False
    for node in module.graph.nodes:
        if node.op == "call_function" and node.kwargs.get("dtype") is torch.float32:
            node.kwargs = {**node.kwargs, "dtype": torch.float64}
            changed = True
    if changed:
        module.recompile()


def _with_tied(program, weights: dict) -> dict:
    """`weights` (state-dict key -> tensor) with each tied parameter the module loaded as one
    (`pt2_files.tied_aliases`) fed under its other names too: the same tensor."""
    from torch.export.graph_signature import InputKind

    target = {s.arg.name: s.target for s in program.graph_signature.input_specs
              if s.kind == InputKind.PARAMETER}
    for alias, kept in _tied(program).items():
        if target[kept] in weights and target[alias] not in weights:
            weights[target[alias]] = weights[target[kept]]
    return weights


def _parameter_targets(program, names: list[str], count: int) -> list[str]:
    """The state-dict key of each parameter argument: by the placeholder name where every name
    is known, else by the graph signature's order (the frontend's order)."""
    from torch.export.graph_signature import InputKind

    aliases = _tied(program)  # loaded as the parameter they are tied to
    specs = [s for s in program.graph_signature.input_specs if s.kind == InputKind.PARAMETER
             and s.arg.name not in aliases]
    by_name = {s.arg.name: s.target for s in specs}
    if names and len(names) == count and all(n in by_name for n in names):
        return [by_name[n] for n in names]
    if count != len(specs):
        raise ValueError(f"{count} parameters given, the exported program has {len(specs)}")
    return [s.target for s in specs]


def _to_torch(array, copy: bool = False):
    """A torch tensor of a numpy array; bfloat16 (ml_dtypes', which torch cannot read) goes
    through float32, which holds every bfloat16 value exactly."""
    torch = _torch()

    array = np.asarray(array)
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.array(array) if copy else np.asarray(array, order="C"))


def _to_numpy(tensor) -> np.ndarray:
    torch = _torch()

    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16; TVM returns ml_dtypes'
        import ml_dtypes

        return tensor.float().numpy().astype(ml_dtypes.bfloat16)
    return tensor.numpy()
