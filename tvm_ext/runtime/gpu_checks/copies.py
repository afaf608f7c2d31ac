"""The copy streams' bandwidth: host-to-device and device-to-host through
`tvm_ext.runtime.swap_streams` (the copies a swapped module makes), between device memory and
the host buffers swapping uses (pinned on a GPU), against the link of the hardware preset the
swap planner assumed and, on a GPU with PyTorch, against PyTorch's pinned copies. Then strided
chunk copies (`copy_chunk_async` along a later axis, as a split op's chunks of a tensor cut
there): the time of one copy per row width, so that what a narrow row costs can be told from
the link's latency."""

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
    if spec.get("strided_row_bytes"):
        data["strided"] = [_strided(suite, int(spec["strided_rows"]), int(width),
                                    int(spec.get("repeat", 5)))
                           for width in spec["strided_row_bytes"]]
    if suite.name == "cuda":
        data["torch"] = _torch_pinned(int(spec["sizes_mib"][-1]) << 20, 5)
    return data


def _strided(suite: SuiteRun, rows: int, width: int, repeat: int, chunks: int = 8) -> dict:
    """Chunk copies between a host tensor of `rows` x `chunks * width` bytes and a device
    chunk of `rows` x `width`: each direction timed one copy at a time (issue to done); the
    bytes that went in and came back out are checked."""
    pattern = (np.arange(rows * chunks * width, dtype=np.int64) % 251).astype(np.uint8)
    pattern = pattern.reshape(rows, chunks * width)
    whole_in = swap_streams.host_empty((rows, chunks * width), "uint8", suite.host,
                                       suite.device)
    whole_out = swap_streams.host_empty((rows, chunks * width), "uint8", suite.host,
                                        suite.device)
    whole_in.copyfrom(pattern)
    whole_out.copyfrom(np.zeros_like(pattern))
    chunk = memory.empty((rows, width), "uint8", suite.device)

    def one(index: int, to_chunk: bool) -> float:
        whole, stream = (whole_in, H2D) if to_chunk else (whole_out, D2H)
        start = time.perf_counter()
        swap_streams.copy_chunk_async(whole, chunk, stream, 1, index, to_chunk, "strided")
        swap_streams.wait_all(stream)
        return time.perf_counter() - start

    times: dict[bool, list[float]] = {True: [], False: []}
    for index in range(chunks):
        for to_chunk in (True, False):
            times[to_chunk].append(one(index, to_chunk))
    for _ in range(max(0, repeat - 1)):
        for to_chunk in (True, False):
            times[to_chunk].append(one(chunks - 1, to_chunk))
    if not np.array_equal(whole_out.numpy(), pattern):
        raise Failed(f"strided chunks of {rows} rows x {width} B: the bytes copied to the "
                     "device and back differ")
    h2d, d2h = statistics.median(times[True][1:]), statistics.median(times[False][1:])
    return {"rows": rows, "row_bytes": width, "chunks": chunks, "h2d_us": h2d * 1e6,
            "d2h_us": d2h * 1e6, "h2d_ns_per_row": h2d * 1e9 / rows,
            "d2h_ns_per_row": d2h * 1e9 / rows}


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
