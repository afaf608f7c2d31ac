"""Build and export a model: targets, the fused graph the planners read, compilation.

Each step is a plain function so tests and benchmarks use the same code as the CLI.
"""

from __future__ import annotations

from collections.abc import Sequence

import tvm
from tvm import relax
from tvm.target import codegen

from .. import pipeline
from ..graph import DataflowGraph
from ..ir.graph_builder import build_graph
from ..ir.kernel_dims import problem_from_module
from ..ir.kernel_fission import fission_kernels
from ..ir.swap_planning import swap_graph
from ..ir.targets import is_cpu
from ..ir.time_splits import annotate_time_splits
from ..models import Model
from ..partition import PartitionProblem
from ..passes import Bfloat16InFloat32
from ..runtime.cuda import DEFAULT_ARCH, cuda_target, ensure_cuda_runtime


def resolve_target(name: str, arch: str = DEFAULT_ARCH) -> tvm.target.Target:
    """`llvm` (this machine's CPU: its vector width decides the default schedules'), `cuda`
    (any machine: see `tvm_ext.runtime.cuda`) or any TVM target string."""
    if name == "cuda":
        ensure_cuda_runtime()
        return cuda_target(arch)  # and the compiler
    if name == "llvm":
        return tvm.target.Target({"kind": "llvm", "mcpu": host_cpu()})
    return tvm.target.Target(name)


# CPU models whose LLVM (22, in the apache-tvm wheel) tuning miscompiles TVM kernels, mapped to
# the generic level with the same vector ISA. znver4: the loop vectorizer turns a predicated
# load `A[(i % 16) * 8 + j % 8]` under an if_then_else into one contiguous masked load across
# the `j % 8` wrap (tests/test_driver_build.py holds the kernel), which broke RoPE gradients.
_MISCOMPILING_CPUS = {"znver4": "x86-64-v4", "znver5": "x86-64-v4"}


def host_cpu() -> str:
    """The `mcpu` for this machine's CPU: LLVM's name for it, unless that model miscompiles."""
    cpu = str(codegen.llvm_get_system_cpu())
    return _MISCOMPILING_CPUS.get(cpu, cpu)


def device_of(target: tvm.target.Target, index: int = 0) -> tvm.runtime.Device:
    """The device a target's kernels run on."""
    if is_cpu(target):
        return tvm.cpu(index)
    return tvm.device(target.kind.name, index)


def fused_graph(model: Model | tvm.IRModule, target: tvm.target.Target,
                fissioned: Sequence[str] = (), budgeted: bool = True) -> DataflowGraph:
    """The DataflowGraph of the model as the pipeline fuses it for `target`, with the ops a
    swap plan may split in time (as SwapOffload reads it); `fissioned`: kernels run as their
    parts (a plan's `fissioned`); `budgeted=False`: as a build without a device budget fuses
    it (`pipeline.fuse`)."""
    fused = pipeline.fuse(_module(model), target, budgeted=budgeted)
    if fissioned:  # a part that only reshapes is a view, as SwapOffload reads it
        return swap_graph(fission_kernels(fused, fissioned))
    return annotate_time_splits(fused, build_graph(fused))


def partition_problem(model: Model | tvm.IRModule,
                      target: tvm.target.Target | str = "llvm") -> PartitionProblem:
    """The `PartitionProblem` of the model as the pipeline fuses it for `target`."""
    target = resolve_target(target) if isinstance(target, str) else target
    return problem_from_module(pipeline.fuse(_module(model), target, fused_attention=False))


def _module(model: Model | tvm.IRModule) -> tvm.IRModule:
    return model.mod if isinstance(model, Model) else model


def build(model: Model, target: tvm.target.Target, **pipeline_options) -> relax.VMExecutable:
    """Compile through the registered `tvm_ext` pipeline."""
    pipeline = relax.get_pipeline("tvm_ext", target=target, **pipeline_options)
    with target:
        return tvm.compile(model.mod, target, relax_pipeline=pipeline)


def build_reference(model: Model, target: tvm.target.Target) -> relax.VMExecutable:
    """A plain `tvm.compile` with TVM's default pipeline: the reference for `--check`. Its
    bfloat16 sorts, argmax / argmin and finiteness tests read the widened values
    (`Bfloat16InFloat32`, exact): TVM's own fail to compile (argmax / argmin, isnan / isinf /
    isfinite) or misorder (sorts) on llvm, which would leave a bfloat16 model with nothing to
    check against."""
    with target:
        return tvm.compile(Bfloat16InFloat32()(model.mod), target)


def export(executable: relax.VMExecutable, path: str) -> str:
    """Write a deployable shared library."""
    executable.export_library(path)
    return path
