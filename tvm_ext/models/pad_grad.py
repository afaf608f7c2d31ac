"""The gradient of `relax.op.nn.pad` in every mode (TVM has none): constant pads (RWKV's time
shift, with negative widths that cut), and the reflect, replicate and circular pads of
convolutional audio and image models (UNet1D through ONNX, whose `Pad` is read as
`nn.pad` in these modes by `onnx_converters`).

A pad copies each element of x to one or more places of y, axis by axis, so dx sums dy over
the places x's element went: the middle of dy (x's own place), plus, per padded axis, the
strips of dy before and after it carried back where they were read from. Each axis's strips
are carried back on their own (a pad's axes are independent), with slices, `flip` and sums
placed by constant pads: Relax ops whose legalizations the planners and schedules see as any
other kernels. Checked against torch.autograd in tests/test_gradients.py.
"""

from __future__ import annotations

from tvm import relax

_op = relax.op


def _dims(expr: relax.Expr) -> list[int]:
    return [int(v) for v in expr.ty.shape.values]


def pad_grad(orig_var, orig_call, output_grad, ctx):
    x = orig_call.args[0]
    mode = str(orig_call.attrs.pad_mode)
    widths = [int(w) for w in orig_call.attrs.pad_width]
    shape = _dims(x)
    befores, afters = widths[0::2], widths[1::2]
    if mode == "constant":
        return [_constant_pad_grad(output_grad, shape, befores, afters)]
    if mode not in _CARRY_BACK:
        raise ValueError(f"nn.pad gradient: unknown pad mode {mode!r}")
    grad = output_grad
    for axis, (n, b, a) in enumerate(zip(shape, befores, afters, strict=True)):
        if b or a:
            _check_widths(mode, axis, n, b, a)
            grad = _axis_grad(grad, axis, n, b, a, mode, len(shape))
    return [grad]


def _constant_pad_grad(dy, shape, befores, afters):
    """dy at x's place: cut where x was padded, zeros where a negative width cut x."""
    begins = [max(b, 0) for b in befores]
    ends = [b + s + a - max(a, 0) for b, s, a in zip(befores, shape, afters, strict=True)]
    grad = _op.strided_slice(dy, list(range(len(shape))), begins, ends)
    cut = [w for b, a in zip(befores, afters, strict=True) for w in (max(-b, 0), max(-a, 0))]
    return _op.nn.pad(grad, cut) if any(cut) else grad


def _check_widths(mode: str, axis: int, n: int, before: int, after: int) -> None:
    """The widths each mode reads from x alone (as torch allows them)."""
    limit = {"reflect": n - 1, "replicate": None, "circular": n}[mode]
    if min(before, after) < 0 or (limit is not None and max(before, after) > limit) or n < 1:
        bound = "non-negative" if limit is None else f"between 0 and {limit}"
        raise ValueError(f"nn.pad gradient: {mode} widths ({before}, {after}) on axis {axis} of "
                         f"size {n}: widths {bound} are supported")


def _axis_grad(dy, axis, n, before, after, mode, rank):
    """dy's extent n + before + after along `axis` carried back onto x's n."""
    grad = _slice(dy, axis, before, before + n)
    for strip, (lead, trail) in _CARRY_BACK[mode](dy, axis, n, before, after):
        widths = [0] * (2 * rank)
        widths[2 * axis], widths[2 * axis + 1] = lead, trail
        grad = _op.add(grad, _op.nn.pad(strip, widths))
    return grad


def _slice(dy, axis, begin, end):
    return _op.strided_slice(dy, [axis], [begin], [end])


def _reflect(dy, axis, n, before, after):
    """y[before - t] = x[t] and y[before + n - 1 + t] = x[n - 1 - t] (t >= 1): the strips,
    mirrored, land on x[1 : before + 1] and x[n - 1 - after : n - 1]."""
    if before:
        yield _op.flip(_slice(dy, axis, 0, before), axis), (1, n - 1 - before)
    if after:
        end = before + n + after
        yield _op.flip(_slice(dy, axis, before + n, end), axis), (n - 1 - after, 1)


def _replicate(dy, axis, n, before, after):
    """Every place before x's first element holds it, every place after its last holds that."""
    if before:
        yield _op.sum(_slice(dy, axis, 0, before), axis=[axis], keepdims=True), (0, n - 1)
    if after:
        end = before + n + after
        yield _op.sum(_slice(dy, axis, before + n, end), axis=[axis], keepdims=True), (n - 1, 0)


def _circular(dy, axis, n, before, after):
    """The strip before x is x's last `before` elements, the strip after its first `after`."""
    if before:
        yield _slice(dy, axis, 0, before), (n - before, 0)
    if after:
        yield _slice(dy, axis, before + n, before + n + after), (0, n - after)


_CARRY_BACK = {"reflect": _reflect, "replicate": _replicate, "circular": _circular}
