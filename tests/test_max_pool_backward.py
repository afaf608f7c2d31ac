"""`tvm_ext.models.max_pool_backward`: max pooling's gradient where PyTorch sends it, in the
windows TVM's own legalization got wrong, and on the GPU."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from gpu_emulation import differing
from tvm import relax, tirx

from tvm_ext import pipeline as P
from tvm_ext.ir.pass_records import LIBRARY_ATTR
from tvm_ext.models.base import model_from_function
from tvm_ext.schedules.default_gpu import ApplyDefaultGPUSchedules
from tvm_ext.schedules.thread_work import serial_iterations


def _pool_step(shape, kernel, stride, padding, ceil_mode, dtype="float64"):
    """main(x, r) -> (sum(max_pool2d(x) * r), dx)."""
    bb = relax.BlockBuilder()
    out_shape = _torch_pool(np.zeros(shape), kernel, stride, padding, ceil_mode)[0].shape
    x = relax.Var("x", relax.TensorType(shape, dtype))
    r = relax.Var("r", relax.TensorType(out_shape, dtype))
    with bb.function("main", [x, r]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.max_pool2d(x, kernel, stride, padding, ceil_mode=ceil_mode))
            out = bb.emit_output(relax.op.sum(relax.op.multiply(y, r)))
        bb.emit_func_output(out)
    mod = relax.transform.Gradient("main", require_grads=[x])(bb.get())
    return tvm.IRModule({"main": mod["main_adjoint"].with_attr("global_symbol", "main")})


def _torch_pool(x, kernel, stride, padding, ceil_mode, r=None):
    torch = pytest.importorskip("torch")
    tx = torch.tensor(x, requires_grad=True)
    y = torch.nn.functional.max_pool2d(tx, kernel, stride, padding, ceil_mode=ceil_mode)
    if r is None:
        return (y.detach().numpy(),)
    (y * torch.tensor(r)).sum().backward()
    return y.detach().numpy(), tx.grad.numpy()


@pytest.mark.parametrize("kernel, stride, padding, size, ceil_mode", [
    (3, 2, 1, 8, False),  # ResNet's stem pool, which TVM's got right
    (2, 2, 0, 3, False),  # a row no window reads
    (2, 2, 0, 7, False),
    (3, 1, 1, 2, True),  # GoogLeNet's inception branch on a 2 x 2 map
    (3, 2, 0, 3, True),
    (2, 1, 0, 2, True),  # TVM's read uninitialized memory here
    (5, 2, 2, 3, True),
    (5, 1, 1, 4, False),
])
@pytest.mark.parametrize("ties", [False, True])
def test_max_pool_gradient_matches_torch(kernel, stride, padding, size, ceil_mode, ties):
    """With `ties` the input is a ReLU's, mostly zeros (and repeated values): each window's
    gradient goes to the first element holding its maximum, as PyTorch's."""
    rng = np.random.default_rng(size * 31 + kernel)
    x = rng.standard_normal((2, 3, size, size))
    if ties:
        x = np.maximum(np.round(x * 2) - 1, 0)
    r = rng.standard_normal(_torch_pool(x, kernel, stride, padding, ceil_mode)[0].shape)
    _, dx_torch = _torch_pool(x, kernel, stride, padding, ceil_mode, r)
    vm = relax.VirtualMachine(tvm.compile(_pool_step(x.shape, kernel, stride, padding,
                                                     ceil_mode), "llvm"), tvm.cpu())
    _, (dx,) = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(r))
    np.testing.assert_allclose(dx.numpy(), dx_torch, rtol=1e-12, atol=1e-12)


def test_max_pool_gradient_gets_gpu_threads(cuda_target):
    """The three stages get GPU schedules that compute what they compute, no thread running
    more than a window's serial work, and compile with nvcc."""
    mod = _pool_step((8, 64, 56, 56), 3, 2, 1, False, "float32")
    model = model_from_function("pool", mod["main"], 2)
    unscheduled = P.run_phases(model.mod, cuda_target, through="library_kernels",
                               inclusive=True)
    with cuda_target:
        scheduled = ApplyDefaultGPUSchedules()(tvm.IRModule(dict(unscheduled.functions_items())))
    names = [gv.name_hint for gv, f in unscheduled.functions_items()
             if isinstance(f, tirx.PrimFunc) and LIBRARY_ATTR not in (f.attrs or {})
             and gv.name_hint.startswith("max_pool2d")]
    assert "max_pool2d_backward" in names
    assert differing(unscheduled, scheduled, names) == []
    backward = scheduled["max_pool2d_backward"]
    assert serial_iterations(backward, "max_pool2d_backward").iterations <= 64
    with cuda_target:
        tvm.compile(tvm.IRModule({"main": backward.with_attr("global_symbol", "main")}),
                    target=cuda_target)
