"""tvm_ext.models.optimizer: the update kernels against torch.optim, and the optimizer step's
form (arguments, state, the in-place record)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, te

from tvm_ext.errors import InputError
from tvm_ext.ir.pass_records import STATE_ATTR, UPDATES_ATTR, argument_updates
from tvm_ext.models import reference
from tvm_ext.models.optimizer import Optimizer, make_optimizer_step, update_kernel

torch = pytest.importorskip("torch")

OPTIMIZERS = [
    Optimizer("sgd", lr=0.1),
    Optimizer("sgd", lr=0.1, weight_decay=0.05),
    Optimizer("momentum", lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.05),
    Optimizer("momentum", lr=0.1, momentum=0.8, nesterov=True),
    Optimizer("adam", lr=0.01, weight_decay=0.05),
    Optimizer("adamw", lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
]


def _kernel_vm(opt: Optimizer, shape):
    """One parameter's update, compiled alone: (p, g, *state, [step]) -> [p', *state']."""
    bb = relax.BlockBuilder()
    args = [relax.Var(n, relax.TensorType(shape, "float32"))
            for n in ["p", "g", *opt.state_names]]
    if opt.counts_steps:
        args.append(relax.Var("step", relax.TensorType((), "float32")))
    with bb.function("main", args):
        out = bb.emit_te(update_kernel(opt, "float32"), *args)
        bb.emit_func_output(out)
    return relax.VirtualMachine(tvm.compile(bb.get(), "llvm"), tvm.cpu())


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.describe())
def test_update_kernel_matches_torch_optim(opt):
    """Three steps of the kernel, fed its own outputs, equal three steps of torch.optim with
    the same gradients (to float32 rounding), state included."""
    rng = np.random.default_rng(0)
    shape = (5, 7)
    p = rng.standard_normal(shape).astype("float32")
    grads = [rng.standard_normal(shape).astype("float32") for _ in range(3)]
    vm = _kernel_vm(opt, shape)
    state = [np.zeros(shape, "float32") for _ in opt.state_names]
    value = p
    for k, g in enumerate(grads, start=1):
        extra = [np.asarray(k, "float32")] if opt.counts_steps else []
        out = vm["main"](*[tvm.runtime.tensor(a) for a in [value, g, *state, *extra]])
        out = [o.numpy() for o in (out if isinstance(out, tvm.ir.Array) or
                                   not hasattr(out, "numpy") else [out])]
        value, state = out[0], out[1:]
    ref = reference.optimizer_steps(lambda params, g: (0.0, [g]), [p], [0], opt, grads)
    np.testing.assert_allclose(value, ref.params[0], rtol=1e-6, atol=1e-7)
    for got, want in zip(state, ref.state, strict=False):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.describe())
def test_torch_optim_resumes_from_the_state_of_a_step(opt):
    """One step, then two from its parameters and state, equal three steps from zero state:
    what the step-by-step training check starts each step from."""
    rng = np.random.default_rng(1)
    p = rng.standard_normal((4, 3)).astype("float32")
    grads = [rng.standard_normal((4, 3)).astype("float32") for _ in range(3)]
    grad = lambda params, g: (0.0, [g])  # noqa: E731
    whole = reference.optimizer_steps(grad, [p], [0], opt, grads)
    first = reference.optimizer_steps(grad, [p], [0], opt, grads[:1])
    rest = reference.optimizer_steps(grad, first.params, [0], opt, grads[1:], first.state)
    np.testing.assert_array_equal(rest.params[0], whole.params[0])
    assert len(rest.state) == len(whole.state)
    for got, want in zip(rest.state, whole.state, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kwargs, message", [
    (dict(kind="rmsprop"), "unknown optimizer"),
    (dict(kind="adam", lr=-1.0), "lr"),
    (dict(kind="adam", betas=(0.9, 1.0)), "betas"),
    (dict(kind="sgd", nesterov=True), "nesterov"),
    (dict(kind="momentum", weight_decay=-0.1), "weight_decay"),
])
def test_bad_hyperparameters_are_refused(kwargs, message):
    with pytest.raises(InputError, match=message):
        Optimizer(**kwargs)


def test_torch_defaults():
    assert Optimizer("adamw").weight_decay == 0.01 and Optimizer("adam").weight_decay == 0.0
    assert Optimizer("adamw").lr == 1e-3 and Optimizer("sgd").lr == 0.01
    assert Optimizer.from_dict(Optimizer("adam", betas=(0.5, 0.6)).to_dict()).betas == (0.5, 0.6)


def test_step_arguments_state_and_updates(zoo_cache):
    """main(inputs, labels, params, state) -> (loss, params', state'): one output per updated
    argument, each recorded against the argument it overwrites; state starts at zero."""
    step = zoo_cache("mlp", True)
    opt_step = make_optimizer_step(step, Optimizer("adam"))
    n_in, n_p = step.num_input, len(step.params)
    names = [s.name for s in opt_step.params]
    assert names[:n_p] == [s.name for s in step.params]
    assert names[n_p:] == [f"{p}.{s}" for s in ("exp_avg", "exp_avg_sq")
                           for p in step.config["gradients"]] + ["step"]
    main = opt_step.mod["main"]
    assert int(main.attrs[STATE_ATTR]) == 2 * n_p + 1
    updates = argument_updates(main)
    assert sorted(updates.values()) == list(range(n_in, n_in + 3 * n_p + 1))
    assert len(main.ret_ty.fields) == 1 + len(updates) == 1 + len(main.attrs[UPDATES_ATTR])
    values = opt_step.random_params(0)
    assert all(not v.any() for v in values[n_p:])
    with pytest.raises(InputError, match="training step"):
        make_optimizer_step(zoo_cache("mlp"), Optimizer("sgd"))


def test_update_kernel_stages_read_before_they_write():
    """Each new value is its own stage, the parameter last: the stages never read what an
    earlier stage overwrote in place (tvm_ext.ir.inplace_kernels proves it per kernel)."""
    from tvm_ext.ir.inplace_kernels import inplace_obstacle

    for opt in OPTIMIZERS:
        ins = [te.placeholder((4, 3), "float32", n) for n in ["p", "g", *opt.state_names]]
        if opt.counts_steps:
            ins.append(te.placeholder((), "float32", "step"))
        outs = update_kernel(opt, "float32")(*ins)
        func = te.create_prim_func([*ins, *outs])
        params = list(func.params)
        pairs = [(0, len(ins))] + [(2 + k, len(ins) + 1 + k) for k in
                                   range(len(opt.state_names))]
        for i, o in pairs:
            assert inplace_obstacle(func, params[i], params[o]) is None, opt.describe()
