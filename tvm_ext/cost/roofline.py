"""Roofline op durations: an op takes as long as its compute or its memory traffic, whichever
is longer at the rates the hardware reaches, plus a launch overhead."""

from __future__ import annotations

import numpy as np

from ..graph import DataflowGraph
from .hardware import Hardware, get_hardware


def op_time(flops: float, bytes_moved: float, hw: Hardware, kind: str = "kernel",
            library: bool = False, low_precision: bool = False) -> float:
    """Seconds for one op on `hw` (views cost nothing); `library`: its compute runs in a
    vendor library (GEMM, convolution) at `hw.library_efficiency`, of the low-precision peak
    where its operands are float16/bfloat16 (`low_precision`)."""
    if kind == "view":
        return 0.0
    efficiency = hw.library_efficiency if library else hw.compute_efficiency
    compute = flops / (hw.peak(library and low_precision) * efficiency)
    memory = bytes_moved / (hw.mem_bandwidth * hw.bandwidth_efficiency)
    return max(compute, memory) + hw.launch_overhead


def op_times(graph: DataflowGraph, hardware: str | Hardware) -> np.ndarray:
    """Roofline duration of every op of `graph`, indexed by op id."""
    hw = get_hardware(hardware)
    return np.array([op_time(op.flops, op.bytes_moved, hw, op.kind, op.library,
                             op.low_precision) for op in graph.ops])
