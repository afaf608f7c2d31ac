"""One suite of a bundle being checked: its artefacts, the devices they run on, and what the
checks measured that later checks use (the copy bandwidth, the unswapped run, kernel times)."""

from __future__ import annotations

import dataclasses

import numpy as np
import tvm

from ...errors import CheckError
from ..vm_run import RunResult, compare
from .bundle import Bundle
from .report import Failed


@dataclasses.dataclass
class SuiteRun:
    bundle: Bundle
    name: str  # "cuda" (the GPU checks) or "llvm" (the CPU self-check)
    spec: dict  # the suite's entry in the manifest
    device: tvm.runtime.Device
    host: tvm.runtime.Device  # where a swapped module keeps what it swaps out
    backend: str  # the Disco collective backend: "nccl" or "cpu"
    bandwidth: dict[str, float] = dataclasses.field(default_factory=dict)  # bytes/s measured
    swap_arguments: list[np.ndarray] | None = None
    unswapped: RunResult | None = None
    kernel_seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def create(cls, bundle: Bundle, name: str) -> SuiteRun:
        if name == "cuda":
            return cls(bundle, name, bundle.suite(name), tvm.cuda(0), tvm.cpu(0), "nccl")
        # The CPU stand-in: cpu:0 is the device, cpu:1 the host (counted apart).
        return cls(bundle, name, bundle.suite(name), tvm.cpu(0), tvm.cpu(1), "cpu")

    def module(self, relative: str) -> tvm.runtime.Module:
        return tvm.runtime.load_module(self.bundle.path(relative))

    def arrays(self, keys: list[str]) -> list[np.ndarray]:
        return self.bundle.arrays(self.name, keys)


def compare_expected(outputs, expected, tolerances, data: dict, what: str) -> dict:
    """The outputs against the expected ones, each at its own (rtol, atol); `Failed` naming
    the first that differs, with `data`."""
    try:
        result = compare(outputs, expected, tolerances=[tuple(t) for t in tolerances])
    except CheckError as err:
        raise Failed(f"differs from {what}: {err}", data) from None
    return {"outputs": result.outputs, "max_abs_error": result.max_abs_error,
            "max_rel_error": result.max_rel_error}
