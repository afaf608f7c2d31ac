"""ApplyTuningDatabase in the pipeline's schedule phase: records where there are some, TVM's
default schedules for the other kernels, nothing at all without a database."""

import os

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_ext import driver, pipeline, schedules
from tvm_ext.models import get_model


def _scheduled(mod: tvm.IRModule) -> dict[str, bool]:
    return {gv.name_hint: bool(f.attrs.get("tirx.is_scheduled", False))
            for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}


@pytest.fixture(scope="module")
def partly_tuned(tmp_path_factory):
    """mlp tiny on llvm with ONE of its kernels tuned (2 trials)."""
    model = get_model("mlp", "tiny")
    target = driver.resolve_target("llvm")
    work_dir = str(tmp_path_factory.mktemp("apply") / "db")
    staged = pipeline.module_at_schedule_phase(model.mod, target)
    tasks = schedules.extract_tasks(staged, target)
    matmul = max(tasks, key=lambda t: t.flops)
    schedules.tune_tasks([matmul], target, work_dir, 2, trials_per_iter=2, log=lambda s: None)
    return model, target, work_dir, staged, matmul.name


def test_untuned_kernels_keep_the_default_lowering(partly_tuned):
    model, target, work_dir, staged, tuned_name = partly_tuned
    scheduled = _scheduled(pipeline.scheduled_module(model.mod, target, work_dir))
    assert scheduled.pop(tuned_name) is True
    assert scheduled and not any(scheduled.values())  # the fallback: TVM's plain lowering
    tuned, default = schedules.coverage(staged, target, work_dir)
    assert tuned == [tuned_name] and sorted(default) == sorted(scheduled)
    # The mixed build computes what the untuned one does.
    args = model.random_arguments(0)
    ref = driver.run(driver.build(model, target), args, tvm.cpu(), repeat=0)
    out = driver.run(driver.build(model, target, tune_db=work_dir), args, tvm.cpu(),
                       repeat=0)
    for a, b in zip(out.outputs, ref.outputs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_kernel_times_are_keyed_like_the_dataflow_graph(partly_tuned):
    model, target, work_dir, staged, tuned_name = partly_tuned
    times = schedules.kernel_times(staged, target, work_dir)
    assert list(times) == [tuned_name] and times[tuned_name] > 0
    graph = driver.fused_graph(model, target)
    assert tuned_name in {op.kernel for op in graph.ops}


def test_records_of_another_target_are_not_applied(partly_tuned):
    model, _, work_dir, _, _ = partly_tuned
    other = tvm.target.Target({"kind": "llvm", "mcpu": "x86-64"})
    assert not any(_scheduled(pipeline.scheduled_module(model.mod, other, work_dir)).values())


def test_a_missing_database_applies_nothing_and_creates_nothing(tmp_path):
    model = get_model("mlp", "tiny")
    target = driver.resolve_target("llvm")
    work_dir = str(tmp_path / "none")
    compile_pipeline = relax.get_pipeline("tvm_ext", target=target, tune_db=work_dir)
    with target:
        staged = pipeline.module_at_schedule_phase(model.mod, target)
        after = schedules.ApplyTuningDatabase(work_dir)(staged)
        tvm.compile(model.mod, target, relax_pipeline=compile_pipeline)
    tvm.ir.assert_structural_equal(after, staged)
    assert not os.path.exists(work_dir)


def test_run_phases_rejects_an_unknown_phase():
    with pytest.raises(ValueError, match="no phase 'quantize'"):
        pipeline.run_phases(get_model("mlp", "tiny").mod, driver.resolve_target("llvm"),
                             through="quantize")
