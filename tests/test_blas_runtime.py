"""The runtime library's vendor-library functions called directly: `tvm_ext.blas.gemm` over
role layouts against numpy, `tvm_ext.blas.conv2d` against a numpy convolution, and the errors
(bad roles, wrong extents, dtypes, a missing BLAS, cuBLAS without a GPU)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import tvm
import tvm_ffi

from tvm_ext.runtime import blas, library

M, N, K, B0, B1, U = 0, 1, 2, 3, 4, -1


@pytest.fixture(scope="module")
def gemm():
    library.load_library()
    return tvm_ffi.get_global_func("tvm_ext.blas.gemm")


def _roles(*per_tensor):
    out = []
    for roles in per_tensor:
        out += [len(roles), *roles]
    return out


def _einsum_axes(roles):
    return "".join({M: "m", N: "n", K: "k", B0: "b", B1: "c", U: ""}[r] for r in roles)


CASES = [
    ((M, K), (K, N), (M, N), (8, 16), (16, 4)),
    ((K, M), (K, N), (M, N), (16, 8), (16, 4)),  # A transposed
    ((M, K), (N, K), (M, N), (8, 16), (4, 16)),  # B transposed
    ((M, K), (K, N), (N, M), (8, 16), (16, 4)),  # C transposed
    ((B0, M, K), (B0, K, N), (B0, M, N), (3, 8, 16), (3, 16, 4)),
    ((M, K), (B0, K, N), (B0, M, N), (8, 16), (3, 16, 4)),  # A broadcast
    ((U, M, K), (B0, K, N), (B0, M, N), (1, 8, 16), (3, 16, 4)),  # unit axis
    ((B0, B1, M, K), (B0, B1, N, K), (B0, B1, M, N), (2, 3, 8, 16), (2, 3, 4, 16)),
    ((M, B0, K), (B0, K, N), (B0, M, N), (8, 3, 16), (3, 16, 4)),  # batch in the middle
    ((M, K), (K, N), (M, N), (8, 0), (0, 4)),  # K = 0: zeros
]


@pytest.mark.parametrize("ra, rb, rc, sa, sb", CASES)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gemm_layouts_match_numpy(gemm, ra, rb, rc, sa, sb, dtype):
    rng = np.random.default_rng(0)
    a = rng.standard_normal(sa).astype(dtype)
    b = rng.standard_normal(sb).astype(dtype)
    spec = f"{_einsum_axes(ra)},{_einsum_axes(rb)}->{_einsum_axes(rc)}"
    a_in = a.reshape([s for s, r in zip(sa, ra, strict=True) if r != U])
    expected = np.einsum(spec, a_in, b)
    c = tvm.runtime.tensor(np.full(expected.shape, np.nan, dtype))
    gemm(tvm.runtime.tensor(a), tvm.runtime.tensor(b), c, *_roles(ra, rb, rc))
    tol = 1e-5 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(c.numpy(), expected, rtol=tol, atol=tol)


def test_gemm_large_batch_of_small_matrices(gemm):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((64, 16, 16)).astype("float32")
    b = rng.standard_normal((64, 16, 16)).astype("float32")
    c = tvm.runtime.tensor(np.zeros((64, 16, 16), "float32"))
    gemm(tvm.runtime.tensor(a), tvm.runtime.tensor(b), c,
         *_roles((B0, M, K), (B0, K, N), (B0, M, N)))
    np.testing.assert_allclose(c.numpy(), a @ b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("roles, shapes, message", [
    (((M, K), (K, N), (M, N)), ((8, 16), (15, 4), (8, 4)), "extent"),
    (((M, K), (K, N), (M, M)), ((8, 16), (16, 4), (8, 8)), "matrix role"),
    (((M, K), (K, N), (M, N, N)), ((8, 16), (16, 4), (8, 4)), "roles"),
    (((M, K), (K, N), (M, U)), ((8, 16), (16, 4), (8, 4)), "not valid"),
])
def test_gemm_bad_layouts_are_refused(gemm, roles, shapes, message):
    tensors = [tvm.runtime.tensor(np.zeros(s, "float32")) for s in shapes]
    with pytest.raises(Exception, match=message):
        gemm(*tensors, *_roles(*roles))


def test_gemm_refuses_other_dtypes(gemm):
    tensors = [tvm.runtime.tensor(np.zeros(s, "float16")) for s in ((8, 16), (16, 4), (8, 4))]
    with pytest.raises(Exception, match="float32 or float64"):
        gemm(*tensors, *_roles((M, K), (K, N), (M, N)))


def _conv_reference(x, w, stride, pad, dilation, groups):
    n, _, h, wd = x.shape
    f, cg, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad[0], pad[2]), (pad[1], pad[3])))
    oh = (h + pad[0] + pad[2] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (wd + pad[1] + pad[3] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
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


@pytest.mark.parametrize("x_shape, w_shape, stride, pad, dilation, groups", [
    ((2, 4, 9, 9), (6, 4, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1),
    ((2, 4, 9, 9), (6, 4, 3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 1),
    ((1, 4, 10, 12), (4, 4, 3, 2), (1, 2), (0, 1, 2, 1), (2, 1), 1),  # asymmetric
    ((2, 8, 8, 8), (6, 4, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 2),
    ((2, 4, 8, 8), (4, 1, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 4),  # depthwise
    ((2, 8, 7, 7), (16, 8, 1, 1), (1, 1), (0, 0, 0, 0), (1, 1), 1),  # 1x1: no im2col
])
def test_conv2d_matches_numpy(x_shape, w_shape, stride, pad, dilation, groups):
    library.load_library()
    conv = tvm_ffi.get_global_func("tvm_ext.blas.conv2d")
    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape).astype("float32")
    w = rng.standard_normal(w_shape).astype("float32")
    expected = _conv_reference(x, w, stride, pad, dilation, groups)
    y = tvm.runtime.tensor(np.full(expected.shape, np.nan, "float32"))
    conv(tvm.runtime.tensor(x), tvm.runtime.tensor(w), y, stride[0], stride[1], pad[0], pad[1],
         dilation[0], dilation[1], groups)
    np.testing.assert_allclose(y.numpy(), expected, rtol=1e-4, atol=1e-4)


def test_conv2d_refuses_mismatched_groups():
    library.load_library()
    conv = tvm_ffi.get_global_func("tvm_ext.blas.conv2d")
    x, w, y = (tvm.runtime.tensor(np.zeros(s, "float32"))
               for s in ((1, 4, 8, 8), (6, 3, 3, 3), (1, 6, 6, 6)))
    with pytest.raises(Exception, match="groups"):
        conv(x, w, y, 1, 1, 0, 0, 1, 1, 1)


def test_the_wheel_blas_is_loaded():
    assert "openblas" in blas.cpu_blas_path()


def test_missing_blas_is_a_one_line_error():
    """A machine whose BLAS cannot be loaded: the kernel call raises, naming what was tried
    (no crash inside the VM)."""
    code = f"""
import ctypes, numpy as np, tvm, tvm_ffi
ctypes.CDLL({library.load_library()!r}, ctypes.RTLD_GLOBAL)
print(repr(tvm_ffi.get_global_func("tvm_ext.blas.available")()))
t = [tvm.runtime.tensor(np.zeros(s, "float32")) for s in ((2, 2), (2, 2), (2, 2))]
try:
    tvm_ffi.get_global_func("tvm_ext.blas.gemm")(*t, 2, 0, 2, 2, 2, 1, 2, 0, 1)
except Exception as err:
    print(type(err).__name__, str(err))
"""
    env = {"TVM_EXT_BLAS_LIB": "/nonexistent/libopenblas.so", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "''"
    assert "no BLAS library could be loaded" in lines[1] and "/nonexistent" in lines[1]
    assert "scipy-openblas32" in lines[1]


def test_cublas_needs_cuda_tensors():
    library.load_library()
    cublas = tvm_ffi.get_global_func("tvm_ext.cublas.gemm")
    tensors = [tvm.runtime.tensor(np.zeros(s, "float32")) for s in ((8, 16), (16, 4), (8, 4))]
    with pytest.raises(Exception, match="CUDA device"):
        cublas(*tensors, *_roles((M, K), (K, N), (M, N)))
    assert blas.cublas_workspace_bytes() == 32 << 20
