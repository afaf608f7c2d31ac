"""Hardware presets: compute rate, memory bandwidth, and the links that copies and collectives
cross. Figures are public datasheet numbers derated to what kernels and copies reach in
practice (the `*_efficiency` fields); `tvm_ext.cost` calibrates them against measurements.
"""

from __future__ import annotations

import dataclasses

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Link:
    """A point-to-point link, per direction."""

    name: str
    bandwidth: float  # bytes/s per direction, achievable
    latency: float  # seconds per transfer

    def transfer_time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth if nbytes > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator and its host link."""

    name: str
    peak_flops: float  # FP32 FLOP/s (datasheet)
    mem_bandwidth: float  # device memory bytes/s (datasheet)
    memory_bytes: int  # device memory capacity
    host_to_device: Link  # swap-in direction
    device_to_host: Link  # swap-out direction
    compute_efficiency: float = 0.6  # fraction of peak FLOP/s a tuned kernel reaches
    library_efficiency: float = 0.8  # fraction of peak FLOP/s a vendor-library GEMM reaches
    bandwidth_efficiency: float = 0.8  # fraction of peak bandwidth a streaming kernel reaches
    launch_overhead: float = 5e-6  # seconds per kernel
    # The swap runtime's own costs (0 on a GPU, where copies are issued ahead of the kernels
    # and streams wait on events; measured on the CPU stand-in, see tvm_ext.cost.emulation):
    copy_issue_overhead: float = 0.0  # compute-stream seconds to issue one copy
    sync_overhead: float = 0.0  # seconds from an event to a stream stalled on it resuming
    # Handing a copy to an idle stream, by how long it was idle: (idle s, compute-stream s,
    # s from the hand-over's start to the copy's start) points, interpolated; () : the copy
    # costs `copy_issue_overhead` and starts `sync_overhead` after it.
    copy_wake: tuple[tuple[float, float, float], ...] = ()
    # Dense FP16/BF16 FLOP/s of a library GEMM with low-precision operands (tensor cores,
    # datasheet); 0: no faster than FP32 (no tensor cores for them).
    peak_flops_low: float = 0.0

    def peak(self, low_precision: bool = False) -> float:
        """FLOP/s at the operands' precision."""
        return self.peak_flops_low if low_precision and self.peak_flops_low else self.peak_flops

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Hardware:
        data = dict(data)
        data["host_to_device"] = Link(**data["host_to_device"])
        data["device_to_host"] = Link(**data["device_to_host"])
        data["copy_wake"] = tuple(tuple(p) for p in data.get("copy_wake", ()))
        return cls(**data)


def _pcie(gen: int, efficiency: float = 0.8) -> Link:
    # x16 raw per direction: gen3 15.75, gen4 31.5, gen5 63 GB/s.
    raw = {3: 15.75, 4: 31.5, 5: 63.0}[gen] * GB
    return Link(f"pcie{gen}", raw * efficiency, 10e-6)


HARDWARE: dict[str, Hardware] = {
    # The SwapAdvisor paper's class of hardware: Pascal on PCIe 3.
    "gtx1080ti": Hardware("gtx1080ti", 11.3e12, 484 * GB, 11 * 2**30, _pcie(3), _pcie(3)),
    "a100": Hardware("a100", 19.5e12, 1555 * GB, 40 * 2**30, _pcie(4), _pcie(4),
                     peak_flops_low=312e12),
    "h100": Hardware("h100", 67e12, 3350 * GB, 80 * 2**30, _pcie(5), _pcie(5),
                     peak_flops_low=989e12),
    "h200": Hardware("h200", 67e12, 4800 * GB, 141 * 2**30, _pcie(5), _pcie(5),
                     peak_flops_low=989e12),
    # A CPU standing in for a device, with memcpy between two of its regions as the link:
    # what the tests run on. Nominal figures for a 2-core VM; the efficiencies are fitted to
    # untuned llvm kernels of a gpt-small training step (benchmarks/cost_model.py: the
    # iteration is then right, single kernels can be off by 3x either way).
    "cpu": Hardware("cpu", 50e9, 10 * GB, 16 * 2**30, Link("memcpy", 5 * GB, 2e-6),
                    Link("memcpy", 5 * GB, 2e-6), compute_efficiency=0.05,
                    library_efficiency=1.0, bandwidth_efficiency=1.0, launch_overhead=2e-6),
}

# Device-to-device interconnects for partitioned execution (per direction, per GPU).
LINKS: dict[str, Link] = {
    "nvlink": Link("nvlink4", 450 * GB * 0.8, 5e-6),  # H100 SXM, NVLink 4 (900 GB/s total)
    "nvlink3": Link("nvlink3", 300 * GB * 0.8, 5e-6),  # A100 SXM
    "pcie": Link("pcie4", 31.5 * GB * 0.8, 10e-6),  # GPUs talking over PCIe 4 x16
    "pcie3": Link("pcie3", 15.75 * GB * 0.8, 10e-6),
}


def get_hardware(name: str | Hardware) -> Hardware:
    if isinstance(name, Hardware):
        return name
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware preset {name!r}; presets: {', '.join(HARDWARE)}")
    return HARDWARE[name]


def get_link(name: str | Link) -> Link:
    if isinstance(name, Link):
        return name
    if name not in LINKS:
        raise ValueError(f"unknown link preset {name!r}; presets: {', '.join(LINKS)}")
    return LINKS[name]
