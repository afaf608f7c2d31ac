"""Vectorisable float32 `exp`, `tanh`, `sigmoid`, `erf` and small integer powers for CPU kernels.

LLVM lowers `exp`, `tanh`, `erf` and `pow` to one libm call per element even inside a
vectorised loop (the wheel's LLVM has no vector math library): 2-10 ns per element, 20-100x a
load, which made GELU and softmax the slowest kernels of a transformer once the GEMMs call
BLAS. `vector_math` rewrites them into polynomials that vectorise:

- `exp`: Cephes' `expf` (range reduction by ln 2 in two parts, degree-6 polynomial), the power
  of two built from the exponent bits in two halves so that subnormal results stay right;
  +-inf, NaN, overflow and underflow as libm.
- `tanh`: the [-9, 9] rational approximation of Eigen and TVM's `fast_tanh`.
- `erf`: the [-4, 4] rational approximation of Eigen and TVM's `fast_erf`.
- `sigmoid`: 1 / (1 + exp(-x)) with the `exp` above; `pow(x, 2 | 3 | 4)`: products.
- `isnan` (float16, float32, float64): a test of the bits, which the vectoriser can vectorise
  (see `_is_nan`).

Kernels holding bfloat16 values keep their libm calls: TVM's bfloat16 legalisation
(BF16ComputeLegalize, in the TIR pipeline) miscompiles the `Let` bindings these polynomials use
(`bf16(Let(x * x * x, x = f32(a)))` reads garbage; tests/test_schedules_default_cpu.py).

Measured against float64 references (tests/test_schedules_default_cpu.py): at most a few
units in the last place, the same class of difference as summing in another order.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

F32 = "float32"
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
             1.6666665459e-1, 5.0000001201e-1)
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4
_LOG2E = 1.44269504088896341
_EXP_MAX, _EXP_MIN = 88.72283935546875, -103.97207708
_TANH_P = (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11,
           5.12229709037114e-08, 1.48572235717979e-05, 6.37261928875436e-04,
           4.89352455891786e-03)
_TANH_Q = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03,
           4.89352518554385e-03)
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
          -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
          -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
          -7.37332916720468e-03, -1.42647390514189e-02)


def _c(value: float):
    return tirx.const(value, F32)


def _horner(x, coeffs):
    acc = _c(coeffs[0])
    for coeff in coeffs[1:]:
        acc = acc * x + _c(coeff)
    return acc


def _bind(value, body_of):
    """`body_of(v)` with `v` bound to `value` once (a Let: the argument is not duplicated)."""
    var = tirx.Var("x", F32)
    return tirx.Let(var, value, body_of(var))


# Per float type: the integer of its width, the mask of its magnitude bits and the bits of
# infinity (exponent all ones, mantissa zero); a magnitude above infinity's is a NaN.
_NAN_BITS = {"float16": ("int16", 0x7FFF, 0x7C00),
             "float32": ("int32", 0x7FFFFFFF, 0x7F800000),
             "float64": ("int64", 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000)}


def _is_nan(v):
    """isnan(v) from its bits. TVM's vectoriser cannot vectorise a `tirx.isnan` call: it
    rebuilds it even where nothing in it changed, then visits the enclosing expression a second
    time, and a `Let` met twice stops it ("Let cannot bind the same var to two different
    values": a GELU gradient of a value the vector loop does not index, FocalNet's; the tiny
    autoencoder's `isfinite` before its latents' cast to uint8, under `tanh`); integer ops on
    the bits vectorise."""
    itype, mask, inf = _NAN_BITS[str(v.ty)]
    bits = tirx.reinterpret(itype, v)
    return tirx.bitwise_and(bits, tirx.const(mask, itype)) > tirx.const(inf, itype)


def _pow2(n_int):
    """2 ** n for an int32 n in [-150, 128], as two normal factors."""
    half = tirx.shift_right(n_int, tirx.const(1, "int32"))
    first = tirx.reinterpret(F32, tirx.shift_left(half + 127, tirx.const(23, "int32")))
    second = tirx.reinterpret(F32, tirx.shift_left(n_int - half + 127,
                                                   tirx.const(23, "int32")))
    return first, second


def _exp(x):
    def body(v):
        clamped = tirx.max(tirx.min(v, _c(_EXP_MAX)), _c(_EXP_MIN))

        def reduced(c):
            n = tirx.floor(c * _c(_LOG2E) + _c(0.5))

            def poly(n_var):
                r = c - n_var * _c(_LN2_HI) - n_var * _c(_LN2_LO)
                y = _horner(r, _EXP_POLY) * (r * r) + r + _c(1.0)
                first, second = _pow2(tirx.Cast("int32", n_var))
                return y * first * second

            return _bind(n, poly)

        value = _bind(clamped, reduced)
        value = tirx.Select(v > _c(_EXP_MAX), _c(float("inf")), value)
        value = tirx.Select(v < _c(_EXP_MIN), _c(0.0), value)
        return tirx.Select(_is_nan(v), v, value)

    return _bind(x, body)


def _rational(x, bound: float, p, q):
    """x * P(x^2) / Q(x^2) on x clamped to [-bound, bound], NaN kept."""
    def body(v):
        def inner(c):
            def squared(s):
                return c * _horner(s, p) / _horner(s, q)

            return _bind(c * c, squared)

        value = _bind(tirx.max(tirx.min(v, _c(bound)), _c(-bound)), inner)
        return tirx.Select(_is_nan(v), v, value)

    return _bind(x, body)


def _sigmoid(x):
    return _c(1.0) / (_c(1.0) + _exp(_c(0.0) - x))


def _power(base, exponent):
    if not isinstance(exponent, tirx.FloatImm) or float(exponent.value) not in (2.0, 3.0, 4.0):
        return None
    power = int(exponent.value)

    def body(v):
        if power == 4:
            return (v * v) * (v * v)
        return v * v if power == 2 else v * v * v

    return _bind(base, body)


_RULES = {
    "tirx.exp": lambda args: _exp(args[0]),
    "tirx.tanh": lambda args: _rational(args[0], 9.0, _TANH_P, _TANH_Q),
    "tirx.erf": lambda args: _rational(args[0], 4.0, _ERF_P, _ERF_Q),
    "tirx.sigmoid": lambda args: _sigmoid(args[0]),
    "tirx.pow": lambda args: _power(args[0], args[1]),
}


def _rewrite(call):
    name = getattr(call.op, "name", "")
    if name == "tirx.isnan":
        return _is_nan(call.args[0]) if str(call.args[0].ty) in _NAN_BITS else call
    rule = _RULES.get(name)
    if rule is None or any(str(a.ty) != F32 for a in call.args):
        return call
    replaced = rule(list(call.args))
    return call if replaced is None else replaced


def _has_bfloat16(func: tirx.PrimFunc) -> bool:
    """Whether any parameter, store, load or cast of `func` is bfloat16."""
    types = [str(p.dtype) for p in func.params if getattr(p, "shape", None) is not None]
    tvm_ffi.structural_walk(func.body, [
        (tirx.BufferStore, lambda s: types.append(str(s.buffer.dtype))),
        ((tvm.ir.TensorLoad, tirx.Cast), lambda e: types.append(str(e.ty))),
    ])
    return "bfloat16" in types


def vector_math(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with its float32 exp, tanh, erf, sigmoid and pow(x, 2|3|4) as polynomials and
    its isnan tests of float16/32/64 values on their bits (unchanged if it holds bfloat16
    values: see the module docstring)."""
    if _has_bfloat16(func):
        return func
    return tvm_ffi.structural_map(func, (tvm.ir.Call, _rewrite))


def uses_vector_math(func: tirx.PrimFunc) -> bool:
    """Whether `func` calls any function `vector_math` rewrites."""
    calls: list = []
    tvm_ffi.structural_walk(func.body, [(tvm.ir.Call, calls.append)])
    return any(getattr(c.op, "name", "") in _RULES for c in calls)
