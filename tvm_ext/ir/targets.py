"""What kind of machine a TVM target compiles for, and where a swapped module's host memory is."""

from __future__ import annotations

import tvm
from tvm import relax

_CPU_KINDS = ("llvm", "c")
_GPU_KINDS = ("cuda", "rocm", "metal", "vulkan", "opencl")


def is_cpu(target: tvm.target.Target) -> bool:
    """Code for this host's CPU (the host is also the device)."""
    return target.kind.name in _CPU_KINDS


def is_gpu(target: tvm.target.Target) -> bool:
    """Code for a GPU (kernels need thread bindings)."""
    return target.kind.name in _GPU_KINDS


def host_vdevice(target: tvm.target.Target) -> relax.VDevice:
    """Where swapped tensors live: the CPU. On a CPU target the host is a second CPU device
    (cpu:1) standing in for host memory, so the two are measured apart."""
    return relax.VDevice(tvm.target.Target("llvm"), 1 if is_cpu(target) else 0, "global")


def vm_devices(target: tvm.target.Target) -> list[tvm.runtime.Device]:
    """The device list a VM running a swapped module takes: [device, host]."""
    if is_cpu(target):
        return [tvm.cpu(0), tvm.cpu(1)]
    return [tvm.device(target.kind.name, 0), tvm.cpu(0)]
