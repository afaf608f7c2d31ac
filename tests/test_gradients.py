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


def _adjoint_vm(build, shapes, wrt):
    """The compiled adjoint of `build(*vars) -> scalar` over float64 arguments of `shapes`."""
    bb = relax.BlockBuilder()
    args = [relax.Var(f"a{i}", relax.TensorType(s, "float64")) for i, s in enumerate(shapes)]
    with bb.function("main", args):
        with bb.dataflow():
            out = bb.emit_output(build(bb, *args))
        bb.emit_func_output(out)
    mod = relax.transform.Gradient("main", require_grads=[args[i] for i in wrt])(bb.get())
    mod = tvm.IRModule({"main": mod["main_adjoint"].with_attr("global_symbol", "main")})
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    return lambda *arrays: vm["main"](*[tvm.runtime.tensor(a) for a in arrays])


@pytest.mark.parametrize(
    "kernel, stride, padding, dilation, groups, size",
    [
        (3, 1, 36, 36, 1, 4),  # DeepLabV3's atrous pyramid: the kernel dilated past the map
        (3, 2, 3, 2, 2, 9),
        (3, 1, 2, 2, 1, 7),
    ],
)
def test_dilated_conv2d_gradient_matches_torch(kernel, stride, padding, dilation, groups, size):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, size, size))
    w = rng.standard_normal((6, 4 // groups, kernel, kernel))
    _conv_grads_match_torch(
        torch, x, w,
        lambda tx, tw: torch.nn.functional.conv2d(tx, tw, None, stride, padding, dilation,
                                                  groups),
        lambda vx, vw: relax.op.nn.conv2d(vx, vw, stride, padding, dilation, groups))


def _conv_grads_match_torch(torch, x, w, torch_conv, relax_conv):
    """sum(conv(x, w) * r) and its gradients by Relax's Gradient against torch.autograd."""
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    y = torch_conv(tx, tw)
    r = np.random.default_rng(1).standard_normal(tuple(y.shape))
    (y * torch.tensor(r)).sum().backward()

    def build(bb, vx, vw, vr):
        return relax.op.sum(relax.op.multiply(bb.emit(relax_conv(vx, vw)), vr))

    loss, (gx, gw) = _adjoint_vm(build, [x.shape, w.shape, r.shape], wrt=[0, 1])(x, w, r)
    assert float(loss.numpy()) == pytest.approx((y * torch.tensor(r)).sum().item())
    np.testing.assert_allclose(gx.numpy(), tx.grad.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(gw.numpy(), tw.grad.numpy(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("cin, cout, kernel, stride, padding, dilation, groups, size", [
    (3, 4, (1, 3, 3), (1, 2, 2), (0, 1, 1), 1, 1, (4, 7, 6)),  # R(2+1)D's spatial conv
    (4, 6, (3, 1, 1), (2, 1, 1), (1, 0, 0), 1, 2, (5, 4, 4)),  # ... and its temporal one
    (3, 4, (3, 3, 3), 1, 2, 2, 1, (4, 5, 6)),
    (4, 4, (2, 2, 2), 3, 0, 1, 4, (7, 7, 8)),  # the weight gradient's conv overhangs
])
def test_conv3d_gradient_matches_torch(cin, cout, kernel, stride, padding, dilation, groups,
                                       size):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, cin, *size))
    w = rng.standard_normal((cout, cin // groups, *kernel))
    _conv_grads_match_torch(
        torch, x, w,
        lambda tx, tw: torch.nn.functional.conv3d(tx, tw, None, stride, padding, dilation,
                                                  groups),
        lambda vx, vw: relax.op.nn.conv3d(vx, vw, stride, padding, dilation, groups))


@pytest.mark.parametrize("size, out", [((1, 1), (7, 7)), ((5, 7), (3, 2)), ((8, 8), (1, 1)),
                                       ((3, 4), (7, 5))])
def test_adaptive_avg_pool2d_gradient_matches_torch(size, out):
    """Windows that overlap, and outputs that repeat an input (VGG's 7 x 7 pool of 1 x 1)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, *size))
    tx = torch.tensor(x, requires_grad=True)
    y = torch.nn.functional.adaptive_avg_pool2d(tx, out)
    r = rng.standard_normal(tuple(y.shape))
    (y * torch.tensor(r)).sum().backward()

    def build(bb, vx, vr):
        pooled = bb.emit(relax.op.nn.adaptive_avg_pool2d(vx, out))
        return relax.op.sum(relax.op.multiply(pooled, vr))

    _, (gx,) = _adjoint_vm(build, [x.shape, r.shape], wrt=[0])(x, r)
    np.testing.assert_allclose(gx.numpy(), tx.grad.numpy(), rtol=1e-12, atol=1e-12)


def test_slice_scatter_gradient_splits_dy():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x, s, r = (rng.standard_normal(shape) for shape in ((6, 5), (6, 2), (6, 5)))
    tx, ts = torch.tensor(x, requires_grad=True), torch.tensor(s, requires_grad=True)
    (torch.slice_scatter(tx, ts, 1, 1, 5, 2) * torch.tensor(r)).sum().backward()

    def build(bb, vx, vs, vr):
        out = bb.emit(relax.op.slice_scatter(vx, vs, 1, 5, 2, axis=1))
        return relax.op.sum(relax.op.multiply(out, vr))

    _, (gx, gs) = _adjoint_vm(build, [x.shape, s.shape, r.shape], wrt=[0, 1])(x, s, r)
    np.testing.assert_array_equal(gx.numpy(), tx.grad.numpy())
    np.testing.assert_array_equal(gs.numpy(), ts.grad.numpy())


def test_concat_of_one_tensor_passes_dy_through():
    rng = np.random.default_rng(0)
    x, r = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))

    def build(bb, vx, vr):
        return relax.op.sum(relax.op.multiply(bb.emit(relax.op.concat([vx], axis=1)), vr))

    _, (gx,) = _adjoint_vm(build, [x.shape, r.shape], wrt=[0])(x, r)
    np.testing.assert_array_equal(gx.numpy(), r)


def test_flip_gradient_flips_dy_back():
    rng = np.random.default_rng(0)
    x, r = rng.standard_normal((2, 5, 3)), rng.standard_normal((2, 5, 3))

    def build(bb, vx, vr):
        return relax.op.sum(relax.op.multiply(bb.emit(relax.op.flip(vx, 1)), vr))

    _, (gx,) = _adjoint_vm(build, [x.shape, r.shape], wrt=[0])(x, r)
    np.testing.assert_array_equal(gx.numpy(), r[:, ::-1])


@pytest.mark.parametrize(
    "cin, cout, kernel, stride, padding, output_padding, dilation, groups",
    [
        (3, 4, 3, 1, 0, 0, 1, 1),
        (3, 4, 3, 2, 1, 1, 1, 1),
        (4, 6, 3, 2, 1, 0, 2, 2),
        (2, 2, 3, (2, 1), (1, 0), (1, 0), (1, 2), 1),
    ],
)
def test_conv2d_transpose_gradient_matches_torch(
    cin, cout, kernel, stride, padding, output_padding, dilation, groups
):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, cin, 5, 4))
    w = rng.standard_normal((cin, cout // groups, kernel, kernel))
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    y = torch.nn.functional.conv_transpose2d(tx, tw, None, stride, padding, output_padding,
                                             groups, dilation)
    r = rng.standard_normal(tuple(y.shape))
    (y * torch.tensor(r)).sum().backward()

    def build(bb, vx, vw, vr):
        out = bb.emit(relax.op.nn.conv2d_transpose(vx, vw, stride, padding, output_padding,
                                                   dilation, groups))
        return relax.op.sum(relax.op.multiply(out, vr))

    step = _adjoint_vm(build, [x.shape, w.shape, r.shape], wrt=[0, 1])
    loss, (gx, gw) = step(x, w, r)
    assert float(loss.numpy()) == pytest.approx(float((y * torch.tensor(r)).sum()))
    np.testing.assert_allclose(gx.numpy(), tx.grad.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(gw.numpy(), tw.grad.numpy(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "axes, begin, end, strides",
    [([1], [1], [9], None), ([1, 2], [1, -5], [9, 100], [3, 1]), ([0, 2], [0, 1], [4, 6], [2, 2])],
)
def test_strided_slice_and_squeeze_gradients_scatter(axes, begin, end, strides):
    """Both are linear: the gradient of sum(f(x) * r) is r put back where f took it from."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 10, 6))
    index = [slice(None)] * 3
    for i, axis in enumerate(axes):
        index[axis] = slice(begin[i], end[i], strides[i] if strides else 1)
    sliced = x[tuple(index)]
    r = rng.standard_normal((1, *sliced.shape))

    def build(bb, vx, vr):
        out = bb.emit(relax.op.strided_slice(vx, axes, begin, end, strides))
        return relax.op.sum(relax.op.multiply(out, relax.op.squeeze(vr, [0])))

    loss, (grad,) = _adjoint_vm(build, [x.shape, r.shape], wrt=[0])(x, r)
    expected = np.zeros_like(x)
    expected[tuple(index)] = r[0]
    np.testing.assert_allclose(grad.numpy(), expected, rtol=0, atol=0)
    assert float(loss.numpy()) == pytest.approx(float((sliced * r[0]).sum()))


def test_clip_gradient_passes_strictly_inside_the_bounds():
    """relu6 as torch.export writes it (clip(x, 0, 6)): dy where 0 < x < 6, none at the bounds
    or beyond (PyTorch's hardtanh backward)."""
    x = np.array([[-1.0, 0.0, 0.5, 3.0], [5.99, 6.0, 7.0, 2.0]])
    r = np.arange(1.0, 9.0).reshape(2, 4)

    def build(bb, vx, vr):
        return relax.op.sum(relax.op.multiply(bb.emit(relax.op.clip(vx, 0.0, 6.0)), vr))

    loss, (grad,) = _adjoint_vm(build, [x.shape, r.shape], wrt=[0])(x, r)
    np.testing.assert_array_equal(grad.numpy(), [[0, 0, 3, 4], [5, 0, 0, 8]])
    assert float(loss.numpy()) == pytest.approx(float((np.clip(x, 0, 6) * r).sum()))


@pytest.mark.parametrize("widths, mode", [
    ([0, 0, 1, 0, 1, 2, 0, 3], "constant"),
    ([0, 0, 1, -1, 0, 0, -2, 1], "constant"),  # RWKV's time shift (one step in, one cut)
    ([0, 0, 0, 0, 3, 1, 0, 4], "reflect"),      # widths up to size - 1 (UNet1D's pads)
    ([0, 0, 2, 2, 0, 0, 1, 0], "reflect"),
    ([0, 0, 1, 2, 5, 3, 0, 1], "replicate"),    # widths past the size: every one the edge's
    ([0, 0, 3, 1, 4, 0, 0, 5], "circular"),     # widths up to the size
])
def test_pad_gradient_matches_torch(widths, mode):
    """The gradient of sum(pad(x) * r) in each mode, as torch.autograd's: a constant pad's is
    r at x's place (zero where a negative width cut x off); the others also carry back the
    strips their pads read from x."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((2, 3, 4, 5))).requires_grad_()
    # Relax pads (before, after) from the first axis on; torch from the last axis back (and
    # its non-constant modes pad only the last three axes).
    torch_widths = [w for b, a in reversed(list(zip(widths[0::2], widths[1::2], strict=True)))
                    for w in (b, a)]
    if mode == "constant":
        padded = torch.nn.functional.pad(x, torch_widths)
    else:
        padded = torch.nn.functional.pad(x, torch_widths[:6], mode)
    r = torch.from_numpy(rng.standard_normal(padded.shape))
    (expected,) = torch.autograd.grad((padded * r).sum(), x)

    def build(bb, vx, vr):
        padded = bb.emit(relax.op.nn.pad(vx, widths, mode))
        return relax.op.sum(relax.op.multiply(padded, vr))

    loss, (grad,) = _adjoint_vm(build, [x.shape, r.shape], wrt=[0])(x.detach().numpy(),
                                                                     r.numpy())
    np.testing.assert_allclose(grad.numpy(), expected.numpy(), rtol=1e-12, atol=1e-12)
    assert float(loss.numpy()) == pytest.approx(float((padded * r).sum().detach()))


@pytest.mark.parametrize("widths, mode, message", [
    ([0, 0, 0, 0, 0, 0, 5, 0], "reflect", "reflect widths \\(5, 0\\) on axis 3 of size 5"),
    ([0, 0, 0, 0, 0, 0, 1, -1], "reflect", "widths between 0 and 4"),
    ([0, 0, 0, 0, 0, 0, 0, 6], "circular", "circular widths \\(0, 6\\) on axis 3"),
])
def test_pad_gradient_refuses_widths_that_read_past_x(widths, mode, message):
    with pytest.raises(Exception, match=message):
        _adjoint_vm(lambda bb, vx: relax.op.sum(bb.emit(relax.op.nn.pad(vx, widths, mode))),
                    [(2, 3, 4, 5)], wrt=[0])


def test_leakyrelu_gradient_is_alpha_at_and_below_zero():
    x = np.array([[-2.0, -0.0, 0.0, 1e-3, 3.0]])
    r = np.array([[1.0, 2.0, 3.0, 4.0, 5.0]])

    def build(bb, vx, vr):
        return relax.op.sum(relax.op.multiply(bb.emit(relax.op.nn.leakyrelu(vx, 0.2)), vr))

    _, (grad,) = _adjoint_vm(build, [x.shape, r.shape], wrt=[0])(x, r)
    np.testing.assert_allclose(grad.numpy(), [[0.2, 0.4, 0.6, 4.0, 5.0]])


def test_masks_and_rounding_pass_no_gradient():
    """floor, floor_divide, sign and bitwise / logical ops on the way from x to the loss add
    nothing to x's gradient (PyTorch's are zeros, or none); x's other use still does."""
    x = np.array([[-1.5, 0.25, 2.0]])
    two = relax.const(2.0, "float64")

    def build(bb, vx):
        keep = bb.emit(relax.op.bitwise_not(relax.op.less(vx, relax.const(0.0, "float64"))))
        step = bb.emit(relax.op.add(relax.op.floor(vx), relax.op.sign(vx)))
        step = bb.emit(relax.op.add(step, relax.op.floor_divide(vx, two)))
        kept = relax.op.where(keep, relax.op.multiply(vx, step), relax.const(0.0, "float64"))
        return relax.op.sum(relax.op.add(bb.emit(kept), vx))

    _, (grad,) = _adjoint_vm(build, [x.shape], wrt=[0])(x)
    step = np.floor(x) + np.sign(x) + np.floor_divide(x, 2.0)
    np.testing.assert_allclose(grad.numpy(), np.where(x >= 0, step, 0.0) + 1.0)


@pytest.mark.parametrize("shape, repeats", [
    ((2, 3), (2, 3)),  # the same rank
    ((2, 3), (3, 1, 2)),  # more repeats than axes: x gains a leading axis
    ((2, 1, 3), (2,)),  # fewer repeats than axes: the leading axes are not repeated
])
def test_tile_gradient_sums_the_copies(shape, repeats):
    """tile is linear: the gradient of sum(tile(x) * r) sums r over the copies of each
    element (numpy's tile has the same semantics)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape)
    tiled = np.tile(x, repeats)
    r = rng.standard_normal(tiled.shape)

    def build(bb, vx, vr):
        return relax.op.sum(relax.op.multiply(bb.emit(relax.op.tile(vx, repeats)), vr))

    loss, (grad,) = _adjoint_vm(build, [x.shape, r.shape], wrt=[0])(x, r)
    # which element of x each element of the tiled tensor is
    source = np.tile(np.arange(x.size).reshape(shape), repeats)
    expected = np.bincount(source.ravel(), weights=r.ravel(), minlength=x.size).reshape(shape)
    np.testing.assert_allclose(grad.numpy(), expected, rtol=1e-12)
    assert float(loss.numpy()) == pytest.approx(float((tiled * r).sum()))


@pytest.mark.parametrize(
    "method, mode, rounding, size",
    [
        ("nearest_neighbor", "half_pixel", "round", (10, 8)),
        ("nearest_neighbor", "asymmetric", "floor", (7, 9)),
        ("linear", "half_pixel", "", (10, 8)),
        ("linear", "align_corners", "", (7, 9)),
        ("linear", "pytorch_half_pixel", "", (3, 2)),
        ("cubic", "half_pixel", "", (7, 9)),
    ],
)
def test_resize2d_gradient_matches_differences(method, mode, rounding, size):
    """resize2d is linear, so unit differences are exact (TVM interpolates with float32
    weights even in float64, which rules out small steps)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2, 5, 4))
    r = rng.standard_normal((1, 2, *size))

    def build(bb, vx, vr):
        out = bb.emit(relax.op.image.resize2d(vx, size, method=method,
                                              coordinate_transformation_mode=mode,
                                              rounding_method=rounding))
        return relax.op.sum(relax.op.multiply(out, vr))

    step = _adjoint_vm(build, [x.shape, r.shape], wrt=[0])
    _, (grad,) = step(x, r)
    diff = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[idx] += 1.0
        minus[idx] -= 1.0
        diff[idx] = (float(step(plus, r)[0].numpy()) - float(step(minus, r)[0].numpy())) / 2
    np.testing.assert_allclose(grad.numpy(), diff, rtol=1e-5, atol=1e-5)


def _torch_case(torch, kind):
    """(module in eval mode, input) for one op the training step of a .pt2 file goes through."""
    functional = torch.nn.functional
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(4, 8, 3, padding=1)
            if kind == "conv_transpose2d":
                self.up = torch.nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1)
            if kind == "group_norm":
                self.norm = torch.nn.GroupNorm(2, 8)
            if kind.startswith("instance_norm"):  # RAFT's feature encoder: not affine
                self.norm = torch.nn.InstanceNorm2d(8, affine=kind.endswith("affine"))

        def forward(self, x):
            y = self.conv(x)
            if kind == "conv_transpose2d":
                y = self.up(y)
            elif kind == "group_norm" or kind.startswith("instance_norm"):
                y = self.norm(y)
            elif kind == "detach":  # the gradient through one factor only
                y = y * torch.tanh(y).detach()
            elif kind == "grid_sample":  # RAFT's lookup: the grid computed from the features
                grid = torch.tanh(y[:, :2].permute(0, 2, 3, 1)) * 1.1
                y = functional.grid_sample(y, grid, align_corners=True)
            elif kind == "unfold":  # ConvBERT's span convolution: overlapping windows
                y = functional.unfold(y, (3, 1), padding=(1, 0)).unsqueeze(-1)
            elif kind == "fold":  # MobileViTV2's folding: col2im, an accumulating index_put
                y = functional.fold(functional.unfold(y, 2, stride=2), (6, 6), 2, stride=2)
                y = torch.cat([y, functional.fold(y.flatten(2)[:, :, :25], (6, 6), 2)], 1)
            elif kind == "tensor_unfold":  # overlapping windows along an axis
                y = y.unfold(2, 3, 2)
            elif kind == "index_joint":  # two index tensors beside a slice, repeats
                rows = torch.tensor([[0, 2, 2], [5, 0, 3]])
                y = y[:, :, rows, torch.tensor([1, 1, 4])]
            elif kind == "pixel_shuffle":
                y = functional.pixel_shuffle(y, 2)
            elif kind == "interpolate_nearest":
                y = functional.interpolate(y, scale_factor=2, mode="nearest")
            elif kind == "interpolate_bilinear":
                y = functional.interpolate(y, scale_factor=2, mode="bilinear")
            elif kind == "avg_pool2d":
                y = functional.avg_pool2d(y, 2)
            elif kind == "max_pool2d":
                y = functional.max_pool2d(y, 2)
            return y.flatten(1)

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
            return functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    if kind == "sdpa":
        return Attention().eval(), torch.randn(2, 8, 16)
    return Net().eval(), torch.randn(2, 4, 6, 6)


@pytest.mark.parametrize(
    "kind",
    ["conv_transpose2d", "group_norm", "instance_norm", "instance_norm_affine", "grid_sample",
     "detach", "unfold", "fold", "tensor_unfold", "index_joint", "pixel_shuffle",
     "interpolate_nearest", "interpolate_bilinear", "avg_pool2d", "max_pool2d", "sdpa"],
)
def test_pt2_training_step_matches_torch_autograd(tmp_path, kind):
    torch = pytest.importorskip("torch")
    net, x = _torch_case(torch, kind)
    _pt2_step_matches_autograd(torch, tmp_path, net, x, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "cin, cout, kernel, stride, padding, dilation, groups, width",
    [
        (3, 4, 3, 1, 0, 1, 1, 11),
        (3, 4, 3, 2, 1, 1, 1, 11),
        (3, 4, 3, 3, 0, 1, 1, 13),  # the weight gradient's conv overhangs the kernel
        (4, 6, 3, 3, 2, 2, 2, 11),
        (4, 8, 3, 2, 1, 1, 4, 12),
        (4, 4, 8, 4, 0, 1, 1, 30),
    ],
)
def test_conv1d_gradient_matches_torch(cin, cout, kernel, stride, padding, dilation, groups,
                                       width):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, cin, width))
    w = rng.standard_normal((cout, cin // groups, kernel))
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    y = torch.nn.functional.conv1d(tx, tw, None, stride, padding, dilation, groups)
    r = rng.standard_normal(tuple(y.shape))
    (y * torch.tensor(r)).sum().backward()

    def build(bb, vx, vw, vr):
        out = bb.emit(relax.op.nn.conv1d(vx, vw, stride, padding, dilation, groups))
        return relax.op.sum(relax.op.multiply(out, vr))

    loss, (gx, gw) = _adjoint_vm(build, [x.shape, w.shape, r.shape], wrt=[0, 1])(x, w, r)
    assert float(loss.numpy()) == pytest.approx((y * torch.tensor(r)).sum().item())
    np.testing.assert_allclose(gx.numpy(), tx.grad.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(gw.numpy(), tw.grad.numpy(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "cin, cout, kernel, stride, padding, output_padding, dilation, groups",
    [(3, 4, 3, 1, 0, 0, 1, 1), (3, 4, 3, 2, 1, 1, 1, 1), (4, 6, 3, 2, 1, 1, 2, 2)],
)
def test_conv1d_transpose_gradient_matches_torch(cin, cout, kernel, stride, padding,
                                                 output_padding, dilation, groups):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, cin, 7))
    w = rng.standard_normal((cin, cout // groups, kernel))
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    y = torch.nn.functional.conv_transpose1d(tx, tw, None, stride, padding, output_padding,
                                             groups, dilation)
    r = rng.standard_normal(tuple(y.shape))
    (y * torch.tensor(r)).sum().backward()

    def build(bb, vx, vw, vr):
        out = bb.emit(relax.op.nn.conv1d_transpose(vx, vw, stride, padding, output_padding,
                                                   dilation, groups))
        return relax.op.sum(relax.op.multiply(out, vr))

    loss, (gx, gw) = _adjoint_vm(build, [x.shape, w.shape, r.shape], wrt=[0, 1])(x, w, r)
    assert float(loss.numpy()) == pytest.approx((y * torch.tensor(r)).sum().item())
    np.testing.assert_allclose(gx.numpy(), tx.grad.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(gw.numpy(), tw.grad.numpy(), rtol=1e-10, atol=1e-10)


def _pt2_step_matches_autograd(torch, tmp_path, net, x, rtol=1e-5, atol=1e-6):
    """The compiled training step of `net` exported to a .pt2 file: loss and gradients
    against torch.autograd on the same weights."""
    from tvm_ext import driver
    from tvm_ext.models import load_model

    path = str(tmp_path / "net.pt2")
    torch.export.save(torch.export.export(net, (x,)), path)
    step = load_model(path, training=True)
    target = torch.randn(net(x).shape)
    executable = driver.build(step, tvm.target.Target("llvm"))
    arguments = [x.numpy(), target.numpy(), *step.random_params()]
    loss, *grads = driver.run(executable, arguments, tvm.cpu(), repeat=0).outputs
    expected = ((net(x) - target) ** 2).mean()
    expected.backward()
    assert float(loss) == pytest.approx(expected.item(), rel=1e-5)
    params = dict(net.named_parameters())
    for name, grad in zip(step.config["gradients"], grads, strict=True):
        ref = params[name.removeprefix("p_").replace("_", ".")].grad.numpy()
        np.testing.assert_allclose(grad, ref, rtol=rtol, atol=atol, err_msg=name)
    return dict(zip(step.config["gradients"], grads, strict=True))


def test_pt2_conv1d_training_step_matches_torch_autograd(tmp_path):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv1d(4, 8, 5, stride=2, padding=2),
        torch.nn.GELU(),
        torch.nn.Conv1d(8, 8, 3, padding=2, dilation=2, groups=4),
        torch.nn.ConvTranspose1d(8, 4, 4, stride=2, padding=1),
    ).eval()
    _pt2_step_matches_autograd(torch, tmp_path, net, torch.randn(2, 4, 24))


def test_pt2_padded_embedding_gives_the_padding_row_no_gradient(tmp_path):
    """The padding row gets no gradient from the lookup, but does from another use of the
    same (tied) weight, as in PyTorch."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8, padding_idx=0)
            self.pos = torch.nn.Embedding(16, 8, padding_idx=3)
            self.fc = torch.nn.Linear(8, 4)

        def forward(self, ids):
            h = self.emb(ids) + self.pos(ids)
            return torch.cat([self.fc(h), h @ self.pos.weight.T], dim=-1)

    ids = torch.tensor([[0, 3, 5, 0], [2, 0, 7, 3]])
    grads = _pt2_step_matches_autograd(torch, tmp_path, Net().eval(), ids)
    assert not grads["p_emb_weight"][0].any()
    assert grads["p_pos_weight"][3].any()


def test_where_gradient_sums_over_broadcast_branches():
    """Each branch's gradient has its own shape, summed over the axes it was broadcast along
    (TVM's built-in gradient keeps the output's shape)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    c, x, y, r = (rng.standard_normal(s) for s in [(4, 1, 3), (1, 5, 3), (4, 5, 1), (4, 5, 3)])
    tx, ty = torch.tensor(x, requires_grad=True), torch.tensor(y, requires_grad=True)
    (torch.where(torch.tensor(c) > 0, tx, ty) * torch.tensor(r)).sum().backward()

    def build(bb, vc, vx, vy, vr):
        cond = bb.emit(relax.op.greater(vc, relax.const(0.0, "float64")))
        return relax.op.sum(relax.op.multiply(relax.op.where(cond, vx, vy), vr))

    _, (gx, gy) = _adjoint_vm(build, [(4, 1, 3), (1, 5, 3), (4, 5, 1), (4, 5, 3)], [1, 2])(
        c, x, y, r)
    np.testing.assert_allclose(gx.numpy(), tx.grad.numpy(), rtol=1e-10)
    np.testing.assert_allclose(gy.numpy(), ty.grad.numpy(), rtol=1e-10)


def test_gather_elements_gradient_accumulates_repeated_indices():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x, r = rng.standard_normal((3, 4)), rng.standard_normal((3, 5))
    idx = np.array([[0, 3, 3, 1, 0], [2, 2, 2, 0, 1], [1, 0, 3, 3, 3]], dtype="int64")
    tx = torch.tensor(x, requires_grad=True)
    (torch.gather(tx, 1, torch.tensor(idx)) * torch.tensor(r)).sum().backward()

    def build(bb, vx, vr):
        g = relax.op.gather_elements(vx, relax.const(idx), axis=1)
        return relax.op.sum(relax.op.multiply(g, vr))

    _, (gx,) = _adjoint_vm(build, [(3, 4), (3, 5)], [0])(x, r)
    np.testing.assert_allclose(gx.numpy(), tx.grad.numpy(), rtol=1e-10)


@pytest.mark.parametrize("accumulate", [True, False])
@pytest.mark.parametrize("values_shape", [(2, 3), (3,), (1, 1)])
def test_index_put_gradient_matches_torch(accumulate, values_shape):
    """Index tensors of different ranks broadcast jointly, with a repeated place; the values
    broadcast against the picked shape (their gradient sums over those axes)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x, v, r = (rng.standard_normal(s) for s in ((4, 6, 5), values_shape, (4, 6, 5)))
    index = (np.array([[1], [3]]), np.array([0, 4, 0]), np.array([[2, 2, 2]]))
    tx, tv = torch.tensor(x, requires_grad=True), torch.tensor(v, requires_grad=True)
    out = tx.index_put(tuple(torch.tensor(i) for i in index), tv, accumulate=accumulate)
    (out * torch.tensor(r)).sum().backward()

    def build(bb, vx, vv, vr):
        put = relax.op.index_put(vx, relax.Tuple([relax.const(i) for i in index]), vv,
                                 accumulate=accumulate)
        return relax.op.sum(relax.op.multiply(put, vr))

    _, (gx, gv) = _adjoint_vm(build, [x.shape, v.shape, r.shape], [0, 1])(x, v, r)
    np.testing.assert_allclose(gx.numpy(), tx.grad.numpy(), rtol=1e-10)
    np.testing.assert_allclose(gv.numpy(), tv.grad.numpy(), rtol=1e-10)


@pytest.mark.parametrize("idx, axis", [
    (np.array([[0, 3, 3], [1, 0, 2]]), 1),   # 2-D indices into a middle axis, repeats
    (np.array([[[2]], [[0]]]), 0),            # 3-D indices into the first
    (np.array(3), 1),                         # a scalar index drops the axis
])
def test_take_gradient_with_indices_of_any_rank(idx, axis):
    """TVM's `take_backward` reads 1-D indices only (position ids [1, seq] failed to
    legalize); the gradient flattens them and merges the output gradient's index axes."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 2))
    out_shape = x.shape[:axis] + idx.shape + x.shape[axis + 1:]
    r = rng.standard_normal(out_shape)
    tx = torch.tensor(x, requires_grad=True)
    taken = torch.index_select(tx, axis, torch.tensor(idx.reshape(-1))).reshape(out_shape)
    (taken * torch.tensor(r)).sum().backward()

    def build(bb, vx, vr):
        t = relax.op.take(vx, relax.const(idx.astype("int64")), axis=axis)
        return relax.op.sum(relax.op.multiply(t, vr))

    _, (gx,) = _adjoint_vm(build, [x.shape, out_shape], [0])(x, r)
    np.testing.assert_allclose(gx.numpy(), tx.grad.numpy(), rtol=1e-10)


def test_pt2_class_token_pooling_matches_torch_autograd(tmp_path):
    """A ViT-style pooler reading the class token, `h[:, 0]` (CLIP, DINOv2), exports as a
    `take` of a scalar index: the training step compiles and its gradients are torch's."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mix = torch.nn.Linear(8, 8)
            self.fc = torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(torch.tanh(self.mix(x))[:, 0])

    _pt2_step_matches_autograd(torch, tmp_path, Net().eval(), torch.randn(2, 6, 8))


@pytest.mark.parametrize("size, kernel, stride, padding, ceil_mode, count_include_pad", [
    (5, 2, 2, 0, True, True),     # the last window runs past the input
    (6, 4, 3, 1, True, True),     # ... past the padding
    (1, 320, 320, 0, True, True),  # EfficientNet's final pool over a 1 x 1 map
    (6, 3, 2, 0, True, False),
    (7, 3, 3, 1, False, True),
    (5, 3, 2, 1, True, True),     # ceil mode, every window inside the padded input
])
def test_avg_pool2d_gradient_matches_torch(size, kernel, stride, padding, ceil_mode,
                                           count_include_pad):
    """A window that runs past the padded input is averaged over what it covers there (as
    PyTorch does), and so is its gradient; TVM's own divides that one by the whole window."""
    _avg_pool_gradient_matches_torch("avg_pool2d", (2, 3, size, size), kernel, stride, padding,
                                     ceil_mode, count_include_pad)


@pytest.mark.parametrize("size, kernel, stride, padding, ceil_mode, count_include_pad", [
    (9, 3, 2, 1, False, True),
    (8, 3, 3, 1, True, True),     # the last window runs past the padded input
    (7, 2, 2, 1, True, False),
])
def test_avg_pool1d_gradient_matches_torch(size, kernel, stride, padding, ceil_mode,
                                           count_include_pad):
    _avg_pool_gradient_matches_torch("avg_pool1d", (2, 3, size), kernel, stride, padding,
                                     ceil_mode, count_include_pad)


def _avg_pool_gradient_matches_torch(op, shape, kernel, stride, padding, ceil_mode,
                                     count_include_pad):
    """The loss and input gradient of `op` (`avg_pool1d` / `avg_pool2d`) against
    torch.autograd's in float64."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape)
    tx = torch.tensor(x, requires_grad=True)
    y = getattr(torch.nn.functional, op)(tx, kernel, stride, padding, ceil_mode=ceil_mode,
                                         count_include_pad=count_include_pad)
    r = rng.standard_normal(tuple(y.shape))
    (y * torch.tensor(r)).sum().backward()

    def build(bb, vx, vr):
        pooled = getattr(relax.op.nn, op)(vx, kernel, stride, padding, ceil_mode=ceil_mode,
                                          count_include_pad=count_include_pad)
        return relax.op.sum(relax.op.multiply(pooled, vr))

    loss, (gx,) = _adjoint_vm(build, [x.shape, r.shape], [0])(x, r)
    assert float(loss.numpy()) == pytest.approx(float((y.detach() * torch.tensor(r)).sum()),
                                                rel=1e-10)
    np.testing.assert_allclose(gx.numpy(), tx.grad.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("op, axis, keepdims", [
    ("max", [1], False), ("min", [0, 2], True), ("max", None, False),
])
def test_max_and_min_over_axes_share_the_gradient_among_ties_as_torch(op, axis, keepdims):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 3, (3, 4, 2)).astype(np.float64)  # small integers: many ties
    tx = torch.tensor(x, requires_grad=True)
    reduce = getattr(torch, f"a{op}")
    y = reduce(tx, dim=tuple(axis) if axis else tuple(range(3)), keepdim=keepdims)
    r = rng.standard_normal(tuple(y.shape))
    (y * torch.tensor(r)).sum().backward()

    def build(bb, vx, vr):
        return relax.op.sum(relax.op.multiply(getattr(relax.op, op)(vx, axis, keepdims), vr))

    loss, (gx,) = _adjoint_vm(build, [x.shape, r.shape], [0])(x, r)
    assert float(loss.numpy()) == pytest.approx(float((y.detach() * torch.tensor(r)).sum()))
    np.testing.assert_allclose(gx.numpy(), tx.grad.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_stack_gradient_gives_each_tensor_its_slice(axis):
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal((2, 3)) for _ in range(3))
    r = rng.standard_normal(np.stack([a, b, c], axis).shape)

    def build(bb, va, vb, vc, vr):
        stacked = relax.op.stack([va, relax.op.multiply(vb, vb), vc], axis)
        return relax.op.sum(relax.op.multiply(stacked, vr))

    _, grads = _adjoint_vm(build, [a.shape, b.shape, c.shape, r.shape], [0, 1, 2])(a, b, c, r)
    parts = np.moveaxis(r, axis, 0)
    for got, want in zip(grads, [parts[0], 2 * b * parts[1], parts[2]], strict=True):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-12)


@pytest.mark.parametrize("equation, shapes", [
    ("bclhn,bcshn->bclsh", [(2, 2, 3, 2, 4), (2, 2, 3, 2, 4)]),  # Mamba2's chunked scan
    ("ij,jk", [(3, 4), (4, 5)]),  # implicit output
    ("...ij,...jk->...ik", [(2, 1, 3, 4), (3, 4, 2)]),  # ellipsis, broadcast over a dim of 1
    ("ij,j->i", [(3, 4), (1,)]),  # a letter broadcast from 1
    ("abc,c->a", [(2, 3, 4), (4,)]),  # b summed in the first operand alone
    ("i,i,i->", [(5,), (5,), (5,)]),
])
def test_einsum_gradient_matches_torch(equation, shapes):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(s) for s in shapes]
    ts = [torch.tensor(x, requires_grad=True) for x in xs]
    y = torch.einsum(equation, *ts)
    r = rng.standard_normal(tuple(y.shape))
    (y * torch.tensor(r)).sum().backward()

    def build(bb, *vs):
        return relax.op.sum(relax.op.multiply(relax.op.einsum(list(vs[:-1]), equation),
                                              vs[-1]))

    loss, grads = _adjoint_vm(build, [*shapes, r.shape], list(range(len(xs))))(*xs, r)
    assert float(loss.numpy()) == pytest.approx(float((y.detach() * torch.tensor(r)).sum()))
    for got, t in zip(grads, ts, strict=True):
        np.testing.assert_allclose(got.numpy(), t.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_an_einsum_gradient_over_a_diagonal_is_refused_by_name():
    with pytest.raises(ValueError, match="repeat an index"):
        _adjoint_vm(lambda bb, v, r: relax.op.sum(relax.op.multiply(
            relax.op.einsum([v], "ii->i"), r)), [(3, 3), (3,)], [0])


@pytest.mark.parametrize("reduction", ["update", "add"])
def test_scatter_nd_gradient_matches_torch_index_put(reduction):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 4, 3))
    rows = np.array([[4, 1], [0, 2], [2, 3]])  # (row, col) pairs: ScatterND's last dim
    u = rng.standard_normal((3, 3))
    tx, tu = (torch.tensor(a, requires_grad=True) for a in (x, u))
    y = torch.index_put(tx, (torch.tensor(rows[:, 0]), torch.tensor(rows[:, 1])), tu,
                        accumulate=reduction == "add")
    r = rng.standard_normal(tuple(y.shape))
    (y * torch.tensor(r)).sum().backward()

    def build(bb, vx, vu, vr):
        idx = relax.const(rows, "int64")
        return relax.op.sum(relax.op.multiply(relax.op.scatter_nd(vx, idx, vu, reduction),
                                              vr))

    loss, (gx, gu) = _adjoint_vm(build, [x.shape, u.shape, r.shape], [0, 1])(x, u, r)
    assert float(loss.numpy()) == pytest.approx(float((y.detach() * torch.tensor(r)).sum()))
    np.testing.assert_allclose(gx.numpy(), tx.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(gu.numpy(), tu.grad.numpy(), rtol=1e-12)


def test_relu_gradient_at_zero_is_pytorchs():
    """ReLU passes no gradient where its input is exactly 0, as PyTorch's; TVM's passes it
    (RegNet's first layer: a 1x1 convolution of an all-zero map plus a zero bias)."""
    torch = pytest.importorskip("torch")
    x = np.array([[-1.0, 0.0, 2.0, 0.0]])
    r = np.array([[3.0, 5.0, 7.0, 11.0]])
    tx = torch.tensor(x, requires_grad=True)
    (torch.relu(tx) * torch.tensor(r)).sum().backward()

    def build(bb, vx, vr):
        return relax.op.sum(relax.op.multiply(relax.op.nn.relu(vx), vr))

    _, (gx,) = _adjoint_vm(build, [x.shape, r.shape], [0])(x, r)
    np.testing.assert_array_equal(gx.numpy(), tx.grad.numpy())
    assert gx.numpy().tolist() == [[0.0, 0.0, 7.0, 0.0]]


@pytest.mark.parametrize("ret_type, largest, axis", [
    ("both", True, -1),     # a mixture of experts' routing weights
    ("values", False, 0),
])
def test_topk_gradient_puts_dy_where_the_values_came_from(ret_type, largest, axis):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 6))
    r = rng.standard_normal((2, 6) if axis == 0 else (4, 2))
    tx = torch.tensor(x, requires_grad=True)
    values = torch.topk(tx, 2, dim=axis, largest=largest).values
    (values * torch.tensor(r)).sum().backward()

    def build(bb, vx, vr):
        out = bb.emit(relax.op.topk(vx, 2, axis, ret_type, largest, "int64"))
        if ret_type == "both":
            out = relax.TupleGetItem(out, 0)
        return relax.op.sum(relax.op.multiply(out, vr))

    _, (gx,) = _adjoint_vm(build, [x.shape, r.shape], [0])(x, r)
    np.testing.assert_allclose(gx.numpy(), tx.grad.numpy(), rtol=1e-10)


@pytest.mark.parametrize("method", ["bilinear", "nearest"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border"])
@pytest.mark.parametrize("align_corners", [True, False])
def test_grid_sample_gradient_matches_torch(method, padding_mode, align_corners):
    """RAFT's correlation lookup: points inside, on the edges and outside the image (the
    grid reaches past [-1, 1]), against torch.autograd for the input and the grid."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 5, 6))
    grid = rng.uniform(-1.3, 1.3, (2, 4, 7, 2))  # torch's (N, Ho, Wo, 2)
    grid[0, 0, :3] = [[-1.0, -1.0], [1.0, 1.0], [1.0, -1.0]]  # edges exactly
    tx = torch.tensor(x, requires_grad=True)
    tg = torch.tensor(grid, requires_grad=True)
    y = torch.nn.functional.grid_sample(tx, tg, method, padding_mode, align_corners)
    r = rng.standard_normal(tuple(y.shape))
    (y * torch.tensor(r)).sum().backward()

    def build(bb, vx, vg, vr):
        y = bb.emit(relax.op.image.grid_sample(vx, relax.op.permute_dims(vg, [0, 3, 1, 2]),
                                               method, "NCHW", padding_mode, align_corners))
        return relax.op.sum(relax.op.multiply(y, vr))

    loss, (gx, gg) = _adjoint_vm(build, [x.shape, grid.shape, r.shape], wrt=[0, 1])(x, grid, r)
    assert float(loss.numpy()) == pytest.approx((y * torch.tensor(r)).sum().item())
    np.testing.assert_allclose(gx.numpy(), tx.grad.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(gg.numpy(), tg.grad.numpy(), rtol=1e-10, atol=1e-10)


def test_a_grid_sample_gradient_it_cannot_take_is_refused_by_name():
    def build(bb, vx, vg):
        y = bb.emit(relax.op.image.grid_sample(vx, vg, "bilinear", "NCHW", "reflection"))
        return relax.op.sum(y)

    with pytest.raises(Exception, match="grid_sample gradient: bilinear sampling with padding "
                                        "mode reflection"):
        _adjoint_vm(build, [(1, 1, 3, 3), (1, 2, 2, 2)], wrt=[0])
