"""Running a module exported by `compile.py --output m.so` (or `driver.export`) with TVM's
runtime alone: `load("m.so")` loads it with its sidecar, picks its devices and places each
argument where the module wants it.

- A swapped module (`m.so.swap.json` beside it) runs on two devices, the device and the host
  where the plan keeps what it swaps out: `cuda(0)` and pinned `cpu(0)` memory on a GPU,
  `cpu(0)` and `cpu(1)` on the CPU stand-in; the sidecar's `argument_devices` says which
  arguments live on the host. The VM checks no argument's device, so a misplaced one would
  be read where it is not: `load` places them.
- Any other module runs on the device it was compiled for (CUDA where it holds CUDA code).
- A module partitioned over several devices (`m.so.partition.json`) runs on a Disco session
  instead: `tvm_ext.runtime.distributed.run_exported`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np
import tvm
from tvm.runtime.vm import VirtualMachine

from ..errors import InputError
from .call_profile import CallProfile, profile_calls
from .vm_run import flatten_outputs, place_argument


class ExportedModule:
    """An exported module, loaded: call it with numpy arrays (the inputs, then the weights, as
    its `main` takes them) for its outputs as numpy arrays."""

    def __init__(self, path: str, library: tvm.runtime.Module, device: tvm.runtime.Device,
                 host: tvm.runtime.Device | None, argument_devices: list[int] | None):
        self.path = path
        self.device = device
        self.host = host  # None: one device (no swap plan)
        self.argument_devices = argument_devices
        self.devices = [device] if host is None else [device, host]
        self._vm = VirtualMachine(library, self.devices)

    def place(self, arguments: Sequence[np.ndarray]) -> list[tvm.runtime.Tensor]:
        """The arguments as tensors on the devices the module reads them from (placed once,
        they serve any number of calls: `run(placed)`)."""
        where = self.argument_devices
        if where is None:
            where = [0] * len(arguments)
        elif len(where) != len(arguments):
            raise InputError(f"{self.path} takes {len(where)} arguments (its sidecar places "
                             f"each), got {len(arguments)}")
        return [place_argument(np.asarray(a), self.devices[d], self.device)
                for a, d in zip(arguments, where, strict=True)]

    def run(self, placed: Sequence[tvm.runtime.Tensor]) -> list[np.ndarray]:
        """`main` on arguments already placed (`place`); the outputs as numpy arrays."""
        out = self._vm["main"](*placed)
        self.device.sync()
        return flatten_outputs(out)

    def profile(self, placed: Sequence[tvm.runtime.Tensor], warmup: int = 1,
                repeat: int = 3) -> CallProfile:
        """`main` on `placed` timed call by call (`call_profile.profile_calls`): each kernel's
        time in its place in the iteration, and the time between calls."""
        return profile_calls(self._vm, placed, self.device, warmup=warmup, repeat=repeat)

    def __call__(self, *arguments: np.ndarray) -> list[np.ndarray]:
        return self.run(self.place(arguments))


def load(path: str, device: tvm.runtime.Device | None = None,
         host: tvm.runtime.Device | None = None) -> ExportedModule:
    """The module exported to `path`, on `device` (default: `cuda(0)` for a module compiled for
    CUDA, else `cpu(0)`) and, where its sidecar `path.swap.json` says it swaps, `host`
    (default: `cpu(0)` beside a GPU, `cpu(1)` beside the CPU stand-in)."""
    if not os.path.isfile(path):
        raise InputError(f"exported module {path} does not exist")
    if os.path.exists(path + ".partition.json"):
        raise InputError(f"{path} is partitioned over several devices "
                         f"({path}.partition.json): run it with tvm_ext.runtime.distributed."
                         "run_exported(Session(k, ...), path, arrays)")
    sidecar = _read_sidecar(path + ".swap.json")
    library = tvm.runtime.load_module(path)
    cuda = (sidecar or {}).get("target") == "cuda" or _holds_cuda(library)
    if device is None:
        device = tvm.cuda(0) if cuda else tvm.cpu(0)
    if sidecar is None:
        return ExportedModule(path, library, device, None, None)
    if host is None:
        on_cpu = device.dlpack_device_type() == tvm.cpu(0).dlpack_device_type()
        host = tvm.cpu(1) if on_cpu else tvm.cpu(0)
    return ExportedModule(path, library, device, host, sidecar["argument_devices"])


def _read_sidecar(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        data["argument_devices"] = [int(d) for d in data["argument_devices"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(f"{path} is not a swap sidecar compile.py wrote: "
                         f"{type(err).__name__}: {err}") from err
    return data


def _holds_cuda(module: tvm.runtime.Module) -> bool:
    return module.kind == "cuda" or any(_holds_cuda(m) for m in module.imports)
