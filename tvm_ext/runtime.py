"""The tvm_ext runtime library: loading it, and measuring device memory.

The C++ library (built from `src/` by CMakeLists.txt) registers, among other runtime functions,
allocators that count every byte the Relax VM allocates per device. Any VM created after
`import tvm_ext` allocates through them, so `memory_stats(dev)` is the measuring stick for every
memory claim tvm_ext makes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import os
import sys
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import tvm
import tvm_ffi

LIBRARY_NAME = "libtvm_ext_runtime.so"
_ENV_LIBRARY = "TVM_EXT_RUNTIME_LIB"
_loaded: str | None = None


class RuntimeLibraryError(RuntimeError):
    """The runtime library could not be found or loaded."""


def _candidate_paths() -> list[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    roots = [here]
    # A checkout shadowing an installed wheel: the library lives in site-packages.
    for key in ("platlib", "purelib"):
        roots.append(os.path.join(sysconfig.get_paths()[key], "tvm_ext"))
    roots += [os.path.join(p, "tvm_ext") for p in sys.path if p]
    paths = [os.path.join(r, "lib", LIBRARY_NAME) for r in roots]
    # A plain CMake build in the checkout (cmake -B build).
    repo = os.path.dirname(here)
    paths += sorted(glob.glob(os.path.join(repo, "build", "**", LIBRARY_NAME), recursive=True))
    return paths


def library_path() -> str:
    """Path of the runtime library: $TVM_EXT_RUNTIME_LIB, the installed package, or a build."""
    env = os.environ.get(_ENV_LIBRARY)
    if env:
        if not os.path.isfile(env):
            raise RuntimeLibraryError(f"{_ENV_LIBRARY}={env} does not exist")
        return env
    for path in _candidate_paths():
        if os.path.isfile(path):
            return path
    raise RuntimeLibraryError(
        f"{LIBRARY_NAME} not found. Install tvm_ext with `pip install .` (it builds the library), "
        f"or build it with `cmake -B build && cmake --build build` and set {_ENV_LIBRARY}."
    )


def load_library() -> str:
    """Load the runtime library once (global symbols, so exported modules resolve them)."""
    global _loaded
    if _loaded is None:
        path = library_path()
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as err:
            raise RuntimeLibraryError(f"cannot load {path}: {err}") from err
        _loaded = path
    return _loaded


def get_function(name: str) -> tvm_ffi.Function:
    """A global function registered by the runtime library."""
    load_library()
    func = tvm_ffi.get_global_func(name, allow_missing=True)
    if func is None:
        raise RuntimeLibraryError(f"{name} is not registered by {_loaded}: rebuild the library")
    return func


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """Bytes the tracked allocators hold on one device.

    `in_use` is what the program holds; `reserved` is what was taken from the device (the pooled
    allocator keeps freed blocks; with the naive allocator both are equal). Peaks are since the
    last `reset_peak`.
    """

    in_use: int
    peak_in_use: int
    reserved: int
    peak_reserved: int
    num_allocs: int
    num_frees: int


def memory_stats(device: tvm.runtime.Device) -> MemoryStats:
    """Current counters of one device."""
    values = [int(v) for v in get_function("tvm_ext.memory.stats")(device)]
    return MemoryStats(*values)


def reset_peak(device: tvm.runtime.Device) -> None:
    """Set the peaks of a device to its current usage."""
    get_function("tvm_ext.memory.reset_peak")(device)


def is_tracked(device: tvm.runtime.Device, allocator: str = "naive") -> bool:
    """Whether the VM allocator of that kind on `device` is counted (false if it was created
    before tvm_ext was imported)."""
    kind = {"naive": 1, "pooled": 2}[allocator]
    return bool(get_function("tvm_ext.memory.is_tracked")(device, kind))


def empty(shape, dtype: str, device: tvm.runtime.Device) -> tvm.runtime.Tensor:
    """An uninitialised tensor allocated through the tracked allocator (counted in the stats)."""
    return get_function("tvm_ext.memory.empty")(tuple(int(s) for s in shape), dtype, device)


def to_device(array: np.ndarray, device: tvm.runtime.Device) -> tvm.runtime.Tensor:
    """Copy a numpy array to `device` through the tracked allocator."""
    array = np.ascontiguousarray(array)
    out = empty(array.shape, str(array.dtype), device)
    out.copyfrom(array)
    return out


@dataclasses.dataclass
class PeakMeasurement:
    """Filled in when the `measure_peak` block exits."""

    device: tvm.runtime.Device
    baseline: int = 0
    peak: int = 0

    @property
    def peak_above_baseline(self) -> int:
        """Peak bytes allocated inside the block beyond what was held on entry."""
        return self.peak - self.baseline


@contextmanager
def measure_peak(device: tvm.runtime.Device) -> Iterator[PeakMeasurement]:
    """Measure the peak bytes in use on `device` during the block."""
    reset_peak(device)
    result = PeakMeasurement(device, baseline=memory_stats(device).in_use)
    try:
        yield result
    finally:
        result.peak = memory_stats(device).peak_in_use
