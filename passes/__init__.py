"""tvm_ext.passes: Relax passes, one per file, each consuming a plan made by a planner."""

from .bfloat16_in_float32 import Bfloat16InFloat32
from .broadcast_constants import BroadcastConstants
from .capture_kernel_graphs import CaptureKernelGraphs
from .dispatch_library import DispatchLibraryKernels
from .drop_unread_kernel_inputs import DropUnreadKernelInputs
from .fuse_attention import FuseAttention
from .fuse_kernels import FuseKernels
from .group_accumulations import GroupAccumulations
from .partition_operators import PartitionError, PartitionOperators
from .place_updates_after_readers import PlaceUpdatesAfterReaders
from .return_loss_only import ReturnLossOnly
from .static_kernel_calls import StaticKernelCalls
from .swap_offload import SwapOffload, SwapOffloadError
from .update_arguments_in_place import UpdateArgumentsInPlace

__all__ = [
    "Bfloat16InFloat32",
    "BroadcastConstants",
    "CaptureKernelGraphs",
    "DispatchLibraryKernels",
    "DropUnreadKernelInputs",
    "FuseAttention",
    "FuseKernels",
    "GroupAccumulations",
    "PartitionError",
    "PartitionOperators",
    "PlaceUpdatesAfterReaders",
    "ReturnLossOnly",
    "StaticKernelCalls",
    "SwapOffload",
    "SwapOffloadError",
    "UpdateArgumentsInPlace",
]
