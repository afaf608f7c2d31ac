"""Where the vendor libraries the runtime library loads at first use (src/blas) live when they
come from installed wheels: `scipy-openblas32` (a dependency of tvm_ext), `nvidia-cublas`
(CUDA 13) or `nvidia-cublas-cu12`, `nvidia-cudnn-cu13` or `-cu12` (PyTorch's). `load_library`
points the runtime library at them once.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os

import tvm_ffi

_ENV_BLAS = "TVM_EXT_BLAS_LIB"
_ENV_CUBLAS = "TVM_EXT_CUBLAS_LIB"
_ENV_CUDNN = "TVM_EXT_CUDNN_LIB"


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


def wheel_cudnn_library() -> str | None:
    """libcudnn from the nvidia-cudnn-cu12 (nvidia/cudnn/lib) or -cu13 (nvidia/cu13/lib or
    nvidia/cudnn/lib) wheel, if installed."""
    for root in _package_dirs("nvidia"):
        for pattern in ("cudnn/lib/libcudnn.so.*", "cu13/lib/libcudnn.so.*"):
            hits = sorted(glob.glob(os.path.join(root, pattern)))
            if hits:
                return hits[0]
    return None


def configure() -> None:
    """Point the runtime library at the installed wheels' libraries (load_library calls this
    once). Never raises for a missing package: the library then searches the usual names."""
    for env, find, setter in ((_ENV_BLAS, wheel_blas_library, "tvm_ext.blas.set_library"),
                              (_ENV_CUBLAS, wheel_cublas_library,
                               "tvm_ext.cublas.set_library"),
                              (_ENV_CUDNN, wheel_cudnn_library, "tvm_ext.cudnn.set_library")):
        func = tvm_ffi.get_global_func(setter, allow_missing=True)
        path = None if os.environ.get(env) or func is None else find()
        if path is not None:
            func(path)


# Where the CUDA runtime and NCCL live when they come from wheels (PyTorch's dependencies:
# nvidia-cuda-runtime, nvidia-nccl-cu12 / -cu13) or from a toolkit off the loader's path.
_WHEEL_PATTERNS = {
    "libcudart.so.13": ("cu13/lib/libcudart.so.13", "cuda_runtime/lib/libcudart.so.13"),
    "libnccl.so.2": ("nccl/lib/libnccl.so.2", "cu13/lib/libnccl.so.2", "cu12/lib/libnccl.so.2"),
}
_TOOLKIT_DIRS = ("/usr/local/cuda/lib64", "/usr/local/cuda-13*/lib64",
                 "/usr/local/cuda/targets/x86_64-linux/lib")


def preload(soname: str) -> str | None:
    """Make `soname` (libcudart.so.13, libnccl.so.2) loadable by the libraries that link it:
    nothing to do if the loader finds it; else load it, globally, from a wheel or a CUDA
    toolkit, so that a later library needing that soname gets this one. Returns where it came
    from (the soname itself when the loader found it), None when it is nowhere."""
    try:
        ctypes.CDLL(soname, mode=ctypes.RTLD_GLOBAL)
        return soname
    except OSError:
        pass
    candidates = [hit for root in _package_dirs("nvidia")
                  for pattern in _WHEEL_PATTERNS.get(soname, ())
                  for hit in sorted(glob.glob(os.path.join(root, pattern)))]
    homes = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    dirs = [os.path.join(h, "lib64") for h in homes] + list(_TOOLKIT_DIRS)
    candidates += [hit for d in dirs for hit in sorted(glob.glob(os.path.join(d, soname)))]
    for path in candidates:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return path
        except OSError:
            continue
    return None
