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
    """For the block, pin the copy workers to `cpu` (default: the highest of the process's CPUs,
    `swap_streams.process_cpus`) and keep this thread (the compute) off it: on the other CPUs
    it may run on, or, where that is `cpu` alone (TVM's pool binds it to one core), on the
    process's others. Both are restored afterwards. Threads this thread starts meanwhile
    inherit its CPUs, but TVM's pool binds its own to cores of its choosing: with more compute
    threads than the other CPUs, they contend with the copies. Yields the copy CPU, or None
    (with a warning) where the process has one CPU only or the platform cannot pin: copies and
    compute then share it. Raises ValueError for a `cpu` that is not one of the process's, or
    is its only one."""
    process = sorted(swap_streams.process_cpus()) if hasattr(os, "sched_setaffinity") else []
    if cpu is None and len(process) < 2:
        where = f"runs on CPU {process[0]} only" if process else "cannot pin threads"
        warnings.warn(f"dedicated_copy_cpu: this process {where}; copy workers share the "
                      f"compute's CPUs", RuntimeWarning, stacklevel=3)
        yield None
        return
    if cpu is not None and (cpu not in process or len(process) < 2):
        raise ValueError(f"dedicated_copy_cpu: CPU {cpu} is not one of this process's CPUs "
                         f"other than its only one ({process})")
    cpu = process[-1] if cpu is None else cpu
    mine = sorted(os.sched_getaffinity(0))
    compute = [c for c in mine if c != cpu] or [c for c in process if c != cpu]
    before = swap_streams.copy_worker_cpus()
    swap_streams.set_copy_worker_cpus([cpu])
    try:
        os.sched_setaffinity(0, compute)
        try:
            yield cpu
        finally:
            os.sched_setaffinity(0, mine)
    finally:
        swap_streams.set_copy_worker_cpus(before)
