"""Gradients that TVM's `relax.transform.Gradient` lacks, registered on `import tvm_ext`.

Each is written from primitives that have gradients and legalizations of their own, and is
checked against finite differences in tests/test_gradients.py.
"""

from __future__ import annotations

import math

from tvm import relax
from tvm.relax.op.base import register_gradient

_op = relax.op


def _const(value: float, like: relax.Expr) -> relax.Constant:
    return relax.const(value, str(like.ty.dtype))


def _gelu_grad(orig_var, orig_call, output_grad, ctx):
    """d/dx [x * Phi(x)] = Phi(x) + x * phi(x), Phi the normal CDF and phi its density."""
    x = orig_call.args[0]
    cdf = _op.multiply(
        _const(0.5, x),
        _op.add(_const(1.0, x), _op.erf(_op.multiply(x, _const(1 / math.sqrt(2), x)))),
    )
    pdf = _op.multiply(
        _const(1 / math.sqrt(2 * math.pi), x),
        _op.exp(_op.multiply(_const(-0.5, x), _op.multiply(x, x))),
    )
    return [_op.multiply(output_grad, _op.add(cdf, _op.multiply(x, pdf)))]


def _gelu_tanh_grad(orig_var, orig_call, output_grad, ctx):
    """gelu_tanh(x) = 0.5 x (1 + tanh(u)), u = c (x + 0.044715 x^3), c = sqrt(2 / pi)."""
    x = orig_call.args[0]
    c = math.sqrt(2 / math.pi)
    x2 = _op.multiply(x, x)
    u = _op.multiply(
        _const(c, x), _op.add(x, _op.multiply(_const(0.044715, x), _op.multiply(x2, x)))
    )
    t = _op.tanh(u)
    du = _op.multiply(
        _const(c, x), _op.add(_const(1.0, x), _op.multiply(_const(3 * 0.044715, x), x2))
    )
    sech2 = _op.subtract(_const(1.0, x), _op.multiply(t, t))
    grad = _op.add(
        _op.multiply(_const(0.5, x), _op.add(_const(1.0, x), t)),
        _op.multiply(_op.multiply(_const(0.5, x), x), _op.multiply(sech2, du)),
    )
    return [_op.multiply(output_grad, grad)]


def _erf_grad(orig_var, orig_call, output_grad, ctx):
    """d/dx erf(x) = 2 / sqrt(pi) * exp(-x^2)."""
    x = orig_call.args[0]
    dx = _op.multiply(_const(2 / math.sqrt(math.pi), x), _op.exp(_op.negative(_op.multiply(x, x))))
    return [_op.multiply(output_grad, dx)]


def _rsqrt_grad(orig_var, orig_call, output_grad, ctx):
    """d/dx x^(-1/2) = -1/2 * y^3, y = rsqrt(x)."""
    y = orig_var
    return [
        _op.multiply(
            output_grad, _op.multiply(_const(-0.5, y), _op.multiply(y, _op.multiply(y, y)))
        )
    ]


_REGISTERED = False


def register_all() -> None:
    """Register the gradients once per process (level 11 overrides nothing TVM defines here)."""
    global _REGISTERED
    if _REGISTERED:
        return
    for op_name, fn in (
        ("relax.nn.gelu", _gelu_grad),
        ("relax.nn.gelu_tanh", _gelu_tanh_grad),
        ("relax.erf", _erf_grad),
        ("relax.rsqrt", _rsqrt_grad),
    ):
        register_gradient(op_name, fn, level=11)
    _REGISTERED = True
