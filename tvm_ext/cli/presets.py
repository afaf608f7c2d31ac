"""The cost-model preset a compile plans with when --hardware is not given."""

from __future__ import annotations

from tvm_ext.ir.targets import is_cpu


def default_hardware(args, target) -> str:
    """--hardware, else the preset of the target's kind (cpu for CPU targets, h100 for GPUs)."""
    return args.hardware or ("cpu" if is_cpu(target) else "h100")
