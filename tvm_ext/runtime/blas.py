"""The vendor libraries behind the runtime library's `tvm_ext.blas.*` (CPU BLAS),
`tvm_ext.cublas.*` (cuBLAS) and `tvm_ext.cudnn.*` (cuDNN) functions (src/blas): which ones it
loads.

The runtime library loads them itself, at first use (dlopen), so that neither it nor an exported
module links one. It looks first where `load_library` pointed it (`vendor_libraries.configure`),
the installed wheels:
`scipy-openblas32` (a dependency of tvm_ext), `nvidia-cublas` / `nvidia-cublas-cu12` and
`nvidia-cudnn-cu13` / `-cu12` where installed; then `TVM_EXT_BLAS_LIB` / `TVM_EXT_CUBLAS_LIB` /
`TVM_EXT_CUDNN_LIB`; then the usual library names. An
environment variable that is set takes precedence over the wheel (configure leaves that one
alone). A kernel that calls a library on a machine without it raises a one-line error naming
what was tried and how to fix it.
"""

from __future__ import annotations

import tvm_ffi

from .library import load_library


def cpu_blas_path() -> str:
    """Path of the CPU BLAS the runtime library loads ("" when none can be loaded)."""
    load_library()
    return str(tvm_ffi.get_global_func("tvm_ext.blas.available")())


def cpu_blas_available() -> bool:
    return bool(cpu_blas_path())


def cpu_blas_info() -> dict:
    """{"path", "config" (OpenBLAS' build string), "threads", "batch_strided", "error"}."""
    load_library()
    return dict(tvm_ffi.get_global_func("tvm_ext.blas.info")())


def cublas_path() -> str:
    """Path of the cuBLAS the runtime library loads ("" when it cannot be loaded)."""
    load_library()
    return str(tvm_ffi.get_global_func("tvm_ext.cublas.available")())


def cudnn_path() -> str:
    """Path of the cuDNN the runtime library loads ("" when it cannot be loaded)."""
    load_library()
    return str(tvm_ffi.get_global_func("tvm_ext.cudnn.available")())


def cublas_workspace_bytes() -> int:
    """Device memory cuBLAS gets for its workspace, per device (and per stream it runs on;
    one in practice; src/blas/cublas_library.h): outside the graph, so a swap plan under an
    absolute budget leaves it free."""
    load_library()
    return int(tvm_ffi.get_global_func("tvm_ext.cublas.workspace_bytes")())


def cudnn_workspace_bytes() -> int:
    """The most device memory one cuDNN convolution takes from TVM's workspace pool for its
    algorithm (src/blas/cudnn_library.h; a weight in another axis order needs its packed copy
    beside it): outside the graph, so a swap plan under an absolute budget leaves it free."""
    load_library()
    return int(tvm_ffi.get_global_func("tvm_ext.cudnn.workspace_bytes")())
