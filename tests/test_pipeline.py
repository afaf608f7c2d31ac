"""The registered "tvm_ext" pipeline: phases, dumps, and equivalence to a plain TVM build."""

from __future__ import annotations

import os

import pytest
import tvm
from tvm import relax

from tvm_ext import driver, pipeline


def test_registered_and_needs_a_target(zoo_cache):
    p = relax.get_pipeline("tvm_ext")
    with pytest.raises(Exception, match="needs a target"):
        p(zoo_cache("mlp").mod)


def test_phase_dumps(zoo_cache, llvm, tmp_path):
    driver.build(zoo_cache("mlp"), llvm, dump_dir=str(tmp_path))
    names = sorted(os.listdir(tmp_path))
    expected = ["00_input.py"] + [f"{i + 1:02d}_{name}.py"
                                  for i, (name, _) in enumerate(pipeline.phases(llvm))]
    assert names == sorted(expected)
    assert "fused_" in (tmp_path / "02_legalize.py").read_text()


def test_targets_get_default_schedules():
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    assert pipeline.is_gpu(cuda) and pipeline.schedule_passes(cuda)
    cpu = pipeline.schedule_passes(tvm.target.Target("llvm"))
    assert [type(p).__name__ for p in cpu] == ["ApplyDefaultCPUSchedules"]


# In the sweep: every test_corpus cell compares our build with the plain TVM build of the same
# model (test_dispatch_library too, for convolution steps); every line these cover is covered.
@pytest.mark.sweep
@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_matches_plain_tvm_build(name, zoo_cache, llvm):
    model = zoo_cache(name, training=True)
    args = model.random_arguments(0)
    ours = driver.run(driver.build(model, llvm), args, tvm.cpu(), repeat=0)
    ref = driver.run(driver.build_reference(model, llvm), args, tvm.cpu(), repeat=0)
    driver.compare(ours.outputs, ref.outputs, rtol=1e-5, atol=1e-6)
