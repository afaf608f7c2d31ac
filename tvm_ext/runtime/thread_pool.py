"""Keep TVM's CPU thread pool from confining the whole process to one core.

TVM creates its CPU thread pool on first use and binds the thread that creates it to one core
(`TVM_BIND_THREADS`, on by default). That thread is usually the process's main thread, and its
mask is inherited by every thread and process started from it afterwards: PyTorch's threads,
MetaSchedule's build and run workers, pytest-xdist's workers and every subprocess would all
share that one core. `release_main_thread()` creates the pool now and gives the calling thread
back the cores it had; the pool's own worker threads keep their binding.
"""

from __future__ import annotations

import os

import tvm


def release_main_thread() -> None:
    if not hasattr(os, "sched_getaffinity"):
        return
    cores = os.sched_getaffinity(0)
    pool = tvm.get_global_func("runtime.NumThreads", allow_missing=True)
    if pool is None:
        return
    pool()  # creates the pool: binds this thread
    if os.sched_getaffinity(0) != cores:
        os.sched_setaffinity(0, cores)
