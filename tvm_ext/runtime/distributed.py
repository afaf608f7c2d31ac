"""Running compiled modules on k workers: a Disco session with a collective backend.

A `Session` starts k worker threads (TVM's `ThreadedSession`) joined by a collective backend of
the tvm_ext runtime library:

- ``"cpu"``: worker threads exchange host memory (src/ccl/ccl_cpu.cc); runs anywhere.
- ``"nccl"``: one GPU per worker (src/ccl/nccl/ccl_nccl.cc, built when CUDA and NCCL are found).

Worker i allocates on its own device, ``cpu(i)`` or ``cuda(i)``. TVM's CPU device API ignores
the device id, but the VM allocators and tvm_ext's memory counters are kept per (type, id), so
each CPU worker's bytes are counted apart: `Session.memory_stats()` reads them on every worker.

    with Session(4) as sess:
        mod = sess.load_module("model.so")
        w = sess.scatter(weight, axis=1)           # each worker gets its column shard
        x = sess.replicate(inputs)                 # each worker gets the whole array
        out = mod["main"](x, w)
        y = sess.gather(out[0], axis=None)         # worker 0's copy (replicated output)

Modules partitioned by `tvm_ext.passes.PartitionOperators` take each argument as the piece its
layout names (multi-level meshes included): `run_partitioned(sess, mod, arrays, layout)` places
them, runs, measures each worker's peak and gathers the outputs whole; `run_exported` does the
same from an exported module and its `.partition.json` sidecar.

Workers never raise into the controller (an exception in a TVM worker thread ends the process),
so every worker call goes through ``tvm_ext.disco.call_guarded``; the first failure of any worker
is raised here as `DistributedError`, and the cpu backend wakes the other workers at once.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import numpy as np
import tvm
import tvm_ffi
from tvm_ffi import Shape

from ..errors import RunError, UnavailableError
from ..partition.sharding import shards, unshard
from . import library, memory
from .cuda import CudaUnavailableError, ensure_cuda_runtime
from .memory import PeakMeasurement
from .timing import time_calls
from .vendor_libraries import preload

BACKENDS = ("cpu", "nccl")
WORKER0 = "worker0"
Placement = int | None | str  # axis to split along, None (replicated), or WORKER0
_ALLOCATORS = {"naive": 1, "pooled": 2}


class DistributedError(RunError):
    """A worker failed; the message names the worker and its error."""


class NcclUnavailableError(UnavailableError):
    """The NCCL backend was asked for but cannot be used here."""


def disco_module() -> ModuleType:
    """`tvm.runtime.disco`, imported after TVM's Disco library has loaded.

    `import tvm` imports `tvm.runtime.disco` before it loads libtvm_runtime_extra (which holds
    Disco), so the import fails and leaves `tvm.runtime.disco = None` and an empty `_ffi_api`
    behind. Re-import those two; keep `process_pool`, whose global function is already registered.
    With TVM's runtime alone (no compiler) the first import does not fail: it skips the classes
    of types not yet registered and registers `session`'s global function, so the re-import
    must be allowed to register that function again.
    """
    mod = getattr(tvm.runtime, "disco", None)
    if mod is None or not hasattr(mod._ffi_api, "SessionThreaded"):
        for name in ("_ffi_api", "session", ""):
            sys.modules.pop("tvm.runtime.disco" + (f".{name}" if name else ""), None)
        register = tvm_ffi.register_global_func

        def register_again(name, func=None, override=False):
            return register(name, func, override=True)

        tvm_ffi.register_global_func = register_again  # read by `session` as it imports
        try:
            mod = importlib.import_module("tvm.runtime.disco")
        finally:
            tvm_ffi.register_global_func = register
        tvm.runtime.disco = mod
    return mod


def load_nccl_backend() -> str:
    """Load the NCCL backend library (and TVM's CUDA runtime); returns its path."""

    try:
        ensure_cuda_runtime()
    except CudaUnavailableError as err:
        raise NcclUnavailableError(f"the nccl backend needs TVM's CUDA runtime: {err}") from err
    preload("libnccl.so.2")  # e.g. PyTorch's, from the nvidia-nccl wheel, if need be
    try:
        return str(library.get_function("tvm_ext.disco.load_nccl_backend")())
    except RuntimeError as err:
        raise NcclUnavailableError(str(err)) from err


def nccl_available() -> bool:
    """Whether the NCCL backend library is built and loads (it may still find no GPU)."""
    try:
        load_nccl_backend()
    except NcclUnavailableError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class DArray:
    """A tensor with one part on every worker. `shape` is the per-worker shape."""

    session: Session = dataclasses.field(repr=False)
    ref: Any = dataclasses.field(repr=False)  # the disco DRef
    shape: tuple[int, ...]
    dtype: str


@dataclasses.dataclass
class WorkerPeak(PeakMeasurement):
    """Per-worker result of `Session.measure_peak` (bytes of the tracked allocators)."""

    worker: int = 0


class Session:
    """k workers joined by a collective backend (see the module docstring)."""

    def __init__(
        self,
        num_workers: int,
        backend: str = "cpu",
        *,
        device_ids: Sequence[int] | None = None,
        num_groups: int = 1,
        timeout: float | None = None,
    ) -> None:
        """Start the workers.

        Args:
            num_workers: k >= 1.
            backend: "cpu" or "nccl".
            device_ids: device index of each worker (default 0..k-1).
            num_groups: Disco worker groups (in_group collectives stay inside a group).
            timeout: seconds a cpu collective waits for a missing worker before failing.
        """
        if backend not in BACKENDS:
            raise ValueError(f"unknown collective backend {backend!r}; choose one of {BACKENDS}")
        if int(num_workers) < 1:
            raise ValueError(f"a session needs at least one worker, got {num_workers}")
        if num_groups < 1 or num_workers % num_groups:
            raise ValueError(f"{num_workers} workers cannot form {num_groups} equal groups")
        ids = list(range(num_workers)) if device_ids is None else [int(i) for i in device_ids]
        if len(ids) != num_workers:
            raise ValueError(f"{len(ids)} device ids for {num_workers} workers")
        library.load_library()
        if backend == "nccl":
            load_nccl_backend()
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout}")
        self.timeout = timeout
        self.backend = backend
        self.num_workers = int(num_workers)
        self.device_ids = ids
        self._disco = disco_module()
        self._sess = self._disco.ThreadedSession(self.num_workers, num_groups)
        self._funcs: dict[str, Any] = {}
        self._closed = False
        try:
            self._init_ccl()
            self.check("init_ccl")
        except Exception as err:
            self.shutdown()
            if backend == "nccl" and not isinstance(err, DistributedError):
                raise NcclUnavailableError(f"the nccl backend cannot start: {err}") from err
            raise
        kind = "cpu" if backend == "cpu" else "cuda"
        self.devices = [tvm.runtime.device(kind, i) for i in ids]

    # -- plumbing -------------------------------------------------------------------------------

    def _func(self, name: str) -> Any:
        if name not in self._funcs:
            self._funcs[name] = self._sess.get_global_func(name)
        return self._funcs[name]

    def call(self, name: str, *args: Any) -> Any:
        """Queue a call of global function `name` on every worker; returns the result's DRef.
        DArray arguments are passed as their `.ref`. Errors are kept on the workers: `check`
        waits for all of them and raises the first."""
        if self._closed:
            raise RuntimeError("the session was shut down")
        args = tuple(a.ref if isinstance(a, DArray) else a for a in args)
        return self._sess.call_packed(self._func("tvm_ext.disco.call_guarded"), self._func(name),
                                      *args)

    def _call_ref(self, func_ref: Any, *args: Any) -> Any:
        return self._sess.call_packed(self._func("tvm_ext.disco.call_guarded"), func_ref, *args)

    def _from_worker(self, ref: Any, worker: int) -> Any:
        return ref.debug_get_from_remote(worker)

    def _init_ccl(self) -> None:
        # The cpu backend reads its timeout when a communicator is created: set it for this one.
        set_timeout = library.get_function("tvm_ext.ccl.cpu.set_timeout")
        default = float(library.get_function("tvm_ext.ccl.cpu.timeout")())
        set_timeout(float(self.timeout or default))
        try:
            self._disco._ffi_api.SessionInitCCL(self._sess, self.backend, Shape(self.device_ids))
        finally:
            set_timeout(default)

    def check(self, what: str = "the last calls") -> None:
        """Wait for every worker and raise the first root-cause error any of them kept."""
        errors = self._sess.call_packed(self._func("tvm_ext.disco.take_error"))
        found = []
        for i in range(self.num_workers):
            text = str(self._from_worker(errors, i))
            if text:
                echo, message = text.split(":", 1)
                found.append((echo == "echo", i, message))
        if not found:
            return
        found.sort()
        _, worker, message = found[0]
        failed = [i for echo, i, _ in found[1:] if not echo]
        stopped = [i for echo, i, _ in found[1:] if echo]
        tail = f"; workers {failed} failed too" if failed else ""
        tail += f"; workers {stopped} were stopped by it" if stopped else ""
        if self.backend == "cpu":
            # A failure aborts the cpu communicator; a fresh one keeps the session usable.
            self._init_ccl()
        raise DistributedError(f"{what} failed on worker {worker}: {message}{tail}")

    # -- modules ---------------------------------------------------------------------------------

    def load_module(self, module: str | os.PathLike | Any, allocator: str = "naive", *,
                    separate_host: bool = False) -> DModule:
        """Load an exported module (path to a .so, or an Executable, exported here) on every
        worker, as a Relax VM on the worker's device. `allocator` "naive" gives exact peaks.
        `separate_host`: a CPU worker i gets cpu(i + host_offset) as its host device (VM device
        1, where a swapped module keeps what it swaps out), counted apart from its device."""
        if allocator not in _ALLOCATORS:
            raise ValueError(f"allocator must be one of {list(_ALLOCATORS)}, got {allocator!r}")
        if not isinstance(module, (str, os.PathLike)):
            # Once loaded, the library stays mapped: the exported file can go.
            with tempfile.TemporaryDirectory(prefix="tvm_ext_dist_") as tmp:
                path = os.path.join(tmp, "module.so")
                module.export_library(path)
                return self.load_module(path, allocator, separate_host=separate_host)
        path = os.path.abspath(os.fspath(module))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no module at {path}")
        offset = self.host_offset if separate_host else 0
        ref = self.call("tvm_ext.disco.load_vm_module", path, _ALLOCATORS[allocator], offset)
        self.check(f"loading {path}")
        return DModule(self, ref, path)

    @property
    def host_offset(self) -> int:
        """CPU worker i's separate host device is cpu(device_ids[i] + host_offset)."""
        return max(self.device_ids) + 1

    def host_devices(self) -> list[tvm.runtime.Device]:
        """Each worker's host device under `load_module(..., separate_host=True)`."""
        if self.backend != "cpu":
            return [tvm.cpu(0)] * self.num_workers
        return [tvm.cpu(i + self.host_offset) for i in self.device_ids]

    # -- placing arrays --------------------------------------------------------------------------

    def empty(self, shape: Sequence[int], dtype: str, *, on_host: bool = False) -> DArray:
        """An uninitialised array of `shape` on every worker (tracked allocator), on its device
        or on its separate host device (`load_module(..., separate_host=True)`)."""
        shape = tuple(int(s) for s in shape)
        if on_host:
            ref = self.call("tvm_ext.disco.host_empty", Shape(shape), dtype, self.host_offset)
        else:
            ref = self.call("tvm_ext.disco.empty", Shape(shape), dtype)
        self.check("allocating")
        return DArray(self, ref, shape, str(dtype))

    def replicate(self, array: np.ndarray, *, on_host: bool = False) -> DArray:
        """The whole array on every worker (copied to worker 0, broadcast from there)."""
        array = np.asarray(array, order="C")
        out = self.empty(array.shape, str(array.dtype), on_host=on_host)
        self._sess.copy_to_worker_0(tvm.runtime.tensor(array), out.ref)
        self.call("runtime.disco.broadcast_from_worker0", out.ref, False, out.ref)
        self.check("broadcast_from_worker0")
        return out

    def scatter(self, array: np.ndarray, axis: int = 0) -> DArray:
        """Split `array` evenly along `axis`; worker i gets part i."""
        array = np.asarray(array)
        axis = _normalize_axis(axis, array.ndim)
        k = self.num_workers
        if array.shape[axis] % k:
            raise ValueError(f"cannot split axis {axis} of shape {array.shape} into {k} equal "
                             "parts")
        parts = np.split(array, k, axis=axis)
        return self.per_worker(parts)

    def per_worker(self, arrays: Sequence[np.ndarray], *, on_host: bool = False) -> DArray:
        """Worker i gets `arrays[i]` (all of one shape and dtype), through scatter_from_worker0."""
        if len(arrays) != self.num_workers:
            raise ValueError(f"{len(arrays)} arrays for {self.num_workers} workers")
        shapes = {(a.shape, str(a.dtype)) for a in map(np.asarray, arrays)}
        if len(shapes) != 1:
            raise ValueError(f"per-worker arrays differ in shape or dtype: {sorted(shapes)}")
        stacked = np.ascontiguousarray(np.stack([np.asarray(a) for a in arrays]))
        out = self.empty(stacked.shape[1:], str(stacked.dtype), on_host=on_host)
        staging = self._sess.empty(stacked.shape, str(stacked.dtype), worker0_only=True,
                                   in_group=False)
        self._sess.copy_to_worker_0(tvm.runtime.tensor(stacked), staging)
        self.call("runtime.disco.scatter_from_worker0", staging, False, out.ref)
        self.check("scatter_from_worker0")
        return out

    def on_worker0(self, array: np.ndarray) -> DArray:
        """The whole array on worker 0; the others hold an uninitialised array of its shape.
        For modules that distribute their inputs themselves (relax.distributed's LowerDistIR
        emits broadcast_from_worker0 / scatter_from_worker0 on the parameters)."""
        array = np.asarray(array, order="C")
        out = self.empty(array.shape, str(array.dtype))
        self._sess.copy_to_worker_0(tvm.runtime.tensor(array), out.ref)
        self.check("copying to worker 0")
        return out

    def place(self, array: np.ndarray, placement: Placement) -> DArray:
        """Place one array: an int splits along that axis (`scatter`), None copies it to every
        worker (`replicate`), "worker0" fills worker 0 only (`on_worker0`)."""
        if placement is None:
            return self.replicate(array)
        if placement == WORKER0:
            return self.on_worker0(array)
        if isinstance(placement, (int, np.integer)) and not isinstance(placement, bool):
            return self.scatter(array, int(placement))
        raise ValueError(f"unknown placement {placement!r}: an axis (int), None (replicated) or "
                         f"{WORKER0!r}")

    # -- reading arrays back ---------------------------------------------------------------------

    def gather(self, darray: DArray, axis: int | None = None) -> np.ndarray:
        """Worker 0's part (axis None), or all parts concatenated along `axis`."""
        if axis is None:
            return self._copy_from_worker0(darray.ref, darray.shape, darray.dtype)
        parts = self.worker_values(darray)
        return np.concatenate(parts, axis=_normalize_axis(axis, len(darray.shape)))

    def worker_values(self, darray: DArray) -> list[np.ndarray]:
        """Every worker's part, gathered to worker 0 and copied out."""
        k = self.num_workers
        staging = self._sess.empty((k, *darray.shape), darray.dtype, worker0_only=True,
                                   in_group=False)
        self.call("runtime.disco.gather_to_worker0", darray.ref, False, staging)
        self.check("gather_to_worker0")
        stacked = self._copy_from_worker0(staging, (k, *darray.shape), darray.dtype)
        return list(stacked)

    def _copy_from_worker0(self, ref: Any, shape: Sequence[int], dtype: str) -> np.ndarray:
        host = tvm.runtime.empty(tuple(shape), dtype, tvm.cpu(0))
        self._sess.copy_from_worker_0(host, ref)
        self._sess.sync_worker_0()
        return host.numpy()

    # -- memory ----------------------------------------------------------------------------------

    def memory_stats(self) -> list[memory.MemoryStats]:
        """tvm_ext's counters of each worker's device."""
        ref = self.call("tvm_ext.disco.memory_stats")
        self.check("memory_stats")
        return [memory.MemoryStats(*(int(v) for v in self._from_worker(ref, i)))
                for i in range(self.num_workers)]

    def reset_peak(self) -> None:
        self.call("tvm_ext.disco.reset_peak")
        self.check("reset_peak")

    @contextmanager
    def measure_peak(self) -> Iterator[list[WorkerPeak]]:
        """Per-worker peak bytes in use during the block."""
        self.sync()
        self.reset_peak()
        result = [WorkerPeak(dev, baseline=s.in_use, worker=i)
                  for i, (dev, s) in enumerate(zip(self.devices, self.memory_stats(), strict=True))]
        try:
            yield result
        finally:
            self.sync()
            for peak, stats in zip(result, self.memory_stats(), strict=True):
                peak.peak = stats.peak_in_use

    # -- lifetime --------------------------------------------------------------------------------

    def sync(self) -> None:
        """Wait until every worker has finished its queued work (and its device streams)."""
        for i in range(self.num_workers):
            self._sess._sync_worker(i)

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._funcs.clear()
            self._sess.shutdown()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class DModule:
    """A module loaded on every worker; `mod["main"](*darrays)` runs it everywhere."""

    def __init__(self, session: Session, ref: Any, path: str) -> None:
        self.session = session
        self.ref = ref
        self.path = path

    def __getitem__(self, name: str) -> DFunction:
        sess = self.session
        ref = sess.call("tvm_ext.disco.get_function", self.ref, name)
        sess.check(f"looking up {name}")
        return DFunction(sess, ref, name)


class DFunction:
    """A function of a loaded module, called on every worker at once."""

    def __init__(self, session: Session, ref: Any, name: str) -> None:
        self.session = session
        self.ref = ref
        self.name = name

    def __call__(self, *args: DArray) -> list[Any]:
        """Run on every worker; returns the result flattened depth-first: a DArray per tensor,
        and worker 0's value of each shape (tuple), int, float or None."""
        sess = self.session
        result = self.invoke(*args)
        sess.check(f"calling {self.name}")
        described = sess.call("tvm_ext.disco.describe", result)
        sess.check(f"reading the result of {self.name}")
        layouts = [json.loads(str(sess._from_worker(described, i)))
                   for i in range(sess.num_workers)]
        for i, layout in enumerate(layouts[1:], start=1):
            if layout != layouts[0]:
                raise DistributedError(f"{self.name}: worker {i} returned {layout}, worker 0 "
                                       f"{layouts[0]}; workers must return the same layout")
        leaves = _leaves(layouts[0])
        outputs = []
        for j, leaf in enumerate(leaves):
            if leaf is None or "shape" not in leaf:
                outputs.append(_plain_value(self.name, j, leaf))
                continue
            ref = sess.call("tvm_ext.disco.leaf", result, j)
            outputs.append(DArray(sess, ref, tuple(leaf["shape"]), leaf["dtype"]))
        sess.check(f"reading the result of {self.name}")
        return outputs


    def invoke(self, *args: DArray) -> Any:
        """Queue a call on every worker and return the result's DRef at once (no waiting, no
        error check: `Session.sync` then `Session.check` do both)."""
        sess = self.session
        for a in args:
            if not isinstance(a, DArray) or a.session is not sess:
                raise TypeError(f"{self.name}: arguments must be DArrays of this session "
                                "(Session.scatter / replicate / per_worker)")
        return sess._call_ref(self.ref, *(a.ref for a in args))


def _plain_value(name: str, index: int, leaf: dict | None) -> Any:
    if leaf is None:
        return None
    if "shape_value" in leaf:
        return tuple(leaf["shape_value"])
    if "int" in leaf or "float" in leaf:
        return leaf.get("int", leaf.get("float"))
    raise DistributedError(f"{name}: output {index} is a {leaf['other']}, which cannot be "
                           "returned from the workers")


def _leaves(layout: Any) -> list[dict]:
    if isinstance(layout, list):
        return [leaf for item in layout for leaf in _leaves(item)]
    return [layout]


def _normalize_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for {ndim} dimensions")
    return axis % ndim


@dataclasses.dataclass
class DistributedRunResult:
    """What `run` measured: outputs gathered to the host, per-worker bytes, latencies (ms)."""

    outputs: list[Any]  # numpy arrays (tensors), tuples (shapes), numbers
    peak_bytes: list[int]  # per worker, arguments included, above what it held before
    argument_bytes: list[int]  # per worker
    latencies_ms: list[float]
    host_peak_bytes: list[int] = dataclasses.field(default_factory=list)  # separate hosts


def run(
    session: Session,
    module: DModule,
    arguments: Sequence[np.ndarray],
    placements: Sequence[Placement],
    output_axes: Sequence[int | None] | None = None,
    *,
    func: str = "main",
    repeat: int = 0,
) -> DistributedRunResult:
    """Place each argument (see `Session.place`), run `func` once measuring
    each worker's peak memory, then `repeat` times for time; gather each output (axis to
    concatenate along, or None for worker 0's copy)."""
    if len(placements) != len(arguments):
        raise ValueError(f"{len(placements)} placements for {len(arguments)} arguments")
    session.sync()
    before = [s.in_use for s in session.memory_stats()]
    args = [session.place(a, p) for a, p in zip(arguments, placements, strict=True)]
    arg_bytes = [s.in_use - b for s, b in zip(session.memory_stats(), before, strict=True)]
    function = module[func]
    session.reset_peak()
    outs = function(*args)
    session.sync()
    peaks = [s.peak_in_use - b for s, b in zip(session.memory_stats(), before, strict=True)]
    axes = list(output_axes) if output_axes is not None else [None] * len(outs)
    if len(axes) != len(outs):
        raise ValueError(f"{len(axes)} output axes for {len(outs)} outputs")
    outputs = [session.gather(o, ax) if isinstance(o, DArray) else o
               for o, ax in zip(outs, axes, strict=True)]
    del outs
    latencies = time_calls(lambda: function.invoke(*args), session.sync, repeat)
    session.check(f"running {func}")
    return DistributedRunResult(outputs, peaks, arg_bytes, latencies)


def place_sharded(session: Session, array: np.ndarray, mesh: Sequence[int],
                  layout: Sequence[int], *, on_host: bool = False) -> DArray:
    """Each worker gets its piece of `array` under a partition layout (one scheme per mesh
    level, see `tvm_ext.partition.sharding`): replicated arrays are broadcast, others
    scattered piece by piece."""

    if all(s < 0 for s in layout):
        return session.replicate(np.asarray(array), on_host=on_host)
    return session.per_worker(shards(np.asarray(array), mesh, layout), on_host=on_host)


def gather_sharded(session: Session, darray: DArray, mesh: Sequence[int],
                   layout: Sequence[int], shape: Sequence[int]) -> np.ndarray:
    """The whole array of `shape` from every worker's piece under a partition layout."""

    if all(s < 0 for s in layout):
        return session.gather(darray)
    return unshard(session.worker_values(darray), mesh, layout, shape)


def run_partitioned(
    session: Session,
    module: DModule,
    arguments: Sequence[np.ndarray],
    layout: dict,
    *,
    func: str = "main",
    repeat: int = 0,
    arg_devices: Sequence[int] | None = None,
) -> DistributedRunResult:
    """Run a module partitioned by `tvm_ext.passes.PartitionOperators` on the session's k
    workers: place each argument's pieces as `layout` says (the record of
    `tvm_ext.ir.pass_records.partition_record(mod)` or `tvm_ext.partition.plan.layouts_of(plan,
    graph)`: mesh, per argument and output its shape and layout), run `func` once measuring
    each worker's peak memory, then `repeat` times for time, and gather every output whole.

    A module swapped per device after partitioning (SwapOffload) keeps some arguments on the
    host: `arg_devices` gives 0 (device) or 1 (host) per argument (see
    `tvm_ext.passes.swap_offload.argument_devices`); load it with `separate_host=True`; the
    host peaks are reported apart."""
    k = int(layout["num_devices"])
    if session.num_workers != k:
        raise ValueError(f"the module is partitioned for {k} devices; the session has "
                         f"{session.num_workers} workers (start a Session({k}))")
    specs = layout["arguments"]
    if len(arguments) != len(specs):
        raise ValueError(f"{len(arguments)} arguments; the module takes {len(specs)}")
    for a, spec in zip(arguments, specs, strict=True):
        if tuple(np.shape(a)) != tuple(spec["shape"]) or str(np.asarray(a).dtype) != \
                spec["dtype"]:
            raise ValueError(f"argument {spec['name']}: {np.shape(a)} {np.asarray(a).dtype}, "
                             f"the module takes {tuple(spec['shape'])} {spec['dtype']}")
    mesh = layout["mesh"]
    arg_devices = list(arg_devices) if arg_devices is not None else [0] * len(arguments)
    if len(arg_devices) != len(arguments):
        raise ValueError(f"{len(arg_devices)} argument devices for {len(arguments)} arguments")
    hosts = session.host_devices() if any(arg_devices) else []
    session.sync()
    before = [s.in_use for s in session.memory_stats()]
    host_before = [memory.memory_stats(h).in_use for h in hosts]
    args = [place_sharded(session, a, mesh, spec["layout"], on_host=bool(d))
            for a, spec, d in zip(arguments, specs, arg_devices, strict=True)]
    arg_bytes = [s.in_use - b for s, b in zip(session.memory_stats(), before, strict=True)]
    function = module[func]
    session.reset_peak()
    for h in hosts:
        memory.reset_peak(h)
    outs = function(*args)
    session.sync()
    peaks = [s.peak_in_use - b for s, b in zip(session.memory_stats(), before, strict=True)]
    host_peaks = [memory.memory_stats(h).peak_in_use - b
                  for h, b in zip(hosts, host_before, strict=True)]
    if len(outs) != len(layout["outputs"]):
        raise DistributedError(f"{func} returned {len(outs)} values; the layout lists "
                               f"{len(layout['outputs'])} outputs")
    outputs = [gather_sharded(session, o, mesh, spec["layout"], spec["shape"])
               if isinstance(o, DArray) else o
               for o, spec in zip(outs, layout["outputs"], strict=True)]
    del outs
    latencies = time_calls(lambda: function.invoke(*args), session.sync, repeat)
    session.check(f"running {func}")
    return DistributedRunResult(outputs, peaks, arg_bytes, latencies, host_peaks)


def run_exported(
    session: Session,
    path: str | os.PathLike,
    arguments: Sequence[np.ndarray],
    *,
    repeat: int = 0,
) -> DistributedRunResult:
    """Run a partitioned module exported by `compile.py --devices K --output PATH`: its
    sidecar `PATH.partition.json` says how to place each argument (and which ones a per-device
    swap plan keeps on the host). On a machine with K GPUs: `Session(K, "nccl")`."""
    path = os.fspath(path)
    side = path + ".partition.json"
    if not os.path.isfile(side):
        raise FileNotFoundError(f"no {side}: export partitioned modules with compile.py "
                                "--devices K --output PATH, which writes it beside the module")
    with open(side) as f:
        info = json.load(f)
    arg_devices = info.get("arg_devices")
    module = session.load_module(path, separate_host=bool(arg_devices and any(arg_devices)))
    return run_partitioned(session, module, arguments, info["layout"], repeat=repeat,
                           arg_devices=arg_devices)
