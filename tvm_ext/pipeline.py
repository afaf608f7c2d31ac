"""The tvm_ext compilation pipeline, registered as `relax.get_pipeline("tvm_ext", ...)`.

Phases, in order (each a list of passes, so a caller can rebuild the pipeline from parts):

1. `library_dispatch_passes`  target-specific library dispatch (sort, sampling; bfloat16
                              sorts, argmax and isnan on float32 values:
                              Bfloat16InFloat32); on GPU
                              targets FuseAttention (tvm_ext.passes): each attention one
                              fused kernel and its backward two (not with a partition,
                              whose analysis reads the unfused operators; an attention
                              whose backward stays unfused only under a device budget).
2. `legalize_passes`          LegalizeOps, StaticKernelCalls (a generic kernel, TVM's GPU
                              scan, copied per call shape; builtin reshapes as views),
                              AnnotateTIROpPattern, FuseKernels (FoldConstant,
                              GroupAccumulations: each product of a sum of products
                              fused with its add, FuseOps, FuseTIR; without FoldConstant
                              where TVM's fusion fails on what it folded),
                              BroadcastConstants (constants at their distinct extent),
                              DropUnreadKernelInputs (arguments a kernel never reads),
                              PlaceUpdatesAfterReaders (an optimizer step's updates after
                              the readers of what they overwrite, wherever fusion put
                              those readers): `fuse` adds RewriteDataflowReshape: the
                              module the graph of every planner is read from
                              (`tvm_ext.ir.graph_builder`).
3. `partition_passes`         with `num_devices`: PartitionOperators (tvm_ext.passes) plans a
                              Tofu partition and rewrites `main` into the code each of the k
                              devices runs, with explicit collectives (before scheduling, so
                              kernels are tuned at the shapes each device runs).
4. `swap_passes`              with a device budget: SwapOffload (tvm_ext.passes) plans swaps
                              and rewrites `main` into explicit pools, copies and waits (per
                              device after partitioning). It reads the module as the
                              graph builder does, so it runs before the kernels are
                              scheduled (scheduling changes their scratch buffers).
5. `in_place_passes`          UpdateArgumentsInPlace: the kernels of an optimizer step
                              (tvm_ext.models.optimizer) write the new parameters and state
                              into the arguments' buffers (after planning, which reads the
                              step as pure data flow; before scheduling, which keeps the
                              in-place kernels' order).
6. `library_kernels_passes`   with `library` (the default): GEMM and convolution loop nests
                              of every kernel call the vendor library through the runtime
                              library (DispatchLibraryKernels: OpenBLAS on CPU, cuBLAS on
                              CUDA), after planning, so the planners read the kernels' TIR
                              and a partitioned kernel's chunk dispatches too.
7. `schedule_passes`          kernels tuned with MetaSchedule (records of a `tune_db` work dir,
                              see tvm_ext.schedules), then default schedules (dlight on GPU,
                              `ApplyDefaultCPUSchedules` on CPU) for kernels without one.
8. `dataflow_lower_passes`    RewriteDataflowReshape, ToNonDataflow, RemovePurityChecking,
                              CallTIRRewrite, ReturnLossOnly (an optimizer step returns its
                              loss; the rest is in its arguments).
9. `finalize_passes`          memory planning; on CUDA, CaptureKernelGraphs (tvm_ext.passes):
                              each run of static kernels one CUDA graph (not in swapped,
                              partitioned or budgeted builds, see `kernel_graphs_refusal`);
                              builtin lowering, VM shape lowering.

With `dump_dir`, the module is written after each phase as `NN_<phase>.py` (TVMScript).
"""

from __future__ import annotations

import os

import tvm
from tvm import relax

from tvm_ext.partition import PartitionPlan
from tvm_ext.passes import (
    Bfloat16InFloat32,
    BroadcastConstants,
    CaptureKernelGraphs,
    DispatchLibraryKernels,
    DropUnreadKernelInputs,
    FuseAttention,
    FuseKernels,
    PartitionOperators,
    PlaceUpdatesAfterReaders,
    ReturnLossOnly,
    StaticKernelCalls,
    SwapOffload,
    UpdateArgumentsInPlace,
)
from tvm_ext.schedules import (
    ApplyDefaultCPUSchedules,
    ApplyDefaultGPUSchedules,
    ApplyTuningDatabase,
)

from . import interrupts
from .errors import InputError
from .ir.targets import is_cpu, is_gpu
from .runtime.blas import cublas_workspace_bytes, cudnn_workspace_bytes

SCHEDULE_PHASE = "schedule"


def library_dispatch_passes(target: tvm.target.Target, fused_attention: bool = True,
                            budgeted: bool = True) -> list:
    """`fused_attention`: on a GPU target, each attention one fused kernel and its backward
    two (FuseAttention); `budgeted` (a device budget: memory is short), also the attentions
    of a training step whose backward stays unfused, their probabilities then made again for
    it."""
    fuse = [FuseAttention(target, recompute_for_backward=budgeted)] \
        if fused_attention and is_gpu(target) else []
    return [*fuse, relax.backend.DispatchSampling(), Bfloat16InFloat32(),
            relax.backend.DispatchSortScan()]


def legalize_passes(target: tvm.target.Target) -> list:
    return [
        relax.transform.LegalizeOps(),
        StaticKernelCalls(),
        relax.transform.AnnotateTIROpPattern(),
        FuseKernels(),
        BroadcastConstants(),
        DropUnreadKernelInputs(),
        PlaceUpdatesAfterReaders(),
    ]


def partition_passes(target: tvm.target.Target, num_devices: int | None = None,
                     partition_plan=None, **partition_options) -> list:
    """PartitionOperators over `num_devices` devices (or applying `partition_plan`); nothing
    without either. `partition_options` go to PartitionOperators (hardware, strategy, link,
    topology)."""
    if num_devices is None and partition_plan is None:
        return []
    if isinstance(partition_plan, str):
        partition_plan = PartitionPlan.from_json(partition_plan)
    if num_devices is None:
        num_devices = partition_plan.num_devices
    return [PartitionOperators(num_devices, plan=partition_plan, **partition_options)]


def in_place_passes(target: tvm.target.Target) -> list:
    """The kernels that compute new values of arguments (an optimizer step) write them in
    place; a no-op for any other function."""
    return [UpdateArgumentsInPlace()]


def library_kernels_passes(target: tvm.target.Target, library: bool = True) -> list:
    """DispatchLibraryKernels, unless `library` is False (pure TVM code generation)."""
    return [DispatchLibraryKernels(target)] if library else []


def schedule_passes(target: tvm.target.Target, tune_db: str | None = None) -> list:
    """`tune_db`: a tuning work dir (tvm_ext.schedules); its records are applied first."""
    tuned = []
    if tune_db is not None:
        tuned = [ApplyTuningDatabase(tune_db, target)]
    # Default schedules for the kernels no record scheduled: dlight's rules on GPU
    # (schedules/default_gpu.py), parallel and vectorised loops on CPU (default_cpu.py).
    if is_gpu(target):
        return [*tuned, ApplyDefaultGPUSchedules()]
    if is_cpu(target):
        return [*tuned, ApplyDefaultCPUSchedules()]
    return tuned


def swap_passes(target: tvm.target.Target, device_memory=None, swap_plan=None,
                library: bool = True, **swap_options) -> list:
    """SwapOffload under `device_memory` (bytes, "512MiB", "25%"), or applying `swap_plan`;
    nothing without either. `swap_options` go to SwapOffload (hardware, planner,
    time_budget_s, seed). With `library` on a GPU, an absolute budget leaves cuBLAS and cuDNN
    their workspace."""
    if device_memory is None and swap_plan is None:
        return []
    swap_options.setdefault("reserved_bytes", library_reserved_bytes(target, library))
    return [SwapOffload(device_memory, plan=swap_plan, **swap_options)]


def library_reserved_bytes(target: tvm.target.Target, library: bool = True) -> int:
    """Device memory the vendor libraries hold outside the graph on a GPU: cuBLAS' workspace,
    and the most workspace a cuDNN convolution takes from TVM's pool (OpenBLAS on CPU
    allocates in host memory of its own)."""
    if not (library and is_gpu(target)):
        return 0
    return cublas_workspace_bytes() + cudnn_workspace_bytes()


def dataflow_lower_passes(target: tvm.target.Target) -> list:
    return [
        relax.transform.RewriteDataflowReshape(),
        relax.transform.ToNonDataflow(),
        relax.transform.RemovePurityChecking(),
        relax.transform.CallTIRRewrite(),
        ReturnLossOnly(),
    ]


def kernel_graphs_refusal(target: tvm.target.Target, *, swapped: bool = False,
                          partitioned: bool = False, memory_planning: bool = True) -> str | None:
    """Why a build cannot replay its kernels as CUDA graphs (None: it can)."""
    if target.kind.name != "cuda":
        return f"CUDA graphs need a CUDA target, not {target.kind.name}"
    if swapped:
        return ("a swapped module's copies run on streams of their own and the host waits for "
                "them, which a graph of the VM's stream cannot hold")
    if partitioned:
        return "a partitioned module's collectives run outside the VM's stream"
    if not memory_planning:
        return "without memory planning no intermediate tensor has a fixed address"
    return None


def use_kernel_graphs(target: tvm.target.Target, cuda_graph: bool | None, *, swapped: bool,
                      partitioned: bool, memory_planning: bool, budgeted: bool) -> bool:
    """Whether the build replays its kernels as CUDA graphs: `cuda_graph`, or where None, on
    wherever they apply except in a budgeted build (a swapped build's unswapped twin keeps one
    launch per kernel, as its swapped build does). InputError when True cannot apply."""
    refusal = kernel_graphs_refusal(target, swapped=swapped, partitioned=partitioned,
                                    memory_planning=memory_planning)
    if cuda_graph and refusal:
        raise InputError(f"cuda_graph=True does nothing here: {refusal}")
    return refusal is None and not budgeted if cuda_graph is None else cuda_graph


def finalize_passes(target: tvm.target.Target, memory_planning: bool = True,
                    cuda_graph: bool = False) -> list:
    """`memory_planning=False` skips StaticPlanBlockMemory: every tensor is allocated before its
    kernel and freed after its last use, which `DataflowGraph.peak_memory` predicts exactly.
    `cuda_graph`: CaptureKernelGraphs after the planning (the caller checks it applies)."""
    planning = [relax.transform.StaticPlanBlockMemory()] if memory_planning else []
    graphs = [CaptureKernelGraphs()] if cuda_graph else []
    return [
        *planning,
        *graphs,
        relax.transform.LowerAllocTensor(),
        relax.transform.KillAfterLastUse(),
        relax.transform.LowerRuntimeBuiltin(),
        relax.transform.ComputePrimValue(),
        relax.transform.VMShapeLower(),
        relax.transform.AttachGlobalSymbol(),
    ]


def _dump(dump_dir: str | None, index: int, phase: str, mod: tvm.IRModule) -> None:
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        with open(os.path.join(dump_dir, f"{index:02d}_{phase}.py"), "w") as f:
            f.write(mod.script())


def phases(
    target: tvm.target.Target, *, memory_planning: bool = True, tune_db: str | None = None,
    device_memory=None, swap_plan=None, swap_options: dict | None = None,
    num_devices: int | None = None, partition_plan=None, partition_options: dict | None = None,
    library: bool = True, fused_attention: bool = True, budgeted: bool | None = None,
    cuda_graph: bool | None = None,
) -> list[tuple[str, list]]:
    """The pipeline as (phase name, passes) pairs."""
    partitioned = num_devices is not None or partition_plan is not None
    swapped = device_memory is not None or swap_plan is not None
    if budgeted is None:
        budgeted = swapped
    cuda_graph = use_kernel_graphs(target, cuda_graph, swapped=swapped, partitioned=partitioned,
                                   memory_planning=memory_planning, budgeted=budgeted)
    return [
        ("library_dispatch", library_dispatch_passes(
            target, fused_attention and not partitioned, budgeted)),
        ("legalize", legalize_passes(target)),
        ("partition", partition_passes(target, num_devices, partition_plan,
                                       **(partition_options or {}))),
        ("swap", swap_passes(target, device_memory, swap_plan, library,
                             **(swap_options or {}))),
        ("in_place", in_place_passes(target)),
        ("library_kernels", library_kernels_passes(target, library)),
        (SCHEDULE_PHASE, schedule_passes(target, tune_db)),
        ("dataflow_lower", dataflow_lower_passes(target)),
        ("finalize", finalize_passes(target, memory_planning, cuda_graph)),
    ]


def fuse(mod: tvm.IRModule, target: tvm.target.Target, fused_attention: bool = True,
         budgeted: bool = True) -> tvm.IRModule:
    """The module after the legalize phase, with dataflow reshapes rewritten into views: what
    the partition and swap phases receive and what `tvm_ext.ir.graph_builder` reads
    (`fused_attention=False` for a partition, `budgeted=False` for a build without a device
    budget: see `phases`)."""
    with target:
        passes = library_dispatch_passes(target, fused_attention, budgeted) + \
            legalize_passes(target)
        fused = tvm.transform.Sequential(passes)(mod)
        return relax.transform.RewriteDataflowReshape()(fused)


def run_phases(
    mod: tvm.IRModule,
    target: tvm.target.Target,
    *,
    through: str = SCHEDULE_PHASE,
    inclusive: bool = False,
    **pipeline_options,
) -> tvm.IRModule:
    """Run the phases up to phase `through` (included if `inclusive`); `pipeline_options` are
    those of `phases` (e.g. `tune_db`, `num_devices`)."""
    stages = phases(target, **pipeline_options)
    names = [name for name, _ in stages]
    if through not in names:
        raise ValueError(f"the tvm_ext pipeline has no phase {through!r}; phases: "
                         f"{', '.join(names)}")
    with target:
        for name, passes in stages:
            if name == through and not inclusive:
                break
            mod = tvm.transform.Sequential(passes, name=name)(mod)
            if name == through:
                break
    return mod


def module_at_schedule_phase(
    mod: tvm.IRModule, target: tvm.target.Target, **pipeline_options
) -> tvm.IRModule:
    """The module as the schedule phase receives it: the kernels to tune, at the shapes they
    will be compiled at (each worker's local shapes after partitioning)."""
    return run_phases(mod, target, through=SCHEDULE_PHASE, **pipeline_options)


def scheduled_module(
    mod: tvm.IRModule, target: tvm.target.Target, tune_db: str | None, **pipeline_options
) -> tvm.IRModule:
    """The module right after the schedule phase, with the records of `tune_db` applied."""
    return run_phases(mod, target, through=SCHEDULE_PHASE, inclusive=True, tune_db=tune_db,
                      **pipeline_options)


def _run_stages(mod: tvm.IRModule, stages: list[tuple[str, list]], start_phase: str | None,
                dump_dir: str | None) -> tvm.IRModule:
    """Run `stages` (from `start_phase` on), writing the module after each to `dump_dir`."""
    _dump(dump_dir, 0, "input", mod)
    names = [name for name, _ in stages]
    if start_phase is not None and start_phase not in names:
        raise ValueError(f"the tvm_ext pipeline has no phase {start_phase!r}; phases: "
                         f"{', '.join(names)}")
    first = names.index(start_phase) if start_phase is not None else 0
    for i, (name, passes) in enumerate(stages):
        if i >= first:
            mod = tvm.transform.Sequential(passes, name=name)(mod)
            _dump(dump_dir, i + 1, name, mod)
    return mod


@relax.pipeline.register_pipeline("tvm_ext")
def tvm_ext_pipeline(
    target: tvm.target.Target | str | None = None,
    *,
    memory_planning: bool = True,
    dump_dir: str | None = None,
    tune_db: str | None = None,
    device_memory: int | str | None = None,
    swap_plan=None,
    swap_options: dict | None = None,
    num_devices: int | None = None,
    partition_plan=None,
    partition_options: dict | None = None,
    library: bool = True,
    fused_attention: bool = True,
    budgeted: bool | None = None,
    cuda_graph: bool | None = None,
    start_phase: str | None = None,
    on_finalized=None,
) -> tvm.transform.Pass:
    """The tvm_ext pipeline for `tvm.compile(mod, target, relax_pipeline=...)`.

    Args:
        target: the target (default: the current one; `tvm.compile` sets it).
        memory_planning: run TVM's StaticPlanBlockMemory (see `finalize_passes`).
        dump_dir: write the module after each phase there.
        tune_db: a tuning work dir (`tvm_ext.driver.tune`): its best records schedule the
            kernels they cover; the others keep the default schedules.
        device_memory: a device budget (bytes, "512MiB", or "25%" of the no-swap peak):
            SwapOffload makes `main` run within it.
        swap_plan: a `tvm_ext.swap.SwapPlan` (or its JSON) to apply instead of planning.
        swap_options: more SwapOffload arguments (hardware, planner, time_budget_s, seed).
        num_devices: partition over k devices (PartitionOperators): `main` becomes the code
            every worker of a `tvm_ext.runtime.distributed.Session(k)` runs. With
            `device_memory`, the budget is per device: each worker's code is swapped after
            partitioning.
        partition_plan: a `tvm_ext.partition.PartitionPlan` (or its JSON) to apply.
        partition_options: more PartitionOperators arguments (hardware, strategy, link,
            topology).
        library: GEMMs and convolutions call the vendor library through the runtime
            library (OpenBLAS on CPU, cuBLAS on CUDA); False keeps TVM's generated code.
        fused_attention: on a GPU target, each attention is one fused kernel, its backward
            two (FuseAttention; not with a partition).
        budgeted: fuse as a build under a device budget does (also an attention whose
            backward stays unfused, its probabilities made again for it); None: whether
            `device_memory` or `swap_plan` is given. True without a budget builds the
            unswapped twin a swapped build is compared with, bit for bit.
        cuda_graph: replay each run of static kernels as one CUDA graph (CaptureKernelGraphs);
            None: on CUDA wherever it applies (`kernel_graphs_refusal`) except a budgeted
            build; True where it cannot apply raises InputError. A graph's kernels read the
            weights where they were when it was captured: passed elsewhere, the region is
            captured again, right but with a capture's cost.
        start_phase: skip the phases before this one (for a module that has been through
            them, e.g. one PartitionOperators already rewrote).
        on_finalized: called with the module the pipeline returns (e.g. to count its
            kernel launches: `tvm_ext.ir.kernel_graphs.graph_coverage`).
    """

    options = {"memory_planning": memory_planning, "tune_db": tune_db,
               "device_memory": device_memory, "swap_plan": swap_plan,
               "swap_options": swap_options, "num_devices": num_devices,
               "partition_plan": partition_plan, "partition_options": partition_options,
               "library": library, "fused_attention": fused_attention, "budgeted": budgeted,
               "cuda_graph": cuda_graph}
    if target is not None and cuda_graph:
        phases(tvm.target.Target(target), **options)  # refused before compiling, not in a pass

    @tvm.transform.module_pass(opt_level=0, name="tvm_ext_pipeline")
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        tgt = tvm.target.Target(target) if target is not None else tvm.target.Target.current()
        if tgt is None:
            raise ValueError("the tvm_ext pipeline needs a target: pass target= or compile "
                             "with tvm.compile(mod, target, ...)")
        with tgt:
            mod = _run_stages(mod, phases(tgt, **options), start_phase, dump_dir)
        if on_finalized is not None:
            on_finalized(mod)
        interrupts.enter("codegen")  # what tvm.compile does after the pipeline
        return mod

    return _pipeline
