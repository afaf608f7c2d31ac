"""CaptureKernelGraphs: runs of static kernels replayed as CUDA graphs.

Where they are used is read from the IR of CUDA builds (compiled here, nothing runs). What a
replay computes is checked on the CPU: the runtime library's builtin replays a region there by
running it again on the arguments it was captured with, as a graph replays its kernels on the
captured addresses, so a rewrite that relied on anything else would give other results."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_ext import driver, pipeline
from tvm_ext.errors import InputError
from tvm_ext.ir.kernel_graphs import BUILTIN, graph_coverage
from tvm_ext.models import get_model
from tvm_ext.models.mixed_precision import LossScaler, low_precision_step
from tvm_ext.models.optimizer import Optimizer, make_optimizer_step
from tvm_ext.passes import PartitionOperators
from tvm_ext.pipeline import finalize_passes, kernel_graphs_refusal, run_phases
from tvm_ext.runtime.kernel_graphs import graph_stats, reset_graph_stats


def _finalized(model, target, **options) -> tvm.IRModule:
    return run_phases(model.mod, target, through="finalize", inclusive=True, **options)


def test_cuda_builds_capture_their_static_kernels(zoo_cache, cuda_target):
    gpt = _finalized(zoo_cache("gpt"), cuda_target)
    cov = graph_coverage(gpt)
    # Outside: the embedding lookup reads the token ids, the head writes the output.
    assert cov.regions == 1 and cov.uncaptured == 2 and cov.captured > 30
    assert BUILTIN in gpt["main"].script()
    step = make_optimizer_step(zoo_cache("gpt", True), Optimizer("adamw"))
    cov = graph_coverage(_finalized(step, cuda_target))
    assert cov.regions >= 1 and cov.captured > 10 * cov.uncaptured


def test_where_graphs_do_not_apply(zoo_cache, cuda_target, llvm):
    model = zoo_cache("mlp")
    off = graph_coverage(_finalized(model, cuda_target, cuda_graph=False))
    assert off.regions == 0 and off.captured == 0
    # The unswapped twin a swapped build is compared with keeps one launch per kernel.
    assert graph_coverage(_finalized(model, cuda_target, budgeted=True)).regions == 0
    assert "swapped" in kernel_graphs_refusal(cuda_target, swapped=True)
    assert "partitioned" in kernel_graphs_refusal(cuda_target, partitioned=True)
    with pytest.raises(InputError, match="CUDA target, not llvm"):
        driver.build(model, llvm, cuda_graph=True)
    with pytest.raises(InputError, match="swapped module"):
        driver.build(model, cuda_target, cuda_graph=True, device_memory="50%")


def test_partitioned_builds_keep_one_launch_per_kernel(zoo_cache, cuda_target):
    """A partitioned worker's code is compiled from its swap phase on, without the options
    that say it is partitioned: its collectives stay outside graphs all the same."""
    built = driver.build_partitioned(zoo_cache("mlp", True), cuda_target, 2)
    text = built.executable.as_text()
    assert "runtime.disco.allreduce" in text and "cuda_graph" not in text
    with pytest.raises(InputError, match="partitioned module's collectives"):
        driver.build_partitioned(zoo_cache("mlp"), cuda_target, 2, cuda_graph=True)
    # The pass itself leaves a function PartitionOperators rewrote alone.
    fused = pipeline.fuse(zoo_cache("mlp", True).mod, cuda_target, fused_attention=False)
    with cuda_target:
        part = PartitionOperators(2, hardware="h100")(fused)
        lowered = run_phases(part, cuda_target, through="dataflow_lower", inclusive=True)
        out = tvm.transform.Sequential(finalize_passes(cuda_target, cuda_graph=True))(lowered)
    cov = graph_coverage(out)
    assert cov.regions == 0 and cov.uncaptured > 10


def _with_graphs(model, target, regions: int = 1) -> relax.VMExecutable:
    """`model` built for the CPU with its kernels in graphs (at least `regions`), as a CUDA
    build would be."""
    mod = run_phases(model.mod, target, through="dataflow_lower", inclusive=True)
    with target:
        mod = tvm.transform.Sequential(finalize_passes(target, cuda_graph=True))(mod)
        assert graph_coverage(mod).regions >= regions
        return tvm.compile(mod, target, relax_pipeline=tvm.transform.Sequential([]))


def _stats() -> tuple[int, int, int, int]:
    """(captures, replays, recaptures, direct) since the last reset."""
    return tuple(graph_stats().values())


def test_replays_compute_what_the_module_does(zoo_cache, llvm):
    model = zoo_cache("gpt")
    dev = tvm.cpu()
    graphs = relax.VirtualMachine(_with_graphs(model, llvm), dev)
    plain = relax.VirtualMachine(driver.build(model, llvm), dev)
    weights = [tvm.runtime.tensor(p, dev) for p in model.random_params(0)]
    reset_graph_stats()
    for seed in range(3):  # new inputs: the kernels reading them run outside the graph
        inputs = [tvm.runtime.tensor(a, dev) for a in model.random_inputs(seed)]
        got = graphs["main"](*inputs, *weights).numpy()
        np.testing.assert_array_equal(got, plain["main"](*inputs, *weights).numpy())
    assert _stats() == (1, 2, 0, 0)
    # New weight tensors: the region is captured again, not replayed on the old ones; moved
    # on a third call, it runs without a graph from then on.
    expected_stats = [(2, 2, 1, 0), (3, 2, 2, 0), (3, 2, 3, 1), (3, 2, 3, 1)]
    for seed, stats in zip((1, 2, 3, 3), expected_stats, strict=True):
        weights = [tvm.runtime.tensor(p, dev) for p in model.random_params(seed)]
        got = graphs["main"](*inputs, *weights).numpy()
        np.testing.assert_array_equal(got, plain["main"](*inputs, *weights).numpy())
        assert _stats() == stats


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_optimizer_steps_replay_their_updates(dtype, llvm):
    """An AdamW step in place (mixed precision in bf16; in fp16 with dynamic loss scaling, its
    scale and skip decisions on the device): parameters and state after three steps are those
    of the build without graphs, bit for bit."""
    step = get_model("gpt", "tiny", training=True, loss_scale=dtype == "fp16")
    if dtype != "fp32":
        step = low_precision_step(step, dtype)
    step = make_optimizer_step(step, Optimizer("adamw"),
                               LossScaler() if dtype == "fp16" else None)
    dev = tvm.cpu()
    sessions = [driver.TrainingSession(build, step, dev, seed=0)
                for build in (_with_graphs(step, llvm), driver.build(step, llvm))]
    batches = [step.random_inputs(seed) for seed in range(3)]
    reset_graph_stats()
    for batch in batches:
        losses = [s.step(batch).loss for s in sessions]
        assert losses[0] == losses[1]
    for a, b in zip(sessions[0].parameters() + sessions[0].state(),
                    sessions[1].parameters() + sessions[1].state(), strict=True):
        np.testing.assert_array_equal(a, b)
    captures, replays, recaptures, _ = _stats()
    assert captures >= 1 and replays == 2 * captures and recaptures == 0


def test_steps_with_several_regions(llvm):
    """BERT's AdamW step: its padding mask and labels are inputs, read between the layers'
    kernels, so the step runs as several graphs with kernels between them; three steps give the
    bits of the build without graphs."""
    pytest.importorskip("transformers")
    import corpus
    import torch

    from tvm_ext.models.base import make_training_step, model_from_function
    from tvm_ext.models.torch_import import import_exported_program

    module, inputs = corpus.BY_NAME["bert_sdpa"].build()
    with torch.no_grad():
        program = torch.export.export(module, inputs)
    mod, _ = relax.frontend.detach_params(import_exported_program(program)[0])
    model = model_from_function("bert", mod["main"], int(mod["main"].attrs["num_input"]))
    step = make_optimizer_step(make_training_step(model, loss="mse"), Optimizer("adamw"))
    graphs = _with_graphs(step, llvm, regions=5)
    dev = tvm.cpu()
    sessions = [driver.TrainingSession(build, step, dev, seed=0)
                for build in (graphs, driver.build(step, llvm))]
    for seed in range(3):
        batch = step.random_inputs(seed)
        assert sessions[0].step(batch).loss == sessions[1].step(batch).loss
    for a, b in zip(sessions[0].parameters(), sessions[1].parameters(), strict=True):
        np.testing.assert_array_equal(a, b)
