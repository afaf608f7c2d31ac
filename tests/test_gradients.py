"""The gradients tvm_ext registers, against central finite differences in float64."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_ext  # noqa: F401  (registers the gradients)


def _grad_of(op_fn, x_np):
    """d/dx sum(op(x) * w) for a fixed random w, compiled through Relax's Gradient pass."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(x_np.shape, "float64"))
    w = relax.Var("w", relax.TensorType(x_np.shape, "float64"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(op_fn(x))
            out = bb.emit_output(relax.op.sum(relax.op.multiply(y, w)))
        bb.emit_func_output(out)
    mod = relax.transform.Gradient("main", require_grads=[x])(bb.get())
    mod = tvm.IRModule({"main": mod["main_adjoint"].with_attr("global_symbol", "main")})
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    return vm


@pytest.mark.parametrize(
    "name, op_fn, domain",
    [
        ("gelu", relax.op.nn.gelu, (-3, 3)),
        ("gelu_tanh", relax.op.nn.gelu_tanh, (-3, 3)),
        ("erf", relax.op.erf, (-2, 2)),
        ("rsqrt", relax.op.rsqrt, (0.5, 3)),
    ],
)
def test_gradient_matches_finite_differences(name, op_fn, domain):
    rng = np.random.default_rng(0)
    x = rng.uniform(*domain, size=(3, 5))
    w = rng.standard_normal((3, 5))
    vm = _grad_of(op_fn, x)
    loss, (grad,) = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w))
    grad = grad.numpy()

    def f(xv):
        out, _ = vm["main"](tvm.runtime.tensor(xv), tvm.runtime.tensor(w))
        return float(out.numpy())

    eps = 1e-6
    fd = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[idx] += eps
        minus[idx] -= eps
        fd[idx] = (f(plus) - f(minus)) / (2 * eps)
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-8, err_msg=name)
    assert float(loss.numpy()) == pytest.approx(f(x))
