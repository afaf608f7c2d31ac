"""Where a swapped module takes each argument: on the device or on the host."""

from __future__ import annotations

from ..graph import DataflowGraph
from .plan import SwapPlan

DEVICE, HOST = 0, 1  # positions in the device list of a VM running a swapped module


def argument_devices(graph: DataflowGraph, plan: SwapPlan) -> list[int]:
    """Per function argument: `DEVICE` or `HOST` (the plan starts it on the host)."""
    on_host = set(plan.host_start)
    args = sorted((t for t in graph.tensors if t.arg_index is not None),
                  key=lambda t: t.arg_index)
    return [HOST if t.id in on_host else DEVICE for t in args]
