"""tvm_ext.passes: Relax passes, one per file, each consuming a plan made by a planner."""

from .dispatch_library import DispatchLibraryKernels
from .partition_operators import PartitionError, PartitionOperators
from .swap_offload import SwapOffload, SwapOffloadError

__all__ = [
    "DispatchLibraryKernels",
    "PartitionError",
    "PartitionOperators",
    "SwapOffload",
    "SwapOffloadError",
]
