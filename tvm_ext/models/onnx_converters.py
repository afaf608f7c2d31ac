"""Converters of ONNX ops that TVM's ONNX frontend writes as hand-made kernels (`emit_te`),
which `relax.transform.Gradient` cannot differentiate and autocast cannot retype: here they
are Relax ops, with gradients of their own.

- `Clip` (MobileNet's ReLU6): the frontend emits `topi.maximum` / `topi.minimum` kernels. A
  float clip between constant scalars is `relax.op.clip` (PyTorch's gradient, see
  `gradients.py`); tensor bounds, and integers, are `relax.op.maximum` / `minimum`, NaN bounds
  unbounded as the frontend has them.
"""

from __future__ import annotations

import contextlib

import numpy as np
from tvm import relax

from ..ir.relax_exprs import scalar


@contextlib.contextmanager
def onnx_converters():
    """TVM's ONNX frontend with the converters above in place of its own, while it imports."""
    from tvm.relax.frontend.onnx import onnx_frontend as frontend

    original = frontend._get_convert_map
    clip = _clip_converter(frontend)

    def convert_map():
        return {**original(), "Clip": clip}

    frontend._get_convert_map = convert_map
    try:
        yield
    finally:
        frontend._get_convert_map = original


def _clip_converter(frontend):
    class Clip(frontend.Clip):
        @classmethod
        def _impl_v1(cls, bb, inputs, attr, params):
            return bb.emit(relax.op.clip(inputs[0], float(attr.get("min", -np.inf)),
                                         float(attr.get("max", np.inf))))

        @classmethod
        def _impl_v13(cls, bb, inputs, attr, params):
            x, lo, hi = inputs[0], inputs[1], inputs[2]
            low, high = (None if b is None else scalar(b) for b in (lo, hi))
            floating = str(x.ty.dtype).startswith(("float", "bfloat"))
            if floating and (lo is None or low is not None) and (hi is None or high is not None):
                low = -np.inf if low is None or np.isnan(low) else low
                high = np.inf if high is None or np.isnan(high) else high
                return bb.emit(relax.op.clip(x, low, high))
            out = x
            if lo is not None:
                bound = cls._sanitize_nan_clip_bound(bb, lo, for_min=True)
                out = bb.emit(relax.op.maximum(out, bound))
            if hi is not None:
                bound = cls._sanitize_nan_clip_bound(bb, hi, for_min=False)
                out = bb.emit(relax.op.minimum(out, bound))
            return out

    return Clip
