"""The runtime library's vendor-library functions called directly (src/blas): `tvm_ext.blas.gemm`
over role layouts against numpy, `tvm_ext.blas.conv2d` against a numpy convolution, the errors
(bad roles, wrong extents, dtypes, a missing BLAS), and `tvm_ext.cublas.gemm` and
`tvm_ext.cudnn.conv2d` on this GPU-less machine (clear errors, no crash; the numerical checks
run where there is a GPU)."""

from __future__ import annotations

import ast
import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest
import tvm
import tvm_ffi

from tvm_ext.runtime import blas, library, vendor_libraries

M, N, K, B0, B1, U = 0, 1, 2, 3, 4, -1


def _func(name):
    library.load_library()
    return tvm_ffi.get_global_func(name)


@pytest.fixture(scope="module")
def gemm():
    return _func("tvm_ext.blas.gemm")


@pytest.fixture(scope="module")
def conv():
    return _func("tvm_ext.blas.conv2d")


def _roles(*per_tensor):
    out = []
    for roles in per_tensor:
        out += [len(roles), *roles]
    return out


def _reference(ra, rb, rc, a, b):
    """numpy's C for these roles: unit axes read at 0, missing batch dims broadcast."""
    letter = {M: "m", N: "n", K: "k", B0: "b", B1: "c"}

    def squeeze(x, roles):
        x = x[tuple(0 if r == U else slice(None) for r in roles)]
        return x, "".join(letter[r] for r in roles if r != U)

    (a, sa), (b, sb) = squeeze(a, ra), squeeze(b, rb)
    return np.einsum(f"{sa},{sb}->{''.join(letter[r] for r in rc if r != U)}", a, b)


def _shape(roles, dims):
    return [dims[r] for r in roles]


D = {M: 6, N: 5, K: 7, B0: 3, B1: 2, U: 1}
LAYOUTS = {
    "plain": ((M, K), (K, N), (M, N), {}),
    "A transposed": ((K, M), (K, N), (M, N), {}),
    "B transposed": ((M, K), (N, K), (M, N), {}),
    "both transposed": ((K, M), (N, K), (M, N), {}),
    "C transposed": ((M, K), (K, N), (N, M), {}),
    "batched": ((B0, M, K), (B0, K, N), (B0, M, N), {}),
    "batched, B transposed (Q K^T)": ((B0, M, K), (B0, N, K), (B0, M, N), {}),
    "A broadcast (absent)": ((M, K), (B0, K, N), (B0, M, N), {}),
    "B broadcast (absent)": ((B0, M, K), (K, N), (B0, M, N), {}),
    "unit axis": ((U, M, K), (B0, K, N), (B0, M, N), {}),
    "unit axis of extent 3 read at 0": ((U, M, K), (B0, K, N), (B0, M, N), {U: 3}),
    "batch of extent 1 in A broadcasts": ((B0, M, K), (B0, K, N), (B0, M, N), "a1"),
    "two batch dims": ((B0, B1, M, K), (B0, B1, N, K), (B0, B1, M, N), {}),
    "two batch dims, one broadcast": ((B1, M, K), (B0, B1, K, N), (B0, B1, M, N), {}),
    "batch in the middle of A": ((M, B0, K), (B0, K, N), (B0, M, N), {}),
    "batch in the middle of C": ((B0, M, K), (B0, K, N), (M, B0, N), {}),
    "batch innermost (packed A, B, C)": ((M, K, B0), (K, N, B0), (M, N, B0), {}),
    "vector times matrix (M = 1)": ((M, K), (K, N), (M, N), {M: 1}),
    "matrix times vector (N = 1)": ((B0, M, K), (B0, K, N), (B0, M, N), {N: 1}),
    "K = 0": ((B0, M, K), (K, N), (B0, M, N), {K: 0}),
    "empty batch": ((B0, M, K), (B0, K, N), (B0, M, N), {B0: 0}),
}


def _run_layout(gemm, name, dtype, offset=0):
    ra, rb, rc, extra = LAYOUTS[name]
    dims = {**D, **(extra if isinstance(extra, dict) else {})}
    rng = np.random.default_rng(len(name))
    sa = _shape(ra, dims)
    if extra == "a1":
        sa[ra.index(B0)] = 1
    a = rng.standard_normal(sa).astype(dtype)
    b = rng.standard_normal(_shape(rb, dims)).astype(dtype)
    if extra == "a1":
        expected = _reference((M, K), rb, rc, a[0], b)
    else:
        expected = _reference(ra, rb, rc, a, b)
    c = _tensor(np.full(expected.shape, np.nan, dtype), offset)
    gemm(_tensor(a, offset), _tensor(b, offset), c, *_roles(ra, rb, rc))
    tol = 1e-5 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(c.numpy(), expected, rtol=tol, atol=tol)


def _tensor(x: np.ndarray, offset: int = 0):
    """A tvm tensor of `x`, as a view at `offset` elements into a larger buffer (byte_offset)."""
    if offset == 0:
        return tvm.runtime.tensor(x)
    flat = np.concatenate([np.full(offset, -7, x.dtype), x.ravel()])
    base = tvm.runtime.tensor(flat)
    return base._create_view(x.shape, relative_byte_offset=offset * x.itemsize)


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gemm_layouts_match_numpy(gemm, name, dtype):
    _run_layout(gemm, name, dtype)


@pytest.mark.parametrize("name", ["plain", "batched, B transposed (Q K^T)", "K = 0"])
def test_gemm_reads_and_writes_at_byte_offsets(gemm, name):
    _run_layout(gemm, name, "float32", offset=3)


@pytest.mark.parametrize("batch, m, n, k, b_layout", [
    (8, 16, 16, 64, (B0, N, K)),   # attention scores, 4 heads x 2
    (8, 64, 64, 64, (B0, K, N)),   # attention values
    (3, 96, 80, 72, (B0, K, N)),   # large products, uneven over the threads: one after another
])
def test_gemm_batches_of_attention_shapes(gemm, batch, m, n, k, b_layout):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((batch, m, k)).astype("float32")
    b = rng.standard_normal(_shape(b_layout, {B0: batch, M: m, N: n, K: k})).astype("float32")
    c = tvm.runtime.tensor(np.zeros((batch, m, n), "float32"))
    gemm(tvm.runtime.tensor(a), tvm.runtime.tensor(b), c,
         *_roles((B0, M, K), b_layout, (B0, M, N)))
    expected = a @ (b.transpose(0, 2, 1) if b_layout[1] == N else b)
    np.testing.assert_allclose(c.numpy(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("strategy", ["loop", "pool", "strided"])
def test_gemm_forced_batch_strategies_agree(gemm, strategy, monkeypatch):
    """Every way of running a batch (TVM_EXT_BLAS_BATCH forces one; the automatic choice takes
    only some of them on a given machine) gives the same products."""
    monkeypatch.setenv("TVM_EXT_BLAS_BATCH", strategy)
    for name in LAYOUTS:
        for dtype in ("float32", "float64"):
            _run_layout(gemm, name, dtype)


@pytest.mark.parametrize("roles, shapes, message", [
    (((M, K), (K, N), (M, N)), ((8, 16), (15, 4), (8, 4)), r"K is 16 in A \(axis 1\) but 15 in B"),
    (((M, K), (K, N), (M, N)), ((8, 16), (16, 4), (9, 4)), r"M is 8 in A .* but 9 in C"),
    (((M, K), (K, N), (M, N)), ((8, 16), (16, 4), (8, 5)), r"N is 4 in B .* but 5 in C"),
    (((M, K), (K, N), (M, M)), ((8, 16), (16, 4), (8, 8)), "M appears twice in C"),
    (((M, K), (K, N), (M,)), ((8, 16), (16, 4), (8,)), "C has no axis with role N"),
    (((M, K), (K, N), (M, N, N)), ((8, 16), (16, 4), (8, 4)), "3 roles given for C, which has 2"),
    (((M, N), (K, N), (M, N)), ((8, 16), (16, 4), (8, 4)), r"role 1 \(N\) is not valid for A"),
    (((B1, M, K), (K, N), (B0, M, N)), ((2, 8, 16), (16, 4), (2, 8, 4)),
     "A has batch dim 1, which C does not have"),
    (((M, K), (K, N), (M, U)), ((8, 16), (16, 4), (8, 4)), "C axis 1 has role -1 but extent 4"),
    (((M, K), (K, N), (M, N, B1)), ((8, 16), (16, 4), (8, 4, 2)), "batch dim 0 is not in C"),
    (((B0, M, K), (K, N), (M, N)), ((2, 8, 16), (16, 4), (8, 4)), "A has batch dim 0, which C"),
    (((B0, M, K), (K, N), (B0, M, N)), ((2, 8, 16), (16, 4), (3, 8, 4)),
     r"batch dim 0 is 3 in C but 2 in A"),
    (((M, K), (K, N), (M, -2)), ((8, 16), (16, 4), (8, 4)), r"invalid role -2"),
])
def test_gemm_bad_layouts_are_refused(gemm, roles, shapes, message):
    tensors = [tvm.runtime.tensor(np.zeros(s, "float32")) for s in shapes]
    with pytest.raises(ValueError, match=f"tvm_ext.blas.gemm: .*{message}"):
        gemm(*tensors, *_roles(*roles))


def test_gemm_bad_arguments_are_refused(gemm):
    t = [tvm.runtime.tensor(np.zeros(s, "float32")) for s in ((8, 16), (16, 4), (8, 4))]
    with pytest.raises(ValueError, match="expects"):
        gemm(*t)
    with pytest.raises(ValueError, match="number of C's roles"):
        gemm(*t, 2, M, K, 2, K, N)
    with pytest.raises(ValueError, match="1 extra arguments"):
        gemm(*t, *_roles((M, K), (K, N), (M, N)), 0)
    with pytest.raises(TypeError, match=r"argument 1 \(B\) is not a tensor"):
        gemm(t[0], 3, t[2], *_roles((M, K), (K, N), (M, N)))
    strided = tvm_ffi.from_dlpack(np.zeros((16, 8), "float32")[:, ::2])
    with pytest.raises(ValueError, match="B is not compact row-major"):
        gemm(t[0], strided, t[2], *_roles((M, K), (K, N), (M, N)))


@pytest.mark.parametrize("dtypes, message", [
    (("float16",) * 3, r"float32 or float64 only \(float16 given\)"),
    (("int32",) * 3, r"float32 or float64 only \(int32 given\)"),
    (("float32", "float32", "float64"),
     r"A, B and C must have one dtype \(float32, float32, float64 given\)"),
])
def test_gemm_refuses_other_dtypes(gemm, dtypes, message):
    shapes = ((8, 16), (16, 4), (8, 4))
    t = [tvm.runtime.tensor(np.zeros(s, d)) for s, d in zip(shapes, dtypes, strict=True)]
    with pytest.raises(TypeError, match=message):
        gemm(*t, *_roles((M, K), (K, N), (M, N)))


def _conv_reference(x, w, stride, pad, dilation, groups, out_hw):
    """Direct definition; rows/columns beyond the input read zero (pad covers them)."""
    n, c, h, wd = x.shape
    f, cg, kh, kw = w.shape
    oh, ow = out_hw
    need_h = (oh - 1) * stride[0] + (kh - 1) * dilation[0] + 1
    need_w = (ow - 1) * stride[1] + (kw - 1) * dilation[1] + 1
    xp = np.zeros((n, c, max(need_h, pad[0] + h), max(need_w, pad[1] + wd)), x.dtype)
    xp[:, :, pad[0]:pad[0] + h, pad[1]:pad[1] + wd] = x
    out = np.zeros((n, f, oh, ow), x.dtype)
    fg = f // groups
    for g in range(groups):
        for ky in range(kh):
            for kx in range(kw):
                ys, xs = ky * dilation[0], kx * dilation[1]
                patch = xp[:, g * cg:(g + 1) * cg, ys:ys + stride[0] * oh:stride[0],
                           xs:xs + stride[1] * ow:stride[1]]
                out[:, g * fg:(g + 1) * fg] += np.einsum(
                    "nchw,fc->nfhw", patch, w[g * fg:(g + 1) * fg, :, ky, kx])
    return out


def _out(size, k, stride, pad_before, pad_after, dilation):
    return (size + pad_before + pad_after - dilation * (k - 1) - 1) // stride + 1


CONVS = {  # x shape, w shape, stride, (top, left, bottom, right), dilation, groups
    "3x3 pad 1": ((2, 4, 9, 9), (6, 4, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1),
    "stride 2": ((2, 4, 9, 9), (6, 4, 3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 1),
    "asymmetric pad, stride, dilation": ((1, 4, 10, 12), (4, 4, 3, 2), (1, 2), (0, 1, 2, 1),
                                         (2, 1), 1),
    "bottom/right pad only": ((1, 3, 7, 7), (2, 3, 3, 3), (2, 2), (0, 0, 1, 1), (1, 1), 1),
    "groups": ((2, 8, 8, 8), (6, 4, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 2),
    "depthwise": ((2, 4, 8, 8), (4, 1, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 4),
    "depthwise, multiplier 2": ((1, 3, 6, 6), (6, 1, 3, 3), (2, 1), (1, 0, 1, 2), (1, 1), 3),
    "1x1 (no im2col)": ((2, 8, 7, 7), (16, 8, 1, 1), (1, 1), (0, 0, 0, 0), (1, 1), 1),
    "1x1 stride 2": ((2, 8, 7, 7), (16, 8, 1, 1), (2, 2), (0, 0, 0, 0), (1, 1), 1),
    "7x7 stride 2 (stem), one image": ((1, 3, 32, 32), (64, 3, 7, 7), (2, 2), (3, 3, 3, 3),
                                        (1, 1), 1),
    # A chunk of one output channel (a split along the filters): BLAS refuses a row stride
    # below the row's length even for one row.
    "one output channel": ((2, 4, 9, 9), (1, 4, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1),
    "kernel larger than input": ((1, 2, 2, 2), (3, 2, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1),
    # Weight gradients as the dispatch calls them: images = the forward's input channels,
    # channels = its batch, the filter = dY, the output = dW; stride and dilation swapped
    # (cuDNN runs these as backward-filter convolutions).
    "weight gradient of a 3x3": ((4, 2, 10, 10), (6, 2, 8, 8), (1, 1), (0, 0, 0, 0), (1, 1), 1),
    "weight gradient of a stride-2 3x3": ((3, 2, 11, 11), (5, 2, 5, 5), (1, 1), (0, 0, 0, 0),
                                          (2, 2), 1),
    "depthwise, enough work for the thread pool": ((2, 64, 32, 32), (64, 1, 3, 3), (1, 1),
                                                   (1, 1, 1, 1), (1, 1), 64),
}


@pytest.mark.parametrize("name", list(CONVS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("strategy", ["auto", "pool"])
def test_conv2d_matches_numpy(conv, name, dtype, strategy, monkeypatch):
    monkeypatch.setenv("TVM_EXT_BLAS_BATCH", strategy)
    x_shape, w_shape, stride, pad, dilation, groups = CONVS[name]
    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape).astype(dtype)
    w = rng.standard_normal(w_shape).astype(dtype)
    oh = _out(x_shape[2], w_shape[2], stride[0], pad[0], pad[2], dilation[0])
    ow = _out(x_shape[3], w_shape[3], stride[1], pad[1], pad[3], dilation[1])
    expected = _conv_reference(x, w, stride, pad, dilation, groups, (oh, ow))
    y = tvm.runtime.tensor(np.full(expected.shape, np.nan, dtype))
    conv(tvm.runtime.tensor(x), tvm.runtime.tensor(w), y, stride[0], stride[1], pad[0], pad[1],
         dilation[0], dilation[1], groups)
    tol = 1e-4 if dtype == "float32" else 1e-11
    np.testing.assert_allclose(y.numpy(), expected, rtol=tol, atol=tol)


# Storage orders: which tensor axis holds each role (X: n, c, h, w; W: f, c, kh, kw; Y: n, f,
# h, w). "weight gradient": data and output [C, N, H, W], weight [C, F, KH, KW] (what TVM's
# conv2d gradient computes); the output's images then merge into one product per group.
CONV_LAYOUTS = {
    "weight gradient": ((1, 0, 2, 3), (1, 0, 2, 3), (1, 0, 2, 3)),
    "channels last": ((0, 3, 1, 2), (0, 3, 1, 2), (0, 3, 1, 2)),
    "weight transposed only": ((0, 1, 2, 3), (1, 0, 3, 2), (0, 1, 2, 3)),
}


@pytest.mark.parametrize("layout", list(CONV_LAYOUTS))
@pytest.mark.parametrize("name", ["3x3 pad 1", "stride 2", "groups", "1x1 (no im2col)",
                                  "depthwise, multiplier 2", "one output channel",
                                  "weight gradient of a stride-2 3x3"])
def test_conv2d_reads_any_storage_order(conv, layout, name):
    x_shape, w_shape, stride, pad, dilation, groups = CONVS[name]
    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape).astype("float32")
    w = rng.standard_normal(w_shape).astype("float32")
    oh = _out(x_shape[2], w_shape[2], stride[0], pad[0], pad[2], dilation[0])
    ow = _out(x_shape[3], w_shape[3], stride[1], pad[1], pad[3], dilation[1])
    expected = _conv_reference(x, w, stride, pad, dilation, groups, (oh, ow))
    xa, wa, ya = CONV_LAYOUTS[layout]
    # Stored with role r on axis axes[r]: the storage is the logical array transposed.
    stored = [np.ascontiguousarray(np.transpose(a, np.argsort(axes)))
              for a, axes in ((x, xa), (w, wa))]
    y = tvm.runtime.tensor(np.full(np.transpose(expected, np.argsort(ya)).shape, np.nan,
                                   "float32"))
    conv(*(tvm.runtime.tensor(a) for a in stored), y, stride[0], stride[1], pad[0], pad[1],
         dilation[0], dilation[1], groups, *xa, *wa, *ya)
    np.testing.assert_allclose(np.transpose(y.numpy(), ya), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shapes, ints, dtype, message", [
    (((1, 4, 8, 8), (6, 3, 3, 3), (1, 6, 6, 6)), (1, 1, 0, 0, 1, 1, 1), "float32",
     r"X's channels must be W's input channels \(W.shape\[1\]\) times groups"),
    (((1, 4, 8, 8), (5, 2, 3, 3), (1, 5, 6, 6)), (1, 1, 0, 0, 1, 1, 2), "float32",
     r"W's output channels \(W.shape\[0\]\) must divide by groups"),
    (((1, 4, 8, 8), (6, 4, 3, 3), (1, 5, 6, 6)), (1, 1, 0, 0, 1, 1, 1), "float32",
     "Y's channels must be W's output channels"),
    (((1, 4, 8, 8), (6, 4, 3, 3), (2, 6, 6, 6)), (1, 1, 0, 0, 1, 1, 1), "float32",
     "Y's batch must be X's"),
    (((1, 4, 8, 8), (6, 4, 3, 3), (1, 6, 6, 6)), (0, 1, 0, 0, 1, 1, 1), "float32",
     "strides, dilations and groups must be positive"),
    (((1, 4, 8), (6, 4, 3, 3), (1, 6, 6, 6)), (1, 1, 0, 0, 1, 1, 1), "float32",
     "X, W and Y must be 4-D"),
    (((1, 4, 8, 8), (6, 4, 3, 3), (1, 6, 6, 6)), (1, 1, 0, 0, 1, 1, 1, 0, 1, 2, 3, 0, 0, 2, 3,
                                                   0, 1, 2, 3), "float32",
     "the axes of W must be a permutation of 0..3"),
    (((1, 4, 8, 8), (6, 4, 3, 3), (1, 6, 6, 6)), (1, 1, 0, 0, 1, 1, 1), "float16",
     r"float32 or float64 only \(float16 given\)"),
    (((1, 4, 8, 8), (6, 4, 3, 3), (1, 6, 6, 6)), (1, 1, 0, 0, 1, 1, 1), "float32/float64",
     r"X, W and Y must have one dtype \(float32, float64, float32 given\)"),
])
def test_conv2d_refuses_bad_arguments(conv, shapes, ints, dtype, message):
    dtypes = (dtype.split("/") * 3)[:3]
    x, w, y = (tvm.runtime.tensor(np.zeros(s, d)) for s, d in zip(shapes, dtypes, strict=True))
    error = TypeError if "dtype" in message or "only" in message else ValueError
    with pytest.raises(error, match=f"tvm_ext.blas.conv2d: {message}"):
        conv(x, w, y, *ints)


def test_the_wheel_blas_is_loaded():
    info = blas.cpu_blas_info()
    assert info["path"] == blas.cpu_blas_path() == vendor_libraries.wheel_blas_library()
    assert "OpenBLAS" in info["config"] and info["batch_strided"] and info["error"] == ""


_DEFAULT_NAMES = ("libscipy_openblas.so", "libopenblas.so.0", "libopenblas.so", "libcblas.so.3",
                  "libblas.so.3")
_MISSING_BLAS = """
import ctypes, numpy as np, tvm, tvm_ffi
from tvm_ext.runtime import library
library.load_library()
get = tvm_ffi.get_global_func
get("tvm_ext.blas.set_library")("/nonexistent/set_library/libblas.so")
print(repr(get("tvm_ext.blas.available")()))
t = [tvm.runtime.tensor(np.zeros(s, "float32")) for s in ((2, 2), (2, 2), (2, 2))]
try:
    get("tvm_ext.blas.gemm")(*t, 2, 0, 2, 2, 2, 1, 2, 0, 1)
except Exception as err:
    print(repr(type(err).__name__ + ": " + str(err)))
get("tvm_ext.blas.set_library")({wheel!r})  # back to a BLAS: the next call loads it
get("tvm_ext.blas.gemm")(*t, 2, 0, 2, 2, 2, 1, 2, 0, 1)
print(repr(get("tvm_ext.blas.available")()))
"""


def test_missing_blas_is_a_one_line_error():
    """A machine whose BLAS cannot be loaded: the kernel call raises one line naming what was
    tried and the fix (no crash), and the library recovers once pointed at one."""
    for name in _DEFAULT_NAMES[1:]:
        try:
            ctypes.CDLL(name)
            pytest.skip(f"this machine has a system BLAS ({name}) on the loader's path")
        except OSError:
            pass
    code = _MISSING_BLAS.format(wheel=vendor_libraries.wheel_blas_library())
    env = dict(os.environ, TVM_EXT_BLAS_LIB="/nonexistent/env/libopenblas.so", LD_LIBRARY_PATH="")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ast.literal_eval(line) for line in proc.stdout.strip().splitlines()]
    assert lines[0] == ""
    error = lines[1]
    assert "\n" not in error and error.startswith("RuntimeError: tvm_ext.blas: no CPU BLAS")
    assert "pip install scipy-openblas32" in error and "TVM_EXT_BLAS_LIB" in error
    for tried in ("/nonexistent/set_library/libblas.so", "/nonexistent/env/libopenblas.so",
                  *_DEFAULT_NAMES):
        assert tried in error
    assert lines[2] == vendor_libraries.wheel_blas_library()


def test_configure_leaves_an_explicit_library_alone(monkeypatch):
    """TVM_EXT_BLAS_LIB set: configure() does not point the library at the wheel."""
    calls = []
    monkeypatch.setenv("TVM_EXT_BLAS_LIB", "/some/libcblas.so")
    monkeypatch.setattr(vendor_libraries.tvm_ffi, "get_global_func",
                        lambda name, allow_missing=False: lambda path: calls.append((name, path)))
    vendor_libraries.configure()
    assert all(name != "tvm_ext.blas.set_library" for name, _ in calls)
    monkeypatch.delenv("TVM_EXT_BLAS_LIB")
    vendor_libraries.configure()
    assert ("tvm_ext.blas.set_library", vendor_libraries.wheel_blas_library()) in calls


class _FakeCuda:
    """A host array presented through DLPack as a CUDA tensor: reaches the cuBLAS path's checks
    and its library loading without a GPU (nothing may dereference it)."""

    def __init__(self, array):
        self.array = array

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        capsule = self.array.__dlpack__()
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        ctypes.c_int32.from_address(get(capsule, b"dltensor") + 8).value = 2  # device_type
        return capsule


def _fake_cuda(shape, dtype="float32"):
    return tvm_ffi.from_dlpack(_FakeCuda(np.zeros(shape, dtype)))


def test_cublas_refuses_cpu_tensors_and_other_dtypes():
    cublas = _func("tvm_ext.cublas.gemm")
    shapes, roles = ((8, 16), (16, 4), (8, 4)), _roles((M, K), (K, N), (M, N))
    with pytest.raises(ValueError, match=r"tvm_ext.cublas.gemm: A, B and C must be on one CUDA"):
        cublas(*[tvm.runtime.tensor(np.zeros(s, "float32")) for s in shapes], *roles)
    for dtypes in (("float16", "float16", "float64"), ("int8",) * 3, ("float16", "float32",
                                                                      "float32")):
        t = [_fake_cuda(s, d) for s, d in zip(shapes, dtypes, strict=True)]
        with pytest.raises(TypeError, match=r"tvm_ext.cublas.gemm: unsupported dtypes"):
            cublas(*t, *roles)
    with pytest.raises(ValueError, match=r"tvm_ext.cublas.gemm: K is 16 in A"):
        cublas(_fake_cuda((8, 16)), _fake_cuda((15, 4)), _fake_cuda((8, 4)), *roles)
    assert blas.cublas_workspace_bytes() == 32 << 20


def test_cublas_without_a_gpu_is_a_clear_error():
    """Here there is no libcublas (or, where there is, no GPU): one line, no crash."""
    if tvm.cuda(0).exist:
        pytest.skip("a GPU is present: test_cublas_gemm_matches_numpy_on_the_gpu covers it")
    cublas = _func("tvm_ext.cublas.gemm")
    t = [_fake_cuda(s) for s in ((8, 16), (16, 4), (8, 4))]
    with pytest.raises(RuntimeError) as info:
        cublas(*t, *_roles((M, K), (K, N), (M, N)))
    message = str(info.value)
    assert "\n" not in message and message.startswith("tvm_ext.cublas: ")
    if blas.cublas_path() == "":
        assert "libcublas could not be loaded" in message and "libcublas.so.13" in message
        assert "pip install nvidia-cublas" in message and "TVM_EXT_CUBLAS_LIB" in message


def test_cudnn_refuses_what_it_cannot_compute_before_loading():
    """Arguments are checked before cuDNN is looked for: padding (cuDNN pads symmetrically,
    the dispatch pads before the call), windows past the data's edge, dtypes, devices."""
    cudnn = _func("tvm_ext.cudnn.conv2d")
    x, w, y = _fake_cuda((1, 4, 8, 8)), _fake_cuda((6, 4, 3, 3)), _fake_cuda((1, 6, 6, 6))
    with pytest.raises(ValueError, match=r"tvm_ext\.cudnn\.conv2d: padding must be 0"):
        cudnn(x, w, y, 1, 1, 1, 1, 1, 1, 1)
    with pytest.raises(ValueError, match=r"tvm_ext.cudnn.conv2d: the windows of a 7x6 output "
                                         r"reach 9x8 of a 8x8 input"):
        cudnn(x, w, _fake_cuda((1, 6, 7, 6)), 1, 1, 0, 0, 1, 1, 1)
    f64 = [_fake_cuda(t, "float64") for t in ((1, 4, 8, 8), (6, 4, 3, 3), (1, 6, 6, 6))]
    with pytest.raises(TypeError, match=r"float32, float16 or bfloat16 only \(float64 given"):
        cudnn(*f64, 1, 1, 0, 0, 1, 1, 1)
    with pytest.raises(TypeError, match=r"must have one dtype \(float32, float16, float32"):
        cudnn(x, _fake_cuda((6, 4, 3, 3), "float16"), y, 1, 1, 0, 0, 1, 1, 1)
    cpu = [tvm.runtime.tensor(np.zeros(t, "float32"))
           for t in ((1, 4, 8, 8), (6, 4, 3, 3), (1, 6, 6, 6))]
    with pytest.raises(ValueError, match="X, W and Y must be on one CUDA device"):
        cudnn(*cpu, 1, 1, 0, 0, 1, 1, 1)
    with pytest.raises(ValueError, match=r"tvm_ext\.cudnn\.conv2d: Y's batch must be X's"):
        cudnn(x, w, _fake_cuda((2, 6, 6, 6)), 1, 1, 0, 0, 1, 1, 1)
    assert blas.cudnn_workspace_bytes() == 64 << 20


def test_cudnn_without_a_gpu_is_a_clear_error():
    """Here there is no libcudnn (or, where there is, no GPU): one line, no crash."""
    if tvm.cuda(0).exist:
        pytest.skip("a GPU is present: test_cudnn_conv2d_matches_numpy_on_the_gpu covers it")
    cudnn = _func("tvm_ext.cudnn.conv2d")
    x, w, y = _fake_cuda((1, 4, 8, 8)), _fake_cuda((6, 4, 3, 3)), _fake_cuda((1, 6, 6, 6))
    with pytest.raises(RuntimeError) as info:
        cudnn(x, w, y, 1, 1, 0, 0, 1, 1, 1)
    message = str(info.value)
    assert "\n" not in message and message.startswith("tvm_ext.cudnn: ")
    if blas.cudnn_path() == "":
        assert "libcudnn could not be loaded" in message and "libcudnn.so.9" in message
        assert "pip install nvidia-cudnn" in message and "TVM_EXT_CUDNN_LIB" in message


@pytest.mark.parametrize("layout", [None, *CONV_LAYOUTS])
@pytest.mark.parametrize("name", ["3x3 pad 1", "stride 2", "asymmetric pad, stride, dilation",
                                  "groups", "depthwise, multiplier 2", "1x1 stride 2",
                                  "7x7 stride 2 (stem), one image", "weight gradient of a 3x3",
                                  "weight gradient of a stride-2 3x3"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cudnn_conv2d_matches_numpy_on_the_gpu(name, layout, dtype):
    """The input padded beforehand, as the dispatch does; every storage order; float32
    without TF32 (the tolerance of FMA arithmetic)."""
    if not tvm.cuda(0).exist or not blas.cudnn_path():
        pytest.skip("needs a GPU and libcudnn")
    import ml_dtypes  # bfloat16 for numpy (a dependency of TVM); only where there is a GPU

    cudnn = _func("tvm_ext.cudnn.conv2d")
    x_shape, w_shape, stride, pad, dilation, groups = CONVS[name]
    rng = np.random.default_rng(0)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    x = rng.standard_normal(x_shape).astype(np_dtype).astype("float64")
    w = rng.standard_normal(w_shape).astype(np_dtype).astype("float64")
    oh = _out(x_shape[2], w_shape[2], stride[0], pad[0], pad[2], dilation[0])
    ow = _out(x_shape[3], w_shape[3], stride[1], pad[1], pad[3], dilation[1])
    expected = _conv_reference(x, w, stride, pad, dilation, groups, (oh, ow))
    padded = np.pad(x, ((0, 0), (0, 0), (pad[0], pad[2]), (pad[1], pad[3])))
    xa, wa, ya = CONV_LAYOUTS[layout] if layout else ((0, 1, 2, 3),) * 3
    stored = [np.ascontiguousarray(np.transpose(a, np.argsort(axes))).astype(np_dtype)
              for a, axes in ((padded, xa), (w, wa))]
    dev = tvm.cuda(0)
    y = tvm.runtime.tensor(np.full(np.transpose(expected, np.argsort(ya)).shape, np.nan,
                                   np_dtype), dev)
    cudnn(*(tvm.runtime.tensor(a, dev) for a in stored), y, stride[0], stride[1], 0, 0,
          dilation[0], dilation[1], groups, *xa, *wa, *ya)
    dev.sync()
    tol = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}[dtype]
    got = np.transpose(y.numpy().astype("float64"), ya)
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol * 4 * np.sqrt(w[0].size))


GPU_CASES = [
    ("plain", "float32", "float32"), ("both transposed", "float16", "float32"),
    ("C transposed", "bfloat16", "bfloat16"), ("batched, B transposed (Q K^T)", "float16",
                                               "float16"),
    ("two batch dims, one broadcast", "float32", "float32"),
    ("batch in the middle of C", "float32", "float32"),
    ("batch innermost (packed A, B, C)", "float32", "float32"), ("K = 0", "float32", "float32"),
    ("unit axis of extent 3 read at 0", "float64", "float64"),
]


@pytest.mark.parametrize("name, dtype, c_dtype", GPU_CASES)
def test_cublas_gemm_matches_numpy_on_the_gpu(name, dtype, c_dtype):
    if not tvm.cuda(0).exist or not blas.cublas_path():
        pytest.skip("needs a GPU and libcublas")
    import ml_dtypes  # bfloat16 for numpy (a dependency of TVM); only where there is a GPU

    cublas = _func("tvm_ext.cublas.gemm")
    ra, rb, rc, extra = LAYOUTS[name]
    dims = {**D, **extra}
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    rng = np.random.default_rng(0)
    a = rng.standard_normal(_shape(ra, dims)).astype(np_dtype)
    b = rng.standard_normal(_shape(rb, dims)).astype(np_dtype)
    expected = _reference(ra, rb, rc, a.astype("float64"), b.astype("float64"))
    c_np = ml_dtypes.bfloat16 if c_dtype == "bfloat16" else c_dtype
    dev = tvm.cuda(0)
    c = tvm.runtime.tensor(np.full(expected.shape, np.nan, c_np), dev)
    cublas(tvm.runtime.tensor(a, dev), tvm.runtime.tensor(b, dev), c, *_roles(ra, rb, rc))
    dev.sync()
    tol = {"float32": 1e-4, "float64": 1e-10, "float16": 1e-2, "bfloat16": 5e-2}[c_dtype]
    np.testing.assert_allclose(c.numpy().astype("float64"), expected, rtol=tol, atol=tol * 4)


_THREADS = """
import tvm_ffi
from tvm_ext.runtime import blas
print(blas.cpu_blas_info()["threads"], tvm_ffi.get_global_func("runtime.NumThreads")())
"""


@pytest.mark.parametrize("env", [None, "1"])
def test_the_blas_runs_on_as_many_threads_as_tvm(env):
    """Not OpenBLAS' default of every core: beside a smaller TVM pool it oversubscribes
    (OpenBLAS itself caps the count at the cores it finds)."""
    environ = {k: v for k, v in os.environ.items()
               if k not in ("TVM_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    if env is not None:
        environ["TVM_NUM_THREADS"] = env
    proc = subprocess.run([sys.executable, "-c", _THREADS], capture_output=True, text=True,
                          env=environ, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    blas_threads, tvm_threads = (int(v) for v in proc.stdout.split())
    assert blas_threads == min(tvm_threads, os.cpu_count())
    if env is not None:
        assert tvm_threads == int(env)
