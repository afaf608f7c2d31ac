"""Converters of ONNX ops that TVM's ONNX frontend writes as hand-made kernels (`emit_te`),
which `relax.transform.Gradient` cannot differentiate and autocast cannot retype: here they
are Relax ops, with gradients of their own.

- `Clip` (MobileNet's ReLU6): the frontend emits `topi.maximum` / `topi.minimum` kernels. A
  float clip between constant scalars is `relax.op.clip` (PyTorch's gradient, see
  `gradients.py`); tensor bounds, and integers, are `relax.op.maximum` / `minimum`, NaN bounds
  unbounded as the frontend has them.
- `Pad` in constant mode (SEW-D): the frontend emits `topi.nn.pad`; here `relax.op.nn.pad`
  (its gradient is `gradients.py`'s). The other modes stay the frontend's.
- `Einsum` (Zamba2's Mamba2 layers): the frontend emits `topi.einsum`; here
  `relax.op.einsum`.
- `Tile` with constant repeats (SwiftFormer): the frontend emits `topi.tile`;
  here `relax.op.tile`. Repeats computed at run time stay the frontend's.

And `Expand` to a shape held in a weight (a value onnxsim folded: Zamba2's Mamba2 layers),
which the frontend reads as a shape known only at run time, so that every shape after it is
unknown and the first `Einsum` on it fails: here the weight's value, as for a constant.
`TopK` with `sorted=0` (Doge's dynamic mask), which the frontend refuses: an unsorted
top-k returns its k values in an unspecified order, of which the sorted one is one (as
`torch_converters` reads `topk(..., sorted=False)`).
"""

from __future__ import annotations

import contextlib

import numpy as np
import tvm
from tvm import relax

from ..ir.relax_exprs import scalar


@contextlib.contextmanager
def onnx_converters():
    """TVM's ONNX frontend with the converters above in place of its own, while it imports."""
    from tvm.relax.frontend.onnx import onnx_frontend as frontend

    original = frontend._get_convert_map
    ours = {"Clip": _clip_converter(frontend), "Pad": _pad_converter(frontend),
            "Tile": _tile_converter(frontend), "TopK": _topk_converter(frontend),
            "Expand": _expand_converter(frontend), "Einsum": _einsum_converter(frontend)}

    def convert_map():
        return {**original(), **ours}

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


def _pad_converter(frontend):
    class Pad(frontend.Pad):
        @classmethod
        def _impl_v2(cls, bb, inputs, attr, params):
            if not _constant_mode(attr):
                return super()._impl_v2(bb, inputs, attr, params)
            pads = [int(p) for p in attr["pads"]]
            half = len(pads) // 2
            return _constant_pad(bb, inputs[0], pads[:half], pads[half:],
                                 float(attr.get("value", 0.0)))

        @classmethod
        def _lower_pad(cls, bb, inputs, attr, params, allowed_modes):
            if not _constant_mode(attr):
                return super()._lower_pad(bb, inputs, attr, params, allowed_modes)
            before, after, value = cls._parse_pads_and_axes(inputs, params)
            return _constant_pad(bb, inputs[0], before, after, float(value))

    return Pad


def _constant_mode(attr) -> bool:
    return attr.get("mode", b"constant").decode("utf-8") == "constant"


def _constant_pad(bb, x, before, after, value: float):
    """`x` padded by `before` / `after` per axis (ONNX's order) with `value`: relax's `nn.pad`
    takes the widths interleaved, (before, after) per axis."""
    widths = [int(w) for pair in zip(before, after, strict=True) for w in pair]
    return bb.emit(relax.op.nn.pad(x, widths, "constant", value))


def _tile_converter(frontend):
    from tvm.relax.frontend.onnx.onnx_frontend import get_constant

    class Tile(frontend.Tile):
        @classmethod
        def _impl_v13(cls, bb, inputs, attr, params):
            repeats = get_constant(inputs[1], params)
            if not isinstance(repeats, tvm.ir.GenericConst):
                return super()._impl_v13(bb, inputs, attr, params)
            return bb.emit(relax.op.tile(inputs[0], [int(r) for r in
                                                     repeats.value.numpy().tolist()]))

    return Tile


def _expand_converter(frontend):
    from tvm.relax.frontend.onnx.onnx_frontend import get_constant

    class Expand(frontend.Expand):
        @classmethod
        def _impl_v13(cls, bb, inputs, attr, params):
            return super()._impl_v13(bb, [inputs[0], get_constant(inputs[1], params)], attr,
                                     params)

    return Expand


def _einsum_converter(frontend):
    class Einsum(frontend.Einsum):
        @classmethod
        def _impl_v12(cls, bb, inputs, attr, params):
            equation = attr["equation"]
            equation = equation.decode() if isinstance(equation, bytes) else equation
            return bb.emit(relax.op.einsum(list(inputs), equation))

    return Einsum


def _topk_converter(frontend):
    class TopK(frontend.TopK):
        @classmethod
        def _impl_v11(cls, bb, inputs, attr, params):
            return super()._impl_v11(bb, inputs, {**attr, "sorted": 1}, params)

    return TopK
