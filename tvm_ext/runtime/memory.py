"""Device memory as the runtime library counts it.

The library registers allocators that count every byte the Relax VM allocates per device. Any VM
created after `import tvm_ext` allocates through them, so `memory_stats(dev)` is the measuring
stick for every memory claim tvm_ext makes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import tvm

from .library import get_function


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
    array = np.asarray(array, order="C")  # keeps 0-d arrays 0-d
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
