"""Copy streams on the CPU stand-in (cpu:0 device, cpu:1 host): cost of a copy through a stream,
and how much of the copy time hides behind compute.

Per size, all in one run: a synchronous copy (`Tensor.copyto`), `copy_async` + `wait` (the
stream round trip), compute alone, and both (copy issued, then the compute, then `wait_all`).
`hidden` = (compute + copy - both) / min(compute, copy): 1.0 when the shorter one is fully hidden
behind the longer, 0 when they serialise. `overlap` is the runtime's own count: copy time during
which the caller was not blocked, over the copy busy time.

    python benchmarks/copy_streams.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import tvm

from tvm_ext.runtime import swap_streams, to_device

DEV, HOST = tvm.cpu(0), tvm.cpu(1)
SIZES_MIB = (4, 16, 64)
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "copy_streams.json")


def _median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _compute_step(work: np.ndarray, steps: int) -> None:
    # Single-threaded and cache-resident (numpy ufuncs do not use BLAS threads): one core computes
    # while the copy worker uses the other.
    for _ in range(steps):
        np.sin(work, out=work)


def measure(size_mib: int, repeat: int) -> dict:
    n = size_mib * (1 << 18)  # float32 elements
    src = to_device(np.ones(n, "float32"), DEV)
    dst = swap_streams.host_empty((n,), "float32", HOST, DEV)
    work = np.random.default_rng(0).standard_normal(1 << 16).astype("float32")

    def sync_copy():
        src.copyto(dst)

    def stream_copy():
        swap_streams.copy_async(src, dst, 0, "src")
        swap_streams.wait(dst, 0)

    t_copy = _median_s(stream_copy, repeat)
    # A compute step about as long as the copy, so that either could hide the other.
    step = _median_s(lambda: _compute_step(work, 1), repeat)
    steps = max(1, round(t_copy / step))

    def both():
        swap_streams.copy_async(src, dst, 0, "src")
        _compute_step(work, steps)
        swap_streams.wait_all(0)

    t_sync = _median_s(sync_copy, repeat)
    t_compute = _median_s(lambda: _compute_step(work, steps), repeat)
    swap_streams.reset_stats()
    t_both = _median_s(both, repeat)
    stats = swap_streams.stats(0)
    hidden = (t_compute + t_copy - t_both) / min(t_copy, t_compute)
    return {
        "size_mib": size_mib,
        "sync_copy_ms": t_sync * 1e3,
        "stream_copy_ms": t_copy * 1e3,
        "compute_ms": t_compute * 1e3,
        "both_ms": t_both * 1e3,
        "hidden": hidden,
        "overlap": stats.overlap_ns / max(stats.busy_ns, 1),
        "bandwidth_gbs": size_mib * (1 << 20) / t_copy / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    swap_streams.reset()
    rows = [measure(size, args.repeat) for size in SIZES_MIB]
    header = ("MiB", "sync ms", "stream ms", "compute ms", "both ms", "hidden", "overlap", "GB/s")
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print(
            f"| {r['size_mib']} | {r['sync_copy_ms']:.2f} | {r['stream_copy_ms']:.2f} | "
            f"{r['compute_ms']:.2f} | {r['both_ms']:.2f} | {r['hidden']:.2f} | "
            f"{r['overlap']:.2f} | {r['bandwidth_gbs']:.1f} |"
        )
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        meta = {
            "device": "cpu:0 -> cpu:1 (CPU stand-in)",
            "cores": os.cpu_count(),
            # overlap needs an idle core: a loaded machine serialises copy and compute
            "load_average_1min": os.getloadavg()[0],
        }
        json.dump({**meta, "rows": rows}, f, indent=2)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
