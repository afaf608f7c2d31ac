"""Where the vendor libraries the runtime library loads at first use (src/blas) live when they
come from installed wheels: `scipy-openblas32` (a dependency of tvm_ext), `nvidia-cublas`
(CUDA 13) or `nvidia-cublas-cu12`. `load_library` points the runtime library at them once.
"""

from __future__ import annotations

import glob
import importlib.util
import os

import tvm_ffi

_ENV_BLAS = "TVM_EXT_BLAS_LIB"
_ENV_CUBLAS = "TVM_EXT_CUBLAS_LIB"


def _package_dirs(name: str) -> list[str]:
    """Folders of an installed package, without importing it (None installed: [])."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or []) if spec is not None else []


def wheel_blas_library() -> str | None:
    """The scipy-openblas32 wheel's libscipy_openblas.so, if that package is installed."""
    for root in _package_dirs("scipy_openblas32"):
        hits = sorted(glob.glob(os.path.join(root, "lib", "libscipy_openblas*.so*")))
        if hits:
            return hits[0]
    return None


def wheel_cublas_library() -> str | None:
    """libcublas from the nvidia-cublas wheel (CUDA 13: nvidia/cu13/lib) or nvidia-cublas-cu12
    (nvidia/cublas/lib), if installed."""
    for root in _package_dirs("nvidia"):
        for pattern in ("cu13/lib/libcublas.so.*", "cublas/lib/libcublas.so.*"):
            hits = sorted(glob.glob(os.path.join(root, pattern)))
            if hits:
                return hits[0]
    return None


def configure() -> None:
    """Point the runtime library at the installed wheels' libraries (load_library calls this
    once). Never raises for a missing package: the library then searches the usual names."""
    for env, find, setter in ((_ENV_BLAS, wheel_blas_library, "tvm_ext.blas.set_library"),
                              (_ENV_CUBLAS, wheel_cublas_library,
                               "tvm_ext.cublas.set_library")):
        func = tvm_ffi.get_global_func(setter, allow_missing=True)
        path = None if os.environ.get(env) or func is None else find()
        if path is not None:
            func(path)
