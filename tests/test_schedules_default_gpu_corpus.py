"""Every kernel of every corpus model, at the size people run it, gets a parallel GPU schedule.

Each model of tests/corpus at its real size (`corpus.REAL`: hidden 768 and a 50k vocabulary for
the language models, 224 x 224 images, one layer) goes through the tvm_ext pipeline for CUDA up
to the schedule phase, inference and training step (loss, gradients and AdamW's in-place
updates); every kernel's serial iterations per GPU thread are read from its scheduled TIR
(schedules/thread_work.py) and must stay within `MAX_SERIAL_ITERATIONS`: a kernel left on one
thread, or a reduction left serial inside each thread, fails here. No code is generated (nvcc is
not needed): what is checked is the schedule. Each model is its own test, so that pytest-xdist's
workers share the models out.
"""

from __future__ import annotations

import warnings

import corpus
import pytest

from tvm_ext.schedules.default_gpu import MAX_SERIAL_ITERATIONS


def _slow_kernels(name: str) -> dict[str, list[tuple[str, float]]]:
    """{mode: [(kernel, serial iterations per thread)] over the bound} of one model."""
    import torch
    from tvm import relax

    from tvm_ext import driver, pipeline
    from tvm_ext.models.base import make_training_step, model_from_function
    from tvm_ext.models.optimizer import Optimizer, make_optimizer_step
    from tvm_ext.models.torch_import import import_exported_program

    module, inputs = corpus.REAL[name]()
    with torch.no_grad():
        program = torch.export.export(module, inputs)
    mod, _ = relax.frontend.detach_params(import_exported_program(program)[0])
    model = model_from_function(name, mod["main"], int(mod["main"].attrs["num_input"]))
    modes = {"inference": model}
    if corpus.BY_NAME[name].training:
        modes["training"] = make_optimizer_step(make_training_step(model, loss="mse"),
                                                Optimizer("adamw"))
    target = driver.resolve_target("cuda")
    out = {}
    for mode, m in modes.items():
        staged = pipeline.run_phases(m.mod, target, through="library_kernels", inclusive=True)
        out[mode] = [(name, work) for name, work in _kernel_work(staged, target)
                     if work > MAX_SERIAL_ITERATIONS]
    return out


_SCHEDULED: dict = {}  # structural hash of an unscheduled kernel -> its serial iterations


def _kernel_work(staged, target) -> list[tuple[str, float]]:
    """(kernel, serial iterations per thread) of every kernel of `staged` once scheduled;
    kernels the worker has scheduled before (the same layer norm in another model) are not
    scheduled again."""
    import tvm
    import tvm_ffi
    from tvm import tirx

    from tvm_ext.schedules.default_gpu import ApplyDefaultGPUSchedules
    from tvm_ext.schedules.thread_work import serial_iterations

    out = []
    for gv, func in staged.functions_items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        key = tvm_ffi.structural_hash(func)
        if key not in _SCHEDULED:
            with target:
                mod = ApplyDefaultGPUSchedules()(tvm.IRModule({gv: func}))
            _SCHEDULED[key] = serial_iterations(mod[gv]).iterations
        out.append((gv.name_hint, _SCHEDULED[key]))
    return out


@pytest.fixture(scope="module")
def cuda_target_module():
    import shutil

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH: the CUDA target cannot be set up here")


@pytest.mark.parametrize("name", list(corpus.REAL))
def test_no_kernel_leaves_a_gpu_thread_long_serial_work(name, cuda_target_module):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        slow = _slow_kernels(name)
    assert slow == {mode: [] for mode in slow}
    assert "inference" in slow
