"""Cost models, plain numbers only (no TVM): hardware and link presets, roofline op durations,
collective costs, and calibration against measured kernel times."""

from .collectives import COLLECTIVES, collective_bytes, collective_steps, collective_time
from .hardware import HARDWARE, LINKS, Hardware, Link, get_hardware, get_link
from .roofline import op_time, op_times

__all__ = ["COLLECTIVES", "HARDWARE", "LINKS", "Hardware", "Link", "collective_bytes",
           "collective_steps", "collective_time", "get_hardware", "get_link", "op_time",
           "op_times"]
