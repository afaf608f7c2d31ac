"""Compiling for CUDA on any machine, with or without a GPU.

TVM's CUDA runtime library (`libtvm_runtime_cuda.so`) links the driver `libcuda.so.1`. Where
no driver is installed it silently fails to load, and TVM then packs CUDA *source* into
exported modules, which no GPU machine can load. `ensure_cuda_runtime()` loads the real driver
if there is one, else tvm_ext's no-device stub (src/cuda_stub), then TVM's CUDA runtime;
`ensure_cuda_compiler()` picks nvcc (else NVRTC), with which device code is compiled and exported
as a cubin.
"""

from __future__ import annotations

import ctypes
import os
import shutil

import tvm
import tvm_ffi

from ..errors import UnavailableError
from .library import library_path
from .vendor_libraries import preload

DEFAULT_ARCH = "sm_90"  # Hopper
_state: str | None = None


class CudaUnavailableError(UnavailableError):
    """CUDA code cannot be compiled on this machine."""


def _stub_path() -> str:
    return os.path.join(os.path.dirname(library_path()), "cuda_stub", "libcuda.so.1")


def ensure_cuda_runtime() -> str:
    """Load TVM's CUDA runtime; returns "driver" (a real GPU driver) or "stub"."""
    global _state
    if _state is not None:
        return _state
    if tvm_ffi.get_global_func("device_api.cuda", allow_missing=True) is not None:
        _state = "driver"
        return _state
    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
        state = "driver"
    except OSError:
        stub = _stub_path()
        if not os.path.isfile(stub):
            raise CudaUnavailableError(
                f"no CUDA driver and no stub at {stub}: reinstall tvm_ext"
            ) from None
        ctypes.CDLL(stub, mode=ctypes.RTLD_GLOBAL)
        state = "stub"
    lib = os.path.join(os.path.dirname(tvm.__file__), "lib", "libtvm_runtime_cuda.so")
    preload("libcudart.so.13")  # from a wheel or a toolkit off the loader's path, if need be
    try:
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    except OSError as err:
        raise CudaUnavailableError(
            f"TVM's CUDA runtime does not load ({err}); it needs the CUDA 13 runtime "
            "(libcudart.so.13) on the library path"
        ) from err
    _state = state
    return _state


def ensure_cuda_compiler() -> None:
    """Choose how TVM compiles CUDA code here: nvcc where it is on PATH
    (`TVM_CUDA_COMPILE_MODE=nvcc`), else NVRTC through cuda-bindings (TVM's default). Running
    compiled modules needs neither (a GPU machine with the driver and the runtime only).

    nvcc compiles with IEEE math, as PyTorch's kernels are: TVM's `--use_fast_math` makes
    `powf` of a negative base NaN (GPT-2's GELU and Llama's RMSNorm square with pow). An
    empty `TVM_CUDA_NVCC_NO_FAST_MATH` set before keeps fast math. (TVM's NVRTC path always
    passes `--use_fast_math`.)"""
    os.environ.setdefault("TVM_CUDA_NVCC_NO_FAST_MATH", "1")
    if "TVM_CUDA_COMPILE_MODE" in os.environ:
        return
    if shutil.which("nvcc"):
        os.environ["TVM_CUDA_COMPILE_MODE"] = "nvcc"
        return
    try:
        import cuda.bindings  # noqa: F401  (NVRTC, TVM's default compiler)
    except ImportError as err:
        raise CudaUnavailableError(
            "no CUDA compiler: put nvcc on PATH or pip install cuda-bindings"
        ) from err


def cuda_target(arch: str = DEFAULT_ARCH) -> tvm.target.Target:
    """A CUDA target with an explicit arch (auto-detection needs a GPU) and an llvm host, to
    compile for (with the compiler `ensure_cuda_compiler` picks). Its shared memory per block
    is the 48 KiB every CUDA GPU gives without opting in, as tuning assumes
    (`schedules.tuning.tuning_target`): dlight warns at every kernel of a target without it."""
    ensure_cuda_compiler()
    return tvm.target.Target({"kind": "cuda", "arch": arch,
                              "max_shared_memory_per_block": 48 * 1024}, host="llvm")


def has_gpu() -> bool:
    """Whether a CUDA device can actually run code here."""
    try:
        ensure_cuda_runtime()
    except CudaUnavailableError:
        return False
    return bool(tvm.cuda(0).exist)
