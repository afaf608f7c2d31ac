"""Run a compiled module and check it: measured time and device memory, outputs compared
with a reference. Runtime only (TVM's VM, no compiler): a module exported here runs the same
way on a machine that has only TVM's runtime (`tvm_ext.driver` re-exports these)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import tvm
from tvm.runtime.vm import VirtualMachine

from ..errors import CheckError
from . import memory, swap_streams
from .timing import time_calls


@dataclasses.dataclass
class RunResult:
    outputs: list[np.ndarray]
    latencies_ms: list[float]
    peak_bytes: int  # tracked bytes at the peak of the first call, arguments included
    argument_bytes: int  # bytes of the inputs and parameters placed on the device
    host_peak_bytes: int = 0  # the same on the host device of a swapped module
    # The last timed call's outputs (None without one): on CUDA, kernel graphs the first call
    # captured, replayed.
    last_outputs: list[np.ndarray] | None = None

    @property
    def median_ms(self) -> float:
        return float(np.median(self.latencies_ms)) if self.latencies_ms else float("nan")

    @property
    def peak_vm_bytes(self) -> int:
        """The part of the peak the VM allocated itself."""
        return self.peak_bytes - self.argument_bytes


def flatten_outputs(value) -> list[np.ndarray]:
    if isinstance(value, tvm.runtime.Tensor):
        return [value.numpy()]
    out = []
    for v in value:
        out += flatten_outputs(v)
    return out


def place_argument(array: np.ndarray, where: tvm.runtime.Device, device: tvm.runtime.Device):
    """An argument on `where`; host arguments of a GPU module go to pinned memory, so that
    swap-in copies from them are asynchronous."""
    if where == device:
        return memory.to_device(array, device)
    out = swap_streams.host_empty(array.shape, str(array.dtype), where, device)
    out.copyfrom(np.asarray(array, order="C"))  # (ascontiguousarray makes scalars 1-d)
    return out


def run(
    executable,
    arguments: Sequence[np.ndarray],
    device: tvm.runtime.Device,
    repeat: int = 5,
    *,
    host: tvm.runtime.Device | None = None,
    arg_devices: Sequence[int] | None = None,
    time_with: str = "naive",
) -> RunResult:
    """Run `main` of `executable` (compiled here, or an exported module loaded with
    `tvm.runtime.load_module`) on `device`: the first call is measured for memory (naive
    allocator, so the counters see every free), the next `repeat` calls for time.

    A swapped module (SwapOffload) runs on `[device, host]`; `arg_devices` says where each
    argument goes (0: device, 1: host; see `tvm_ext.swap.placement.argument_devices`).

    `time_with="pooled"` times the calls on a second VM with TVM's pooled allocator, as a
    deployment runs: on a GPU the naive allocator's cudaMalloc / cudaMallocHost of every
    buffer on every call can cost more than the kernels.
    """
    devices = [device] if host is None else [device, host]
    vm = VirtualMachine(executable, devices, memory_cfg="naive")
    for dev in devices:
        if not memory.is_tracked(dev, "naive"):
            raise RuntimeError(f"the VM allocator on {dev} predates tvm_ext's import: memory "
                               "cannot be measured in this process")
    arg_devices = list(arg_devices) if arg_devices is not None else [0] * len(arguments)
    if len(arg_devices) != len(arguments) or max(arg_devices, default=0) >= len(devices):
        raise ValueError("arg_devices must give a device index (into [device, host]) per "
                         "argument")
    before = [memory.memory_stats(dev).in_use for dev in devices]
    args = [place_argument(a, devices[d], device)
            for a, d in zip(arguments, arg_devices, strict=True)]
    arg_bytes = memory.memory_stats(device).in_use - before[0]
    for dev in devices:
        memory.reset_peak(dev)
    out = vm["main"](*args)
    device.sync()
    peak = memory.memory_stats(device).peak_in_use - before[0]
    host_peak = memory.memory_stats(host).peak_in_use - before[1] if host is not None else 0
    outputs = flatten_outputs(out)
    del out
    if time_with != "naive":
        vm = VirtualMachine(executable, devices, memory_cfg=time_with)
    main = vm["main"]
    last: list = []

    def call():
        last[:] = [main(*args)]

    latencies = time_calls(call, device.sync, repeat)
    last_outputs = flatten_outputs(last[0]) if last else None
    return RunResult(outputs, latencies, int(peak), int(arg_bytes), int(host_peak),
                     last_outputs)


@dataclasses.dataclass
class CheckResult:
    max_abs_error: float
    max_rel_error: float
    outputs: int


def compare(
    outputs: Sequence[np.ndarray], reference: Sequence[np.ndarray], rtol=1e-5, atol=1e-5,
    *, tolerances: Sequence[tuple[float, float]] | None = None,
    names: Sequence[str] | None = None,
) -> CheckResult:
    """Raise `CheckError` naming the first output that differs beyond tolerance (`rtol`,
    `atol`, or per output `(rtol, atol)` in `tolerances`; `names`: what to call each output,
    default "output i")."""
    if len(outputs) != len(reference):
        raise CheckError(f"{len(outputs)} outputs, the reference has {len(reference)}")
    if tolerances is not None and len(tolerances) != len(outputs):
        raise ValueError(f"{len(tolerances)} tolerances for {len(outputs)} outputs")
    names = list(names) if names is not None else [f"output {i}" for i in range(len(outputs))]
    max_abs = max_rel = 0.0
    for i, (name, out, ref) in enumerate(zip(names, outputs, reference, strict=True)):
        if tolerances is not None:
            rtol, atol = tolerances[i]
        if out.shape != ref.shape or out.dtype != ref.dtype:
            raise CheckError(f"{name}: {out.shape} {out.dtype}, reference "
                             f"{ref.shape} {ref.dtype}")
        if not np.all(np.isfinite(out) == np.isfinite(ref)):
            raise CheckError(f"{name}: non-finite values differ from the reference")
        diff = np.abs(out.astype(np.float64) - ref.astype(np.float64))
        if diff.size:
            max_abs = max(max_abs, float(np.nanmax(diff)))
            scale = np.abs(ref.astype(np.float64))
            max_rel = max(max_rel, float(np.nanmax(diff / np.maximum(scale, max(atol, 1e-30)))))
        bad = ~np.isclose(out, ref, rtol=rtol, atol=atol, equal_nan=True)
        if bad.any():
            idx = np.unravel_index(int(np.argmax(bad)), bad.shape)
            raise CheckError(f"{name} differs at {tuple(int(j) for j in idx)}: "
                             f"{out[idx]!r} vs reference {ref[idx]!r} "
                             f"({int(bad.sum())} of {bad.size} elements beyond rtol={rtol}, "
                             f"atol={atol})")
    return CheckResult(max_abs, max_rel, len(outputs))


