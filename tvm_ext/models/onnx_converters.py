"""Converters of ONNX ops that TVM's ONNX frontend writes as hand-made kernels (`emit_te`),
which `relax.transform.Gradient` cannot differentiate and autocast cannot retype: here they
are Relax ops, with gradients of their own.

- `Clip` (MobileNet's ReLU6): the frontend emits `topi.maximum` / `topi.minimum` kernels. A
  float clip between constant scalars is `relax.op.clip` (PyTorch's gradient, see
  `gradients.py`); tensor bounds, and integers, are `relax.op.maximum` / `minimum`, NaN bounds
  unbounded as the frontend has them.
- `Pad` (SEW-D's constant pads, UNet1D's reflect pads): the frontend emits `topi.nn.pad`,
  `mirror_pad` and `replicate_pad`; here `relax.op.nn.pad` in the same mode (its gradient is
  `pad_grad.py`'s). Widths a mode does not read from x alone (reflect past the size less one,
  negative widths but in constant mode) stay the frontend's.
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
            pads = [int(p) for p in attr["pads"]]
            half = len(pads) // 2
            padded = _relax_pad(bb, inputs[0], pads[:half], pads[half:],
                                float(attr.get("value", 0.0)), _mode(attr))
            return padded if padded is not None else super()._impl_v2(bb, inputs, attr, params)

        @classmethod
        def _lower_pad(cls, bb, inputs, attr, params, allowed_modes):
            mode = _mode(attr)
            if mode in allowed_modes:
                before, after, value = cls._parse_pads_and_axes(inputs, params)
                padded = _relax_pad(bb, inputs[0], before, after, float(value), mode)
                if padded is not None:
                    return padded
            return super()._lower_pad(bb, inputs, attr, params, allowed_modes)

    return Pad


def _mode(attr) -> str:
    return attr.get("mode", b"constant").decode("utf-8")


# ONNX's pad modes as relax's `nn.pad` names them.
_RELAX_PAD_MODES = {"constant": "constant", "reflect": "reflect", "edge": "replicate",
                    "wrap": "circular"}


def _relax_pad(bb, x, before, after, value: float, mode: str):
    """`x` padded by `before` / `after` per axis (ONNX's order) as relax's `nn.pad`, which
    takes the widths interleaved, (before, after) per axis; None where the frontend's kernel
    stays: a mode relax does not have, or one other than constant with negative widths or
    widths past what it reads of x (which ONNX leaves to the implementation)."""
    widths = [int(w) for pair in zip(before, after, strict=True) for w in pair]
    if mode not in _RELAX_PAD_MODES:
        return None
    if mode != "constant":
        sizes = _static_sizes(x)
        extra = {"reflect": -1, "edge": None, "wrap": 0}[mode]  # widest pad: size + extra
        if sizes is None or any(
                min(b, a) < 0 or n < 1 or (extra is not None and max(b, a) > n + extra)
                for n, b, a in zip(sizes, widths[0::2], widths[1::2], strict=True)):
            return None
    return bb.emit(relax.op.nn.pad(x, widths, _RELAX_PAD_MODES[mode], value))


def _static_sizes(x) -> list[int] | None:
    shape = x.ty.shape
    values = None if shape is None else getattr(shape, "values", None)
    if values is None or not all(isinstance(d, tvm.tirx.IntImm) for d in values):
        return None
    return [int(d) for d in values]


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
