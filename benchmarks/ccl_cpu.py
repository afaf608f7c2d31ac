"""Collective throughput of the "cpu" Disco backend (worker threads of one process).

For k workers and a float32 buffer of n bytes, times allreduce (sum), allgather and
broadcast_from_worker0 issued through TVM's disco builtins, `repeat` calls queued back to back
and one sync at the end, and reports per call: time, algorithm bandwidth n/t and NCCL's "bus
bandwidth" (allreduce 2(k-1)/k * n/t, allgather and broadcast (k-1)/k * n/t, with n the size of
the gathered buffer for allgather). A numpy reference on one thread (summing k arrays of n bytes)
puts the allreduce times on the scale of this machine's memory bandwidth.

Usage: python benchmarks/ccl_cpu.py [--workers 2 4] [--sizes 4096 1048576 16777216]
Writes benchmarks/results/ccl_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
from tvm_ffi import Shape

from tvm_ext.runtime import distributed as dist

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "ccl_cpu.json")


def _time_calls(sess: dist.Session, repeat: int, name: str, *args) -> float:
    sess.call(f"runtime.disco.{name}", *args)  # warm up
    sess.sync()
    start = time.perf_counter()
    for _ in range(repeat):
        sess.call(f"runtime.disco.{name}", *args)
    sess.sync()
    elapsed = (time.perf_counter() - start) / repeat
    sess.check(name)
    return elapsed


def _numpy_sum_time(k: int, numel: int, repeat: int) -> float:
    parts = [np.ones(numel, "float32") for _ in range(k)]
    out = np.empty(numel, "float32")
    start = time.perf_counter()
    for _ in range(repeat):
        np.copyto(out, parts[0])
        for p in parts[1:]:
            np.add(out, p, out=out)
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 1 << 20, 16 << 20],
                        help="buffer bytes per worker")
    args = parser.parse_args()
    rows = []
    for k in args.workers:
        with dist.Session(k) as sess:
            for nbytes in args.sizes:
                numel = nbytes // 4
                repeat = max(3, min(200, (64 << 20) // max(nbytes, 1)))
                src = sess.per_worker([np.ones(numel, "float32")] * k)
                dst = sess.empty((numel,), "float32")
                big = sess.empty((numel * k,), "float32")
                t_ar = _time_calls(sess, repeat, "allreduce", src, Shape([0]), False, dst)
                t_ag = _time_calls(sess, repeat, "allgather", src, False, big)
                t_bc = _time_calls(sess, repeat, "broadcast_from_worker0", src, False, dst)
                t_np = _numpy_sum_time(k, numel, repeat)
                frac = (k - 1) / k
                rows.append({
                    "workers": k, "bytes": nbytes,
                    "allreduce_us": t_ar * 1e6,
                    "allreduce_busbw_GBps": 2 * frac * nbytes / t_ar / 1e9,
                    "allgather_us": t_ag * 1e6,
                    "allgather_busbw_GBps": frac * nbytes * k / t_ag / 1e9,
                    "broadcast_us": t_bc * 1e6, "broadcast_busbw_GBps": frac * nbytes / t_bc / 1e9,
                    "numpy_sum_us": t_np * 1e6,
                })
    header = (f"{'k':>2} {'bytes':>10} {'allreduce us':>13} {'busbw GB/s':>10} "
              f"{'allgather us':>13} {'busbw GB/s':>10} {'bcast us':>10} {'busbw GB/s':>10} "
              f"{'numpy sum us':>13}")
    print(header)
    for r in rows:
        print(f"{r['workers']:>2} {r['bytes']:>10} {r['allreduce_us']:>13.1f} "
              f"{r['allreduce_busbw_GBps']:>10.2f} {r['allgather_us']:>13.1f} "
              f"{r['allgather_busbw_GBps']:>10.2f} {r['broadcast_us']:>10.1f} "
              f"{r['broadcast_busbw_GBps']:>10.2f} {r['numpy_sum_us']:>13.1f}")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump({"machine": platform.processor() or platform.machine(),
                   "cpu_count": os.cpu_count(), "rows": rows}, f, indent=1)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
