"""The swap runtime: asynchronous copies on copy streams, waits, host buffers, statistics.

Thin wrappers over the `tvm_ext.swap.*` globals of the C++ runtime library
(src/swap/copy_streams.cc); `swap_calls` builds the Relax calls a swap pass emits. The calling
convention, for a non-dataflow function after CallTIRRewrite (device and host are positions in
the VM's device list, e.g. `[tvm.cpu(0), tvm.cpu(1)]` or `[tvm.cuda(0), tvm.cpu(0)]`):

    hpool = R.call_builtin_with_ctx("tvm_ext.swap.host_storage",
                (R.shape([nbytes]), R.prim_value(host), R.prim_value(dev)), ty_args=R.Object)
    a_host = R.memory.alloc_tensor(hpool, R.prim_value(offset), R.shape(shape), R.dtype(dtype))
    R.call_packed("tvm_ext.swap.copy_async", a, a_host, R.prim_value(S), R.str("a"),
                  ty_args=R.Tuple([]))                                      # swap-out
    R.call_packed("tvm_ext.swap.wait", a, R.prim_value(S), ty_args=R.Tuple([]))
                                                   # before a's device memory is overwritten
    R.call_packed("tvm_ext.swap.copy_async", a_host, a2, R.prim_value(S), R.str("a"),
                  ty_args=R.Tuple([]))                                      # swap-in
    R.call_packed("tvm_ext.swap.wait", a2, R.prim_value(S), ty_args=R.Tuple([]))
                                                   # before a2's first consumer
    R.call_packed("tvm_ext.swap.wait_all", R.prim_value(-1), ty_args=R.Tuple([]))
                                                   # before returning
    R.call_packed("tvm_ext.swap.copy_chunk_async", a_host, a_chunk, R.prim_value(S),
                  R.prim_value(axis), R.prim_value(j), R.prim_value(1), R.str("a"),
                  ty_args=R.Tuple([]))             # chunk j of a along axis (0: back out)

`swap_calls.copy_async_call`, `copy_chunk_async_call`, `wait_call`, `wait_all_call`,
`host_storage_call` and `host_empty_call` build exactly these calls. Nothing here needs TVM's
compiler. See src/swap/copy_streams.cc for the semantics (FIFO per stream, automatic ordering
of copies on different streams that touch the same memory, poisoning on failure).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import tvm

from .library import get_function

COPY_ASYNC = "tvm_ext.swap.copy_async"
COPY_CHUNK_ASYNC = "tvm_ext.swap.copy_chunk_async"
COPY_WINDOW_ASYNC = "tvm_ext.swap.copy_window_async"
WAIT = "tvm_ext.swap.wait"
WAIT_ALL = "tvm_ext.swap.wait_all"
HOST_STORAGE = "tvm_ext.swap.host_storage"
HOST_EMPTY = "tvm_ext.swap.host_empty"
ALL_STREAMS = -1
"""`wait_all(ALL_STREAMS)` waits for every copy stream of every device."""


# ------------------------------------------------------------------------------------------------
# Runtime calls (Python side: tests, benchmarks, hand-driven swapping)
# ------------------------------------------------------------------------------------------------


def copy_async(
    src: tvm.runtime.Tensor, dst: tvm.runtime.Tensor, stream: int = 0, name: str = ""
) -> None:
    """Enqueue `dst <- src` on copy stream `stream` and return at once.

    Raises ValueError naming `name` (and poisons the stream) if the shapes or dtypes differ.
    """
    get_function(COPY_ASYNC)(src, dst, stream, name)


def copy_chunk_async(
    whole: tvm.runtime.Tensor, chunk: tvm.runtime.Tensor, stream: int, axis: int, index: int,
    to_chunk: bool, name: str = ""
) -> None:
    """Enqueue a copy between chunk `index` along `axis` of `whole` and `chunk` (`whole`'s
    shape with that axis cut into equal chunks): `chunk <- whole[..., chunk index, ...]` when
    `to_chunk`, the reverse otherwise; strided rows where an axis before `axis` is not 1.

    Raises ValueError naming `name` (and poisons the stream) if `chunk` is not such a chunk.
    """
    get_function(COPY_CHUNK_ASYNC)(whole, chunk, stream, axis, index, int(bool(to_chunk)), name)


def copy_window_async(
    whole: tvm.runtime.Tensor, chunk: tvm.runtime.Tensor, stream: int, axis: int, start: int,
    name: str = ""
) -> None:
    """Enqueue `chunk <- whole[..., start:start + chunk.shape[axis], ...]` along `axis`, clipped
    to the rows `whole` has (`start` may be negative, the range may pass the end): a chunk's
    input range read through windows, halo rows included. Chunk rows outside `whole` are left as
    they are.

    Raises ValueError naming `name` (and poisons the stream) if `chunk` differs from `whole`
    along another axis or the range holds no row of `whole`.
    """
    get_function(COPY_WINDOW_ASYNC)(whole, chunk, stream, axis, start, name)


def wait(tensor: tvm.runtime.Tensor, stream: int = 0) -> None:
    """Wait until no copy enqueued on `stream` still reads or writes `tensor`'s memory.

    On CPU the caller blocks; on CUDA the compute stream waits. Raises if the stream failed.
    """
    get_function(WAIT)(tensor, stream)


def wait_all(stream: int = ALL_STREAMS) -> None:
    """Block until every copy on `stream` (default: every stream) is done; raise if one failed."""
    get_function(WAIT_ALL)(stream)


def is_idle(stream: int = ALL_STREAMS) -> bool:
    """Whether `stream` (default: every stream) has no copy in flight. Does not block."""
    return bool(get_function("tvm_ext.swap.is_idle")(stream))


def host_empty(
    shape: Sequence[int], dtype: str, host: tvm.runtime.Device, device: tvm.runtime.Device
) -> tvm.runtime.Tensor:
    """A host buffer for tensors swapped out of `device`, counted by `memory_stats`.

    Pinned (on `cuda_host:0`) when `device` is CUDA, so that copies are asynchronous; otherwise
    ordinary memory on `host` (e.g. cpu:1 as the host of cpu:0 in the CPU stand-in).
    """
    shape = tuple(int(s) for s in shape)
    return get_function("tvm_ext.swap.host_empty_on")(shape, dtype, host, device)


@dataclasses.dataclass(frozen=True)
class StreamStats:
    """What one copy stream did since the last reset.

    `busy_ns` is the time copies ran; `overlap_ns` the part of it during which no caller was
    blocked in a wait (i.e. copying while the caller computed); `wait_ns` the time callers spent
    blocked on this stream. Times are measured on CPU streams only (`timed`); CUDA streams count
    copies and bytes. With an emulated link (`set_emulated_link`): `paced` copies were paced,
    `late` of them took longer to memcpy than the link allows, and `overshoot_ns` is how far
    past their deadlines they ended in all (the worker's wake-up delay, and the late ones).
    """

    device: tvm.runtime.Device
    stream: int
    copies: int
    bytes: int
    busy_ns: int
    overlap_ns: int
    wait_ns: int
    waits: int
    timed: bool
    paced: int = 0
    late: int = 0
    overshoot_ns: int = 0


def stream_stats() -> list[StreamStats]:
    """Statistics of every copy stream created so far."""
    out = []
    for row in get_function("tvm_ext.swap.stats")():
        dev_type, dev_id, stream, *counts, timed, paced, late, overshoot = (int(v) for v in row)
        out.append(StreamStats(tvm.runtime.device(dev_type, dev_id), stream, *counts, bool(timed),
                               paced, late, overshoot))
    return out


def stats(stream: int = 0) -> StreamStats:
    """Statistics of copy stream `stream`, summed over devices (zeros if it was never used)."""
    rows = [s for s in stream_stats() if s.stream == stream]
    total = StreamStats(tvm.cpu(0), stream, 0, 0, 0, 0, 0, 0, timed=True)
    for s in rows:
        total = dataclasses.replace(
            total,
            device=s.device,
            copies=total.copies + s.copies,
            bytes=total.bytes + s.bytes,
            busy_ns=total.busy_ns + s.busy_ns,
            overlap_ns=total.overlap_ns + s.overlap_ns,
            wait_ns=total.wait_ns + s.wait_ns,
            waits=total.waits + s.waits,
            timed=total.timed and s.timed,
            paced=total.paced + s.paced,
            late=total.late + s.late,
            overshoot_ns=total.overshoot_ns + s.overshoot_ns,
        )
    return total


def reset_stats() -> None:
    """Zero the statistics and the trace (errors stay)."""
    get_function("tvm_ext.swap.reset_stats")()


def reset() -> None:
    """Finish every copy in flight, then clear errors (un-poison streams), statistics and trace."""
    get_function("tvm_ext.swap.reset")()


@dataclasses.dataclass(frozen=True)
class CopyRecord:
    """One finished copy: timestamps in ns on the `now_ns` clock."""

    stream: int
    name: str
    nbytes: int
    enqueued_ns: int
    start_ns: int
    end_ns: int


@dataclasses.dataclass(frozen=True)
class WaitRecord:
    """A time span during which a caller was blocked waiting for `stream`."""

    stream: int
    start_ns: int
    end_ns: int


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """One call the Relax VM made (a kernel, a builtin, a copy or wait call), recorded by the
    instrument `record_vm_calls` installs: `name` is the callee's symbol."""

    name: str
    start_ns: int
    end_ns: int


def set_tracing(enabled: bool) -> None:
    """Record every copy, blocking wait and (on VMs given to `record_vm_calls`) VM call (see
    `trace`); off by default."""
    get_function("tvm_ext.swap.set_tracing")(bool(enabled))


def record_vm_calls(vm: tvm.runtime.vm.VirtualMachine) -> None:
    """Install the runtime library's instrument on `vm`: while tracing is on, each call it makes
    is recorded with its begin and end on the trace's clock (a C++ instrument: well under a
    microsecond per call, where a Python one costs tens)."""
    vm.set_instrument(get_function("tvm_ext.swap.vm_instrument"))


def trace() -> list[CopyRecord | WaitRecord | CallRecord]:
    """The records since tracing was enabled or the last reset, in completion order."""
    out: list[CopyRecord | WaitRecord | CallRecord] = []
    for kind, stream, nbytes, t0, t1, t2, name in get_function("tvm_ext.swap.trace")():
        kind = int(kind)
        if kind == 0:
            out.append(CopyRecord(int(stream), str(name), int(nbytes), int(t0), int(t1), int(t2)))
        elif kind == 1:
            out.append(WaitRecord(int(stream), int(t1), int(t2)))
        else:
            out.append(CallRecord(str(name), int(t1), int(t2)))
    return out


@dataclasses.dataclass(frozen=True)
class EmulatedLink:
    """The emulated host link of the CPU stand-in: per direction, bytes/s and s per copy."""

    bandwidth: float
    latency: float

    def transfer_time(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth

    def describe(self) -> str:
        return f"{self.bandwidth / 1e9:.4g} GB/s, {self.latency * 1e6:.4g} us per copy"


LINK_ENV_GBPS = "TVM_EXT_LINK_GBPS"
LINK_ENV_LATENCY_US = "TVM_EXT_LINK_LATENCY_US"


def set_emulated_link(bandwidth: float, latency: float = 0.0) -> None:
    """Pace every copy between two devices on the CPU stand-in's copy streams to
    `latency + bytes / bandwidth` seconds (bytes/s, s); bandwidth 0 turns it off. An exported
    module run without this call takes the link from $TVM_EXT_LINK_GBPS (GB/s) and
    $TVM_EXT_LINK_LATENCY_US. Raises ValueError on negative or non-finite values."""
    get_function("tvm_ext.swap.set_link")(float(bandwidth), float(latency))


def emulated_link() -> EmulatedLink | None:
    """The link in force (set, or read from the environment), or None when copies run at
    memcpy speed. Raises ValueError naming a malformed environment variable."""
    bandwidth, latency = (float(v) for v in get_function("tvm_ext.swap.link")())
    return EmulatedLink(bandwidth, latency) if bandwidth > 0 else None


COPY_WORKER_CPUS_ENV = "TVM_EXT_COPY_WORKER_CPUS"


def set_copy_worker_cpus(cpus: Iterable[int]) -> None:
    """Pin the CPU stand-in's copy workers (running and future) to `cpus`; empty: unpin them.

    A GPU copies on its own engines while its cores compute; a copy worker sharing a core with
    the compute waits behind the running kernel when woken (a millisecond and more), leaving its
    stream idle. Give the workers a CPU the compute does not use (`tvm_ext.driver.
    dedicated_copy_cpu` does both). An exported module run without this call takes the CPUs
    from $TVM_EXT_COPY_WORKER_CPUS ("3", "2,3", "2-3"). Raises ValueError on a CPU this process
    may not run on, RuntimeError off Linux."""
    get_function("tvm_ext.swap.set_worker_cpus")([int(c) for c in cpus])


def process_cpus() -> tuple[int, ...]:
    """The CPUs the process could run on when the runtime library was loaded (unpinned copy
    workers run on these; a thread's own CPUs may be fewer since: TVM's thread pool binds the
    calling thread to one core once it runs a parallel kernel). Empty off Linux."""
    return tuple(int(c) for c in get_function("tvm_ext.swap.process_cpus")())


def copy_worker_cpus() -> tuple[int, ...]:
    """The CPUs the copy workers are pinned to; empty when unpinned. Raises ValueError naming a
    malformed $TVM_EXT_COPY_WORKER_CPUS."""
    return tuple(int(c) for c in get_function("tvm_ext.swap.worker_cpus")())


def now_ns() -> int:
    """The clock of the statistics and the trace (monotonic, ns)."""
    return int(get_function("tvm_ext.swap.now_ns")())


def inject_failure(stream: int, count: int = 1) -> None:
    """Make the next `count` copies enqueued on `stream` fail while running, as a device error
    would (fault injection, to test that failures are reported and poison the stream)."""
    get_function("tvm_ext.swap.inject_failure")(stream, count)
