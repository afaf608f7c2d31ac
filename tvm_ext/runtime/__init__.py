"""The Python side of the tvm_ext runtime library: running an exported module (`load`: its
sidecar read, each argument placed; `exported`), loading the library (`library`), device
memory accounting (`memory`), asynchronous swap copy streams (`swap_streams`; `swap_calls`
builds the Relax calls a swap pass emits), Disco sessions and collectives (`distributed`), CUDA
without a driver (`cuda`), running and checking a module (`vm_run`), timing kernels
(`kernel_timing`) and offline tuning candidates (`candidate_batch`), TVM's CPU thread pool
(`thread_pool`), and the checks a GPU bundle runs (`gpu_checks`).

Nothing here but `swap_calls` needs TVM's compiler: an exported module runs with TVM's runtime
and this package.
"""

from __future__ import annotations

from . import thread_pool
from .exported import ExportedModule, load
from .library import LIBRARY_NAME, RuntimeLibraryError, get_function, library_path, load_library
from .memory import (
    MemoryStats,
    PeakMeasurement,
    empty,
    is_tracked,
    measure_peak,
    memory_stats,
    reset_peak,
    to_device,
)

__all__ = [
    "LIBRARY_NAME",
    "ExportedModule",
    "MemoryStats",
    "PeakMeasurement",
    "RuntimeLibraryError",
    "empty",
    "get_function",
    "is_tracked",
    "library_path",
    "load",
    "load_library",
    "measure_peak",
    "memory_stats",
    "reset_peak",
    "thread_pool",
    "to_device",
]
