"""The gradient of `relax.image.grid_sample` (TVM has none): RAFT's correlation lookup, a
spatial transformer's sampler.

y[n, c, p] reads the input at the point the grid gives output position p, in input pixels
(`_source`): bilinearly, from the four pixels around it with weights that sum to one, or the
nearest pixel. So dx scatters each dy[n, c, p] back onto those pixels with the same weights
(one `scatter_elements` add), and the grid's gradient is dy times the slope of the
interpolation along x and y, summed over channels, times the slope of the pixel coordinate in
the grid's (a constant; zero where the border mode clamps it). The rules are PyTorch's
(`grid_sampler_2d_backward`), written with Relax ops, so the planners and schedules see them as
any other kernels. The reflection padding mode and bicubic sampling are refused by name.
"""

from __future__ import annotations

from tvm import relax

_op = relax.op


def _dims(expr: relax.Expr) -> list[int]:
    return [int(v) for v in expr.ty.shape.values]


def _source(g: relax.Expr, dtype: str, size: int, align_corners: bool, border: bool):
    """(pixel coordinate, its slope in the grid coordinate g) along an axis of `size`."""
    # align_corners: -1 and 1 are the centres of the first and last pixels, else their outer
    # edges: pixel = (g + 1) (size - 1) / 2, or ((g + 1) size - 1) / 2.
    scale = (size - 1) / 2 if align_corners else size / 2
    shift = 0.0 if align_corners else -0.5
    pixel = _op.add(_op.multiply(_op.add(g, relax.const(1.0, dtype)),
                                 relax.const(scale, dtype)), relax.const(shift, dtype))
    slope = relax.const(scale, dtype)
    if border:  # clamped into the image: no slope outside it, nor on its edges (PyTorch's)
        inside = _op.logical_and(_op.greater(pixel, relax.const(0.0, dtype)),
                                 _op.less(pixel, relax.const(size - 1, dtype)))
        slope = _op.multiply(_op.astype(inside, dtype), slope)
        pixel = _clamp(pixel, dtype, size)
    return pixel, slope


def _clamp(i: relax.Expr, dtype: str, size: int) -> relax.Expr:
    """`i` clamped into [0, size - 1]."""
    return _op.minimum(_op.maximum(i, relax.const(0.0, dtype)), relax.const(size - 1, dtype))


def _in_range(i: relax.Expr, dtype: str, size: int) -> relax.Expr:
    return _op.logical_and(_op.greater_equal(i, relax.const(0.0, dtype)),
                           _op.less_equal(i, relax.const(size - 1, dtype)))


def _corner(y: relax.Expr, x: relax.Expr, weight: relax.Expr, dtype: str, h: int, w: int):
    """(flat index (int64, clamped into the image), weight, zero outside it) of one pixel."""
    valid = _op.astype(_op.logical_and(_in_range(y, dtype, h), _in_range(x, dtype, w)), dtype)
    # In int64: a float row times the width is inexact past 2^24 pixels.
    row, col = (_op.astype(_clamp(v, dtype, n), "int64") for v, n in ((y, h), (x, w)))
    index = _op.add(_op.multiply(row, relax.const(w, "int64")), col)
    return index, _op.multiply(weight, valid), valid


def grid_sample_grad(orig_var, orig_call, output_grad, ctx):
    """[dx, dgrid] of y = grid_sample(x, grid) (NCHW; the grid (N, 2, Ho, Wo), x then y)."""
    data, grid = orig_call.args
    attrs = orig_call.attrs
    method, padding = str(attrs.method), str(attrs.padding_mode)
    align_corners = bool(attrs.align_corners)
    if str(attrs.layout) != "NCHW" or method not in ("bilinear", "nearest") or \
            padding not in ("zeros", "border"):
        raise ValueError(f"grid_sample gradient: {method} sampling with padding mode {padding} "
                         f"({attrs.layout}) is not supported; bilinear or nearest, zeros or "
                         "border padding, NCHW are")
    n, c, h, w = _dims(data)
    ho, wo = _dims(orig_var)[2:]
    p = ho * wo
    border = padding == "border"
    gx = _op.reshape(_op.strided_slice(grid, [1], [0], [1]), (n, 1, p))
    gy = _op.reshape(_op.strided_slice(grid, [1], [1], [2]), (n, 1, p))
    dtype = str(data.ty.dtype)
    ix, slope_x = _source(gx, dtype, w, align_corners, border)
    iy, slope_y = _source(gy, dtype, h, align_corners, border)
    dy = _op.reshape(output_grad, (n, c, p))
    one = relax.const(1.0, dtype)
    if method == "nearest":
        corners = [_corner(_op.round(iy), _op.round(ix), _op.ones((n, 1, p), dtype), dtype, h,
                           w)]
    else:
        x0, y0 = _op.floor(ix), _op.floor(iy)
        x1, y1 = _op.add(x0, one), _op.add(y0, one)
        wx1, wy1 = _op.subtract(ix, x0), _op.subtract(iy, y0)
        wx0, wy0 = _op.subtract(one, wx1), _op.subtract(one, wy1)
        corners = [_corner(y0, x0, _op.multiply(wy0, wx0), dtype, h, w),
                   _corner(y0, x1, _op.multiply(wy0, wx1), dtype, h, w),
                   _corner(y1, x0, _op.multiply(wy1, wx0), dtype, h, w),
                   _corner(y1, x1, _op.multiply(wy1, wx1), dtype, h, w)]
    indices = _op.broadcast_to(_op.concat([i for i, _, _ in corners], axis=2),
                               (n, c, p * len(corners)))
    updates = _op.concat([_op.multiply(dy, wt) for _, wt, _ in corners], axis=2)
    dx = _op.scatter_elements(_op.zeros((n, c, h * w), dtype), indices, updates,
                              axis=2, reduction="add")
    dx = _op.reshape(dx, (n, c, h, w))
    if method == "nearest":  # piecewise constant in the grid
        return [dx, _op.zeros_like(grid)]
    flat = _op.reshape(data, (n, c, h * w))
    v00, v01, v10, v11 = (
        _op.multiply(_op.gather_elements(flat, _op.broadcast_to(i, (n, c, p)), axis=2), valid)
        for i, _, valid in corners)
    # The slopes of the bilinear interpolation along x and along y.
    along_x = _op.add(_op.multiply(wy0, _op.subtract(v01, v00)),
                      _op.multiply(wy1, _op.subtract(v11, v10)))
    along_y = _op.add(_op.multiply(wx0, _op.subtract(v10, v00)),
                      _op.multiply(wx1, _op.subtract(v11, v01)))
    grad_x = _op.multiply(_op.sum(_op.multiply(dy, along_x), axis=[1], keepdims=True), slope_x)
    grad_y = _op.multiply(_op.sum(_op.multiply(dy, along_y), axis=[1], keepdims=True), slope_y)
    dgrid = _op.reshape(_op.concat([grad_x, grad_y], axis=1), (n, 2, ho, wo))
    return [dx, dgrid]
