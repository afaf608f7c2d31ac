"""The copy streams' bandwidth: host-to-device and device-to-host through
`tvm_ext.runtime.swap_streams` (the copies a swapped module makes), between device memory and
the host buffers swapping uses (pinned on a GPU), against the link of the hardware preset the
swap planner assumed and, on a GPU with PyTorch, against PyTorch's pinned copies."""

from __future__ import annotations

import statistics
import time

import numpy as np

from .. import memory, swap_streams
from .report import Failed
from .suite import SuiteRun

D2H, H2D = 0, 1  # the streams SwapOffload uses: swap-outs on 0, swap-ins on 1


def check_copies(suite: SuiteRun, spec: dict) -> dict:
    swap_streams.reset()
    rows = [_measure(suite, int(mib), int(spec.get("repeat", 5))) for mib in spec["sizes_mib"]]
    largest = rows[-1]
    suite.bandwidth = {"h2d": largest["h2d_bytes_per_s"], "d2h": largest["d2h_bytes_per_s"]}
    link = spec["link"]
    data = {"rows": rows, "preset": link,
            "h2d_of_preset": suite.bandwidth["h2d"] / link["h2d_bytes_per_s"],
            "d2h_of_preset": suite.bandwidth["d2h"] / link["d2h_bytes_per_s"]}
    if suite.name == "cuda":
        data["torch"] = _torch_pinned(int(spec["sizes_mib"][-1]) << 20, 5)
    return data


def _measure(suite: SuiteRun, mib: int, repeat: int) -> dict:
    n = mib << 20
    pattern = (np.arange(n, dtype=np.int64) % 251).astype(np.uint8)
    dev = memory.empty((n,), "uint8", suite.device)
    host_in = swap_streams.host_empty((n,), "uint8", suite.host, suite.device)
    host_out = swap_streams.host_empty((n,), "uint8", suite.host, suite.device)
    host_in.copyfrom(pattern)

    def one(src, dst, stream):
        start = time.perf_counter()
        swap_streams.copy_async(src, dst, stream, "bandwidth")
        swap_streams.wait_all(stream)
        return time.perf_counter() - start

    one(host_in, dev, H2D)  # warm up (first touch, stream creation)
    h2d = statistics.median(one(host_in, dev, H2D) for _ in range(repeat))
    d2h = statistics.median(one(dev, host_out, D2H) for _ in range(repeat))
    if not np.array_equal(host_out.numpy(), pattern):
        raise Failed(f"{mib} MiB: the bytes copied to the device and back differ")
    return {"mib": mib, "h2d_ms": h2d * 1e3, "d2h_ms": d2h * 1e3,
            "h2d_bytes_per_s": n / h2d, "d2h_bytes_per_s": n / d2h}


def _torch_pinned(nbytes: int, repeat: int) -> dict:
    """PyTorch's pinned-memory copies of the same size (cudaMemcpyAsync, as ours)."""
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not importable here"}
    if not torch.cuda.is_available():
        return {"skipped": "torch sees no CUDA device"}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def one(dst, src):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    one(dev, host)
    h2d = statistics.median(one(dev, host) for _ in range(repeat))
    d2h = statistics.median(one(host, dev) for _ in range(repeat))
    return {"h2d_bytes_per_s": nbytes / h2d, "d2h_bytes_per_s": nbytes / d2h,
            "torch": torch.__version__}
