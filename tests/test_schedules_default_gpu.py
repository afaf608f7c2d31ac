"""Default GPU schedules for every kernel of the zoo's training graphs and optimizer steps
(CUDA code generation runs here with nvcc; nothing runs on a GPU): every kernel spread over GPU
threads, and every schedule computing what its kernel computes (run on the CPU by
tests/gpu_emulation.py)."""

from __future__ import annotations

import warnings

import pytest
import tvm
from gpu_emulation import differing
from tvm import relax, tirx

from tvm_ext import driver
from tvm_ext import pipeline as P
from tvm_ext.ir.pass_records import LIBRARY_ATTR
from tvm_ext.models.optimizer import Optimizer, make_optimizer_step
from tvm_ext.schedules.default_gpu import MAX_SERIAL_ITERATIONS, ApplyDefaultGPUSchedules
from tvm_ext.schedules.thread_work import kernel_thread_work


def _fused(model, target):
    with target:
        return tvm.transform.Sequential(
            P.library_dispatch_passes(target) + P.legalize_passes(target))(model.mod)


def _copy(mod: tvm.IRModule) -> tvm.IRModule:
    return tvm.IRModule({gv: f for gv, f in mod.functions_items()})


def test_every_kernel_gets_a_thread_binding(zoo_cache, cuda_target):
    """GEMV raises on the loss gradient; the embedding gradient (take_backward) is plain loop
    nests no dlight rule reads: every kernel still ends spread over GPU threads, within the
    bound of serial iterations per thread, with no warning."""
    target = cuda_target
    scheduler = ApplyDefaultGPUSchedules()
    with target, warnings.catch_warnings():
        warnings.simplefilter("error")
        mod = scheduler(_fused(zoo_cache("gpt", training=True), target))
    assert scheduler.slow_kernels == []
    for gv, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc):
            assert int(func.attrs["tirx.is_scheduled"]) == 1, gv.name_hint
            assert "threadIdx.x" in func.script(), gv.name_hint
    assert kernel_thread_work(mod)[0].iterations <= MAX_SERIAL_ITERATIONS


def test_a_kernel_left_on_one_thread_is_reported(cuda_target):
    """With no rule that fits, the serial fallback runs and says so, with its figure."""
    step = _fused(_mean_model((4, 64, 1000)), cuda_target)
    scheduler = ApplyDefaultGPUSchedules(rules=[])
    with cuda_target, pytest.warns(UserWarning, match=r"mean \(2\.56e\+05\)"):
        scheduler(step)
    assert [name for name, _ in scheduler.slow_kernels] == ["mean"]


def _mean_model(shape):
    from tvm_ext.models.base import model_from_function

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.mean(x))
        bb.emit_func_output(out)
    return model_from_function("mean", bb.get()["main"], 1)


@pytest.mark.parametrize("name", ["mlp_adamw", "gpt_embedding", "mean"])
def test_every_default_schedule_computes_its_kernel(name, zoo_cache, cuda_target):
    """Each kernel's GPU schedule, its thread loops run in order on the CPU, leaves every
    buffer as the unscheduled kernel does: every kernel of an AdamW step (dlight's rules and
    the in-place updates, scheduled out of place and put back), the embedding gradient's
    atomic scatter-add, and a loss over a whole batch in two stages."""
    if name == "mlp_adamw":
        model = make_optimizer_step(zoo_cache("mlp", training=True), Optimizer("adamw"))
    elif name == "gpt_embedding":
        model = zoo_cache("gpt", training=True)
    else:
        model = _mean_model((4, 64, 1000))
    unscheduled = P.run_phases(model.mod, cuda_target, through="library_kernels",
                               inclusive=True)
    with cuda_target:
        scheduled = ApplyDefaultGPUSchedules()(_copy(unscheduled))
    names = [gv.name_hint for gv, f in unscheduled.functions_items()
             if isinstance(f, tirx.PrimFunc) and LIBRARY_ATTR not in (f.attrs or {})
             and (name != "gpt_embedding" or gv.name_hint.startswith("take_backward"))]
    assert len(names) >= {"mlp_adamw": 10, "gpt_embedding": 2, "mean": 1}[name]
    assert differing(unscheduled, scheduled, names) == []


@pytest.mark.parametrize("kind, dtype", [("sgd", "fp32"), ("momentum", "fp32"),
                                         ("adam", "fp32"), ("adamw", "fp32"),
                                         ("adamw", "bf16"), ("adamw", "fp16")])
def test_optimizer_steps_get_gpu_threads(kind, dtype, zoo_cache, cuda_target):
    """Every optimizer's in-place update kernels get GPU threads, in every precision (the
    CUDA build of one follows)."""
    from tvm_ext.models import get_model
    from tvm_ext.models.mixed_precision import low_precision_step

    step = zoo_cache("mlp", training=True) if dtype != "fp16" else \
        get_model("mlp", training=True, loss_scale=True)
    step = low_precision_step(step, dtype)
    momentum = {"momentum": 0.9} if kind == "momentum" else {}
    step = make_optimizer_step(step, Optimizer(kind, **momentum))
    scheduler = ApplyDefaultGPUSchedules()
    with cuda_target:
        mod = scheduler(P.run_phases(step.mod, cuda_target, through="library_kernels",
                                     inclusive=True))
    assert scheduler.slow_kernels == []
    updates = [f for gv, f in mod.functions_items() if gv.name_hint.endswith("_inplace")]
    assert updates and all("threadIdx.x" in f.script() for f in updates)


def test_an_optimizer_step_compiles_for_cuda(tmp_path, cuda_target):
    from tvm_ext import cli

    out = tmp_path / "step.so"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="no default GPU schedule")
        assert cli.main(["mlp", "--training", "--optimizer", "adamw", "--dtype", "fp16",
                         "--target", "cuda", "--output", str(out)]) == 0
    assert b".nv.info" in out.read_bytes()


@pytest.mark.parametrize("plan", [["--device-memory", "50%"], ["--devices", "2"]])
def test_swapped_and_partitioned_optimizer_steps_compile_for_cuda(plan, tmp_path, cuda_target):
    from tvm_ext import cli

    out = tmp_path / "step.so"
    assert cli.main(["mlp", "--training", "--optimizer", "adamw", "--target", "cuda",
                     "--output", str(out), *plan]) == 0
    assert out.exists()


@pytest.mark.parametrize("name", ["mlp", "resnet"])
def test_training_graphs_compile_for_cuda(name, zoo_cache, tmp_path, cuda_target):
    target = cuda_target
    ex = driver.build(zoo_cache(name, training=True), target)
    path = driver.export(ex, str(tmp_path / f"{name}.so"))
    data = open(path, "rb").read()
    assert b".nv.info" in data  # a cubin, not CUDA source


def test_cuda_kernels_compile_without_fast_math(monkeypatch, cuda_target):
    """nvcc's --use_fast_math (TVM's default) turns powf into exp2(y * log2(x)): NaN for a
    negative base, which GPT-2's GELU (x ** 3) and Llama's RMSNorm (x ** 2) take. tvm_ext builds
    CUDA kernels with IEEE math, as PyTorch's are."""
    import subprocess

    from tvm import relax

    from tvm_ext.models.base import model_from_function

    monkeypatch.delenv("TVM_CUDA_NVCC_NO_FAST_MATH", raising=False)
    # Resolved again after the variable is gone: resolving the target is what sets it.
    target = driver.resolve_target(str(cuda_target.kind.name))
    commands = []
    real = subprocess.Popen

    def record(cmd, *args, **kwargs):
        commands.append(list(cmd))
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", record)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 64), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.power(x, relax.const(3.0, "float32")))
        bb.emit_func_output(y)
    driver.build(model_from_function("cube", bb.get()["main"], 1), target)
    nvcc = [c for c in commands if c and c[0].endswith("nvcc")]
    assert nvcc, commands
    assert all("--use_fast_math" not in c for c in nvcc), nvcc


def test_a_library_gemms_epilogue_is_one_loop_nest(cuda_target):
    """A GEMM with a bias and GPT-2's GELU written out (pow, tanh, adds and products): cuBLAS's
    product, then the whole epilogue in one loop nest over GPU threads (one pass over the
    product), not a GPU kernel and a round trip through global memory per stage."""
    import tvm_ffi
    from tvm import relax, s_tir

    from tvm_ext.ir.pass_records import LIBRARY_ATTR, LIBRARY_BLOCK_PREFIX
    from tvm_ext.models.base import model_from_function

    def const(v):
        return relax.const(v, "float32")

    op = relax.op
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64, 128), "float32"))
    w = relax.Var("w", relax.TensorType((128, 256), "float32"))
    b = relax.Var("b", relax.TensorType((256,), "float32"))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            h = bb.emit(op.add(op.matmul(x, w), b))
            inner = bb.emit(op.multiply(const(0.7978845608), op.add(
                h, op.multiply(const(0.044715), op.power(h, const(3.0))))))
            y = bb.emit_output(op.multiply(op.multiply(const(0.5), h),
                                           op.add(const(1.0), op.tanh(inner))))
        bb.emit_func_output(y)
    model = model_from_function("gemm_gelu", bb.get()["main"], 1)
    scheduled = P.scheduled_module(model.mod, cuda_target, None)
    library = [f for f in scheduled.functions.values()
               if isinstance(f, tirx.PrimFunc) and LIBRARY_ATTR in (f.attrs or {})]
    assert len(library) == 1, "matmul, bias and GELU fuse into one kernel"
    blocks: list = []
    tvm_ffi.structural_walk(library[0].body, [(s_tir.SBlock, blocks.append)])
    names = [bl.name_hint for bl in blocks]
    assert sum(n.startswith(LIBRARY_BLOCK_PREFIX) for n in names) == 1, names
    rest = [n for n in names if n != "root" and not n.startswith(LIBRARY_BLOCK_PREFIX)]
    assert len(rest) == 1, rest
    driver.build(model, cuda_target)


def test_a_kernel_that_launches_its_own_threads_is_left_as_written():
    """TVM's GPU sort (what DispatchSortScan makes of a mixture of experts' token sort)
    launches its threads itself without the scheduled mark: rescheduling it as an in-place
    kernel failed the whole build."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64,), "int64"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.argsort(x))
        bb.emit_func_output(out)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    with target:
        mod = tvm.transform.Sequential(P.library_dispatch_passes(target))(bb.get())
        (name,) = [gv.name_hint for gv, f in mod.functions_items()
                   if isinstance(f, tirx.PrimFunc)]
        assert "tirx.is_scheduled" not in (mod[name].attrs or {})
        scheduled = ApplyDefaultGPUSchedules()(mod)
    tvm.ir.assert_structural_equal(scheduled[name], mod[name])


def test_the_cuda_target_says_its_shared_memory_per_block(cuda_target):
    """dlight's rules read the shared memory a block may use from the target, and log a
    warning at every kernel of a target without it (R(2+1)D's convolutions printed five)."""
    import logging

    from tvm.s_tir.dlight.analysis.common_analysis import get_max_shared_memory_per_block

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger().addHandler(handler)
    try:
        assert get_max_shared_memory_per_block(cuda_target) == 48 * 1024
    finally:
        logging.getLogger().removeHandler(handler)
    assert not [r for r in records if "max_shared_memory_per_block" in r.getMessage()]
