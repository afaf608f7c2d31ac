"""tvm_ext.models.mixed_precision: GEMMs and convolutions in bfloat16 / float16 with float32
master weights and state, dynamic loss scaling for float16 (torch's GradScaler), and the loss
curves against float32."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_ext import driver
from tvm_ext.errors import InputError
from tvm_ext.models import get_model
from tvm_ext.models.mixed_precision import LossScaler, low_precision_step
from tvm_ext.models.optimizer import Optimizer, _update_scale, make_optimizer_step

torch = pytest.importorskip("torch")
STEPS = 5
# The bounds compile.py --check states (tvm_ext.cli.training.LOW_PRECISION_BOUND).
BOUND = {"bf16": 3e-2, "fp16": 1e-2}


def _gemms(mod):
    calls = []
    ops = {tvm.ir.Op.get(n) for n in ("relax.matmul", "relax.nn.conv2d")}
    relax.analysis.post_order_visit(mod["main"], lambda e: calls.append(e) if isinstance(
        e, relax.Call) and any(e.op.same_as(op) for op in ops) else None)
    return calls


def test_gemms_take_low_precision_operands_and_accumulate_in_float32(zoo_cache):
    step = zoo_cache("resnet", True)
    low = low_precision_step(step, "bf16")
    calls = _gemms(low.mod)
    assert calls and all(str(a.ty.dtype) == "bfloat16" for c in calls for a in c.args[:2])
    assert all(str(c.ty.dtype) == "float32" for c in calls)
    assert [p.dtype for p in low.params] == [p.dtype for p in step.params]  # float32 masters
    with pytest.raises(InputError, match="loss scaling"):
        low_precision_step(step, "fp16")
    with pytest.raises(InputError, match="training step"):
        low_precision_step(zoo_cache("mlp"), "bf16")


def _losses(name, dtype, opt, scaler=None, steps=STEPS):
    step = get_model(name, "tiny", training=True, loss_scale=dtype == "fp16")
    step = make_optimizer_step(low_precision_step(step, dtype), opt, scaler)
    session = driver.TrainingSession(driver.build(step, driver.resolve_target("llvm")), step,
                                     tvm.cpu())
    results = session.run([step.random_inputs(0)] * steps)
    return np.array([r.loss for r in results]), session


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_tracks_the_float32_curve(dtype):
    opt = Optimizer("adamw", lr=0.01)
    fp32, _ = _losses("mlp", "fp32", opt)
    low, session = _losses("mlp", dtype, opt)
    assert np.all(np.diff(low) < 0)
    assert np.all(np.abs(low - fp32) <= BOUND[dtype] * np.abs(fp32))
    assert not np.array_equal(low, fp32)  # it did compute in low precision
    if dtype == "fp16":  # no overflow at the default scale: every step counted
        scale, tracker = session.state()[-2:]
        assert float(scale) == 65536.0 and float(tracker) == STEPS
        assert float(session.state()[-3]) == STEPS


def test_overflowing_steps_are_skipped_and_the_scale_backs_off():
    """A scale so large that the scaled gradients overflow float16: the step is skipped
    (parameters, state and step count unchanged) and the scale halves, as GradScaler does."""
    opt = Optimizer("adam", lr=0.01)
    huge = LossScaler(init_scale=2.0 ** 60)
    losses, session = _losses("mlp", "fp16", opt, huge, steps=3)
    start = get_model("mlp", "tiny", training=True).random_params(0)
    for a, b in zip(session.parameters(), start, strict=True):
        np.testing.assert_array_equal(a, b)
    *moments, count, scale, tracker = session.state()
    assert not any(m.any() for m in moments) and float(count) == 0
    assert float(scale) == 2.0 ** 57 and float(tracker) == 0
    assert np.all(np.isfinite(losses)) and np.allclose(losses, losses[0])


def test_scale_update_matches_torch():
    """The in-graph scale update against torch's own (`torch._amp_update_scale_`) over a run
    of finite and non-finite steps."""
    scaler = LossScaler(init_scale=1024.0, growth_interval=3)
    bb = relax.BlockBuilder()
    args = [relax.Var(n, relax.TensorType((), "float32")) for n in ("s", "t", "f")]
    with bb.function("main", args):
        out = bb.emit_te(lambda a, b, f: _update_scale(a, b, f, scaler), *args)
        bb.emit_func_output(out)
    vm = relax.VirtualMachine(tvm.compile(bb.get(), "llvm"), tvm.cpu())
    scale, tracker = np.float32(scaler.init_scale), np.float32(0)
    t_scale, t_tracker = torch.tensor(scaler.init_scale), torch.tensor(0, dtype=torch.int32)
    for finite in [1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 0]:
        s, t = vm["main"](*[tvm.runtime.tensor(np.asarray(v, "float32"))
                            for v in (scale, tracker, finite)])
        scale, tracker = s.numpy(), t.numpy()
        torch._amp_update_scale_(t_scale, t_tracker, torch.tensor(float(not finite)),
                                 scaler.growth_factor, scaler.backoff_factor,
                                 scaler.growth_interval)
        assert float(scale) == float(t_scale) and int(tracker) == int(t_tracker)
