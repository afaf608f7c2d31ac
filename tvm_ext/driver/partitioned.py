"""Plan, build and run a model partitioned over k devices: the steps behind
`scripts/compile.py MODEL --devices K` (tests and benchmarks use the same functions).

    build = build_partitioned(model, target, 4, hardware="h100")
    with Session(4) as sess:
        result = run_partitioned_build(sess, build, model.random_arguments(0))

The plan is made before compiling (so the CLI can report it, and a budget can be planned per
device on the partitioned code); the partitioned module then goes through the rest of the
pipeline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import tvm
from tvm import relax

from tvm_ext.passes import PartitionError, PartitionOperators

from .. import pipeline
from ..errors import InputError
from ..graph import DataflowGraph
from ..ir.graph_builder import build_graph
from ..ir.swap_planning import plan_module_swaps
from ..ir.time_splits import annotate_time_splits
from ..models import Model
from ..partition import PartitionPlan
from ..partition.plan import layouts_of
from ..runtime import distributed
from ..swap.placement import argument_devices

# What the runtime's allocators count: no kernel workspace (scratch inside kernels), no module
# constants (loaded with the module). The plan predicts these for an unplanned build exactly.
MEASURED_KINDS = ("parameter", "state", "input", "activation", "gradient")


@dataclasses.dataclass
class PartitionedBuild:
    """A model compiled for k devices, with what the runtime and a report need."""

    plan: PartitionPlan
    graph: DataflowGraph  # the unpartitioned graph the plan is of
    layout: dict  # mesh, per argument and output its shape, dtype and layout
    fallbacks: list[dict]
    unrestricted: dict  # the partitioner's plan summary without the lowering's restrictions
    worker_graph: DataflowGraph  # the code each device runs, as a graph
    executable: relax.VMExecutable | None = None
    swap_plan: object = None  # a SwapPlan per device, with a device budget
    memory_planning: bool = True

    @property
    def predicted_peak(self) -> int:
        """Bytes per device the plan predicts the allocators see (an unplanned build)."""
        return self.plan.peak_memory(self.graph, MEASURED_KINDS)

    @property
    def arg_devices(self) -> list[int] | None:
        """Per argument 0 (device) or 1 (host) of a swapped build, else None."""
        if self.swap_plan is None:
            return None
        return argument_devices(self.worker_graph, self.swap_plan)

    def sidecar(self) -> dict:
        """What a deployment needs beside the exported module: the layouts, the plan."""
        return {"layout": self.layout, "arg_devices": self.arg_devices,
                "plan": self.plan.to_dict(), "fallbacks": self.fallbacks}


def build_partitioned(
    model: Model,
    target: tvm.target.Target,
    num_devices: int,
    *,
    hardware: str = "h100",
    strategy: str = "tofu",
    link: str = "nvlink",
    plan: PartitionPlan | str | None = None,
    device_memory: int | str | None = None,
    swap_options: dict | None = None,
    memory_planning: bool = True,
    compile: bool = True,
    **pipeline_options,
) -> PartitionedBuild:
    """Plan (or take `plan`), partition, optionally plan swaps per device under
    `device_memory`, and compile with the tvm_ext pipeline."""
    if isinstance(plan, str):
        plan = PartitionPlan.from_json(plan)
    if plan is not None and plan.num_devices != num_devices:
        raise PartitionError(f"the plan partitions over {plan.num_devices} devices, "
                             f"not {num_devices}")
    fused = pipeline.fuse(model.mod, target, fused_attention=False)
    partition = PartitionOperators(num_devices, plan=plan, hardware=hardware,
                                   strategy=strategy, link=link)
    with target:
        plan, fallbacks, unrestricted = partition.plan_module(fused)
        part = PartitionOperators(num_devices, plan=plan, hardware=hardware)(fused)
    graph = build_graph(fused)
    worker_mod = relax.transform.RewriteDataflowReshape()(part)
    worker_graph = annotate_time_splits(worker_mod, build_graph(worker_mod))
    swap_plan = None
    if device_memory is not None:
        options = {"hardware": hardware, **(swap_options or {})}
        reserved = pipeline.library_reserved_bytes(target, pipeline_options.get("library", True))
        # Each worker's code, partitioned already: its kernels are not fissioned.
        swap_plan = plan_module_swaps(worker_mod, device_memory, target=str(target.kind.name),
                                      reserved=reserved, fission=False, graph=worker_graph,
                                      **options).plan
    build = PartitionedBuild(plan, graph, layouts_of(plan, graph), fallbacks, unrestricted,
                             worker_graph, swap_plan=swap_plan, memory_planning=memory_planning)
    if compile:
        # `part` is already partitioned: the pipeline goes on from its swap phase.
        # No CUDA graphs: the collectives run outside the VM's stream.
        if pipeline_options.get("cuda_graph"):
            raise InputError("cuda_graph=True does nothing here: a partitioned module's "
                             "collectives run outside the VM's stream")
        compile_pipeline = relax.get_pipeline("tvm_ext", target=target, start_phase="swap",
                                              swap_plan=swap_plan,
                                              memory_planning=memory_planning,
                                              **{**pipeline_options, "cuda_graph": False})
        with target:
            build.executable = tvm.compile(part, target, relax_pipeline=compile_pipeline)
    return build


def run_partitioned_build(
    session: distributed.Session,
    build: PartitionedBuild,
    arguments: Sequence[np.ndarray],
    repeat: int = 0,
) -> distributed.DistributedRunResult:
    """Load the build on the session's workers, place the arguments' pieces, run, gather."""
    swapped = build.swap_plan is not None
    module = session.load_module(build.executable, separate_host=swapped)
    return distributed.run_partitioned(session, module, arguments, build.layout, repeat=repeat,
                                       arg_devices=build.arg_devices)
