"""Kernel times measured on this machine: the counterpart of the roofline.

`measure_kernels(model, target)` fuses the model as the pipeline does (`pipeline.fuse`, the
module the DataflowGraph is read from), compiles every PrimFunc alone as the build does (library
dispatch unless `library=False`, then the default schedules), and times it on random inputs
with `time_evaluator`. `tvm_ext.cost.calibration` compares and calibrates against them.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import tirx

from .. import pipeline
from ..cost.calibration import KernelTiming
from ..graph import DataflowGraph
from ..ir.graph_builder import build_graph
from ..ir.pass_records import LIBRARY_ATTR
from ..runtime.kernel_timing import kernel_arguments, kernel_params, time_kernel
from .build import device_of


def compile_kernel(func: tirx.PrimFunc, name: str, target: tvm.target.Target,
                   library: bool = True) -> tuple:
    """One kernel of a fused module compiled alone as the build compiles it (library dispatch
    unless `library=False`, then the default schedules): (the compiled module, whether a
    vendor library computes part of it)."""
    func = func.with_attr("global_symbol", name)
    passes = pipeline.library_kernels_passes(target, library) + pipeline.schedule_passes(target)
    with target:
        kernel = tvm.transform.Sequential(passes)(tvm.IRModule({name: func}))
        lib = tvm.compile(kernel, target)
    return lib, LIBRARY_ATTR in (kernel[name].attrs or {})


def measure_kernels(model, target=None, graph: DataflowGraph | None = None, *,
                    number: int = 3, repeat: int = 3, seed: int = 0,
                    library: bool = True) -> dict[str, KernelTiming]:
    """Seconds per call of every kernel the model's fused graph calls, measured here."""
    target = target or tvm.target.Target("llvm")
    mod = pipeline.fuse(model.mod, target)
    graph = graph or build_graph(mod)
    calls: dict[str, list] = {}
    for op in graph.ops:
        if op.kind == "kernel":
            calls.setdefault(op.kernel, []).append(op)
    dev = device_of(target)
    rng = np.random.default_rng(seed)
    timings = {}
    for gv, func in mod.functions.items():
        name = gv.name_hint
        if not isinstance(func, tirx.PrimFunc) or name not in calls:
            continue
        lib, dispatched = compile_kernel(func, name, target, library)
        args = kernel_arguments(kernel_params(func), dev, rng)
        seconds = float(np.median(time_kernel(lib.mod, name, args, dev, number=number,
                                              repeat=repeat)))
        op = calls[name][0]
        timings[name] = KernelTiming(name, float(seconds), op.flops, op.bytes_moved,
                                     len(calls[name]), dispatched)
    return timings
