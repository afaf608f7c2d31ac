"""The legalization of `relax.grad.max_pool2d_backward` (NCHW, no dilation), registered over
TVM's: TVM's `topi.nn.pool_grad` sends the gradient to the wrong elements wherever a window
is cut by the input's edge or the input has rows no window reads (a 2x2 pool of 3 rows, a 3x3
pool of a 2 x 2 map: GoogLeNet's last inception block; one case read uninitialized memory).

Each output's gradient goes, as PyTorch's does, to the first element of its window (in row-
major order, padding excluded) that holds the window's maximum. Three stages: the window's
maximum, the flat index of its first occurrence, and each input element's sum over the
windows (at most ceil(k / s) per axis) that chose it.
"""

from __future__ import annotations

import tvm
from tvm import te
from tvm.relax.transform.legalize_ops import grad as _tvm_grad_legalizations


def _max_pool2d_backward_te(dy, x, kernel, stride, padding):
    n, c, height, width = (int(v) for v in x.shape)
    out_h, out_w = (int(v) for v in dy.shape[2:])
    (kh, kw), (sh, sw) = (int(v) for v in kernel), (int(v) for v in stride)
    top, left = int(padding[0]), int(padding[1])
    index_dtype = "int64" if height * width >= 2**31 else "int32"
    lowest = tvm.tirx.min_value(x.dtype)
    past = tvm.tirx.const(height * width, index_dtype)

    def at(b, ch, oh, ow, i, j):
        """(valid, row, column) of window element (i, j) of output (oh, ow)."""
        hpos, wpos = oh * sh - top + i, ow * sw - left + j
        valid = tvm.tirx.all(hpos >= 0, hpos < height, wpos >= 0, wpos < width)
        return valid, tvm.te.max(tvm.te.min(hpos, height - 1), 0), \
            tvm.te.max(tvm.te.min(wpos, width - 1), 0)

    i, j = te.reduce_axis((0, kh), "i"), te.reduce_axis((0, kw), "j")

    def window_max(b, ch, oh, ow):
        valid, hpos, wpos = at(b, ch, oh, ow, i, j)
        return te.max(tvm.tirx.Select(valid, x[b, ch, hpos, wpos], lowest), axis=[i, j])

    peak = te.compute((n, c, out_h, out_w), window_max, name="window_max")
    i2, j2 = te.reduce_axis((0, kh), "i2"), te.reduce_axis((0, kw), "j2")

    def first_at_max(b, ch, oh, ow):
        valid, hpos, wpos = at(b, ch, oh, ow, i2, j2)
        hit = tvm.tirx.all(valid, x[b, ch, hpos, wpos] == peak[b, ch, oh, ow])
        flat = (hpos * width + wpos).astype(index_dtype)
        return te.min(tvm.tirx.Select(hit, flat, past), axis=[i2, j2])

    first = te.compute((n, c, out_h, out_w), first_at_max, name="first_at_max")
    rh = te.reduce_axis((0, (kh + sh - 1) // sh), "rh")
    rw = te.reduce_axis((0, (kw + sw - 1) // sw), "rw")

    def gathered(b, ch, hpos, wpos):
        oh, ow = (hpos + top) // sh - rh, (wpos + left) // sw - rw
        inside = tvm.tirx.all(oh >= 0, oh < out_h, ow >= 0, ow < out_w,
                              hpos < oh * sh - top + kh, wpos < ow * sw - left + kw)
        ohc = tvm.te.max(tvm.te.min(oh, out_h - 1), 0)
        owc = tvm.te.max(tvm.te.min(ow, out_w - 1), 0)
        chosen = tvm.tirx.all(inside, first[b, ch, ohc, owc] ==
                              (hpos * width + wpos).astype(index_dtype))
        return te.sum(tvm.tirx.Select(chosen, dy[b, ch, ohc, owc],
                                      tvm.tirx.const(0, dy.dtype)), axis=[rh, rw])

    return te.compute((n, c, height, width), gathered, name="max_pool2d_backward")


def legalize_max_pool2d_backward(bb, call):
    attrs = call.attrs
    if (attrs.layout != "NCHW" or any(int(d) != 1 for d in attrs.dilation)
            or not all(isinstance(v, tvm.tirx.IntImm) for a in call.args
                       for v in a.ty.shape.values)):
        return _tvm_grad_legalizations._grad_max_pool2d_backward(bb, call)
    return bb.call_te(_max_pool2d_backward_te, call.args[0], call.args[1],
                      kernel=attrs.pool_size, stride=attrs.strides, padding=attrs.padding,
                      primfunc_name_hint="max_pool2d_backward")


def register() -> None:
    tvm.ir.register_op_attr("relax.grad.max_pool2d_backward", "FLegalize",
                            legalize_max_pool2d_backward, level=11)
