"""The vendor libraries behind the runtime library's `tvm_ext.blas.*` functions (src/blas):
which one is loaded.

The runtime library loads its BLAS itself, at first use (dlopen), so that neither it nor an
exported module links one: it tries the library `load_library` pointed it at (the
`scipy-openblas32` wheel, a dependency of tvm_ext), then `TVM_EXT_BLAS_LIB`, then the usual
OpenBLAS/CBLAS names, and a kernel that calls it on a machine with none raises a one-line
error naming what it tried.
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


def cublas_workspace_bytes() -> int:
    """Device memory cuBLAS gets for its workspace, once per device (src/blas/cublas_gemm.cc):
    outside the graph, so a swap plan under an absolute budget leaves it free."""
    load_library()
    return int(tvm_ffi.get_global_func("tvm_ext.cublas.workspace_bytes")())
