"""The CPU stand-in as a device with a copy engine: its copy workers on a CPU of their own.

A GPU copies on its own engines while its cores compute. On the CPU stand-in the copy streams'
workers are threads: left to share cores with the compute, a worker woken while the caller runs a
kernel (the copy it waited for is done, or it just woke the caller) often waits in that core's
run queue until the kernel ends, a millisecond and more, while its stream idles; no simulator of
a device with copy engines predicts that. `dedicated_copy_cpu` gives the workers one CPU and
the calling thread (the compute) the others, for the duration of a block.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator

from ..runtime import swap_streams


@contextlib.contextmanager
def dedicated_copy_cpu(cpu: int | None = None) -> Iterator[int | None]:
    """For the block, pin the copy workers to `cpu` (default: the highest CPU this thread may
    run on) and this thread to the other CPUs it may run on; both are restored afterwards.
    Threads this thread starts meanwhile (TVM's pool, on the first parallel kernel) inherit its
    CPUs. Yields the copy CPU, or None (with a warning) where this thread has one CPU only or
    the platform cannot pin: copies and compute then share it. Raises ValueError for a `cpu`
    this thread may not run on, or when it is this thread's only CPU."""
    if not hasattr(os, "sched_setaffinity"):
        warnings.warn("dedicated_copy_cpu: this platform cannot pin threads; copy workers "
                      "share the compute's CPUs", RuntimeWarning, stacklevel=3)
        yield None
        return
    allowed = sorted(os.sched_getaffinity(0))
    if cpu is None and len(allowed) < 2:
        warnings.warn(f"dedicated_copy_cpu: this thread runs on CPU {allowed[0]} only; copy "
                      f"workers share it with the compute", RuntimeWarning, stacklevel=3)
        yield None
        return
    if cpu is not None and (cpu not in allowed or len(allowed) < 2):
        raise ValueError(f"dedicated_copy_cpu: CPU {cpu} is not one of this thread's CPUs "
                         f"other than its only one ({allowed})")
    cpu = allowed[-1] if cpu is None else cpu
    before = swap_streams.copy_worker_cpus()
    swap_streams.set_copy_worker_cpus([cpu])
    try:
        os.sched_setaffinity(0, [c for c in allowed if c != cpu])
        try:
            yield cpu
        finally:
            os.sched_setaffinity(0, allowed)
    finally:
        swap_streams.set_copy_worker_cpus(before)
