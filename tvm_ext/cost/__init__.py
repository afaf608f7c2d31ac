"""Cost models: hardware presets, roofline op durations, link transfer times; measured kernel
times and calibration against them in `tvm_ext.cost.measure` (imports TVM)."""

from .hardware import HARDWARE, LINKS, Hardware, Link, get_hardware, get_link
from .roofline import op_time, op_times

__all__ = ["HARDWARE", "LINKS", "Hardware", "Link", "get_hardware", "get_link", "op_time",
           "op_times"]
