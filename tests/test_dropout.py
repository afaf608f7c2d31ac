"""Dropout of a train-mode export (`tvm_ext.models.dropout`): the seeded mask, applied by the
compiled module, by PyTorch in `--check`, and the same wherever a plan splits the op in time
or partitions it."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import tvm
from tvm import te

from tvm_ext import driver, pipeline
from tvm_ext.ir.targets import vm_devices
from tvm_ext.models import ModelLoadError, load_model, reference
from tvm_ext.models.dropout import SEED_INPUT, mask_compute, mask_numpy
from tvm_ext.swap import baselines, recompute, validate
from tvm_ext.swap.placement import argument_devices

torch = pytest.importorskip("torch")
LLVM = tvm.target.Target("llvm")


@pytest.mark.parametrize("shape, p, seed, op", [
    ((3, 5, 7), 0.3, 12345, 0), ((64, 33), 0.1, 2**40 + 7, 3), ((5,), 0.9, 0, 1)])
def test_the_mask_kernel_is_the_numpy_mask(shape, p, seed, op):
    """Bit for bit (uint32 arithmetic, wrapping, in both)."""
    s = te.placeholder((), "int64", name="seed")
    kernel = tvm.tirx.build(te.create_prim_func([s, mask_compute(s, op, shape, p, "float32")]),
                            target="llvm")
    out = tvm.runtime.empty(shape, "float32")
    kernel(tvm.runtime.tensor(np.array(seed, "int64")), out)
    np.testing.assert_array_equal(out.numpy(), mask_numpy(seed, op, shape, p))


def test_the_mask_drops_p_of_the_elements_and_scales_the_others():
    mask = mask_numpy(7, 0, (256, 256), 0.3)
    assert abs((mask == 0).mean() - 0.3) < 0.01
    assert set(np.unique(mask)) == {0.0, np.float32(1 / 0.7)}
    others = [mask_numpy(8, 0, (256, 256), 0.3), mask_numpy(7, 1, (256, 256), 0.3)]
    assert all(((m == 0) != (mask == 0)).mean() > 0.3 for m in others)  # seed, op: new masks


def _mlp(hidden: int = 16):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.GELU(),
                               torch.nn.Dropout(0.3), torch.nn.Linear(hidden, 4))


def _export(net, path, batch: int = 3):
    torch.export.save(torch.export.export(net, (torch.randn(batch, 8),)), str(path))
    return str(path)


def _run(model, args):
    return driver.run(driver.build(model, LLVM), args, tvm.cpu(), repeat=0).outputs


def test_a_train_mode_dropout_is_applied_as_pytorch_applies_the_same_mask(tmp_path):
    """The seed is the last input; the output and the training step's loss and gradients are
    PyTorch's under the same mask; another seed, another mask; eval mode has no seed."""
    path = _export(_mlp().train(), tmp_path / "train.pt2")
    model = load_model(path)
    assert model.inputs[-1].name == SEED_INPUT and model.inputs[-1].high > 2**30
    args = model.random_arguments(0)
    names = [p.name for p in model.params]
    n = model.num_input
    (out,) = _run(model, args)
    (expected,) = reference.torch_reference(path, args[:n], args[n:], names)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    other = [*args[:n - 1], np.array(int(args[n - 1]) + 1), *args[n:]]
    assert np.abs(_run(model, other)[0] - out).max() > 1e-3
    step = load_model(path, training=True)
    targs = step.random_arguments(0)
    k = step.num_input
    got = _run(step, targs)
    want = reference.torch_training_step(path, targs[:k - 1], targs[k - 1], targs[k:], names,
                                         step.config["gradients"])
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert SEED_INPUT not in [s.name for s in load_model(
        _export(_mlp().eval(), tmp_path / "eval.pt2")).inputs]


def test_a_dropout_of_whole_channels_is_refused(tmp_path):
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.Dropout2d(0.5)).train()
    path = tmp_path / "channels.pt2"
    torch.export.save(torch.export.export(net, (torch.randn(2, 3, 4, 4),)), str(path))
    with pytest.raises(ModelLoadError, match=r"feature_dropout in train mode .* export the "
                                             r"module in eval mode"):
        load_model(str(path))


def _masking_kernels(model) -> set[str]:
    """The fused kernels that compute a dropout mask (inside, fused with its neighbours)."""
    fused = pipeline.fuse(model.mod, LLVM)
    return {gv.name_hint for gv, f in fused.functions_items()
            if isinstance(f, tvm.tirx.PrimFunc) and 'T.sblock("dropout_mask")' in f.script()}


def test_the_mask_is_the_same_where_a_plan_splits_the_op(tmp_path):
    """At the smallest budget a kernel computing the mask runs in chunks (each with its
    chunk's global indices): the output is PyTorch's under the same mask."""
    path = _export(_mlp(64).train(), tmp_path / "train.pt2", batch=16)
    model = load_model(path)
    planning = driver.plan_swap(model, LLVM, "min", hardware="cpu", time_budget_s=1.0)
    graph, problem, plan = planning.graph, planning.problem, planning.plan
    validate(problem, plan)
    split = {graph.ops[sp.op].kernel for sp in plan.splits}
    assert split & _masking_kernels(model), split
    args = model.random_arguments(0)
    device, host = vm_devices(LLVM)
    out = driver.run(driver.build(model, LLVM, swap_plan=plan), args, device, repeat=0,
                     host=host, arg_devices=argument_devices(graph, plan)).outputs
    n = model.num_input
    (expected,) = reference.torch_reference(path, args[:n], args[n:],
                                            [p.name for p in model.params])
    np.testing.assert_allclose(out[0], expected, rtol=1e-5, atol=1e-6)


def test_the_mask_is_the_same_where_a_plan_recomputes_the_op(tmp_path):
    """A training step whose plan runs the kernel computing the mask a second time (for the
    backward pass): loss and gradients are PyTorch's under the same mask."""
    path = _export(_mlp(64).train(), tmp_path / "train.pt2", batch=16)
    step = load_model(path, training=True)
    planning = driver.plan_swap(step, LLVM, "100%", hardware="cpu", time_budget_s=1.0)
    graph, problem = planning.graph, planning.problem
    masking = _masking_kernels(step)
    chosen = [t for t in recompute.candidates(problem, problem.order)
              if graph.ops[problem.producers[t]].kernel in masking]
    assert chosen
    plan = baselines._best_of(problem, ("swapadvisor",), "checkpoint", np.asarray(chosen))
    again = [op for op, n in collections.Counter(plan.schedule).items() if n > 1]
    assert {graph.ops[op].kernel for op in again} & masking
    args = step.random_arguments(0)
    device, host = vm_devices(LLVM)
    got = driver.run(driver.build(step, LLVM, swap_plan=plan), args, device, repeat=0,
                     host=host, arg_devices=argument_devices(graph, plan)).outputs
    k = step.num_input
    want = reference.torch_training_step(path, args[:k - 1], args[k - 1], args[k:],
                                         [p.name for p in step.params],
                                         step.config["gradients"])
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_the_mask_is_the_same_on_each_device_of_a_partition(tmp_path, capsys):
    from tvm_ext.cli import main

    path = _export(_mlp(64).train(), tmp_path / "train.pt2", batch=16)
    assert main([path, "--devices", "2", "--run", "--check", "--repeat", "0"]) == 0
    out = capsys.readouterr().out
    assert "match PyTorch eager" in out and "not compared" not in out
