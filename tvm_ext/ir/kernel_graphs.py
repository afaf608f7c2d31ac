"""How many kernel launches a call of a module makes once `CaptureKernelGraphs` (tvm_ext.passes)
has put its static kernel runs into CUDA graphs: one launch per graph, one per kernel outside.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import relax, tirx

# TVM's builtins RewriteCUDAGraph calls, and tvm_ext's (src/graph/kernel_graphs.cc).
TVM_BUILTIN = "vm.builtin.cuda_graph.run_or_capture"
BUILTIN = "tvm_ext.cuda_graph.run_or_capture"
BUILTINS = {TVM_BUILTIN: BUILTIN,
            "vm.builtin.cuda_graph.get_cached_alloc": "tvm_ext.cuda_graph.get_cached_alloc"}


@dataclasses.dataclass(frozen=True)
class GraphCoverage:
    """Kernel calls of a module's functions after `CaptureKernelGraphs`: in captured regions
    (replayed as one launch each) and outside them (one launch each)."""

    regions: int
    captured: int
    uncaptured: int

    @property
    def launches(self) -> int:
        """Launches per call of the module once its graphs are captured."""
        return self.regions + self.uncaptured

    def describe(self) -> str:
        total = self.captured + self.uncaptured
        return (f"{self.captured} of {total} kernel calls in {self.regions} CUDA graph"
                f"{'s' if self.regions != 1 else ''}: {self.launches} launches a call")


def graph_coverage(mod: tvm.IRModule) -> GraphCoverage:
    """Where the kernel calls of `mod` (after `CaptureKernelGraphs`) run."""
    kernels = {gv for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}
    regions = [region for func in mod.functions.values() if isinstance(func, relax.Function)
               for region in _regions_called(func)]
    captured = uncaptured = 0
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            calls = _kernel_calls(func, kernels)
            if gv in regions:
                captured += calls
            else:
                uncaptured += calls
    return GraphCoverage(len(regions), captured, uncaptured)


def _calls(func: relax.Function) -> list[relax.Call]:
    found = []
    relax.analysis.post_order_visit(
        func, lambda e: found.append(e) if isinstance(e, relax.Call) else None)
    return found


def _kernel_calls(func: relax.Function, kernels: set) -> int:
    return sum(isinstance(c.op, tvm.ir.GlobalVar) and c.op in kernels for c in _calls(func))


def _regions_called(func: relax.Function) -> list[tvm.ir.GlobalVar]:
    """The captured functions `func` runs through the graph builtin (its first argument)."""
    with_ctx = tvm.ir.Op.get("relax.call_builtin_with_ctx")
    return [c.args[1].fields[0] for c in _calls(func)
            if c.op.same_as(with_ctx) and isinstance(c.args[0], relax.ExternFunc)
            and c.args[0].global_symbol in (BUILTIN, TVM_BUILTIN)]
