"""The model zoo: every model's inference and training step, checked against NumPy references
and finite differences."""

from __future__ import annotations

import numpy as np
import pytest
import reference
import tvm

from tvm_ext import driver
from tvm_ext.models import ModelLoadError, get_model, list_models

ZOO = ["mlp", "gpt", "resnet"]


def _run(model, arguments, target):
    ex = driver.build(model, target)
    return driver.run(ex, arguments, tvm.cpu(), repeat=0).outputs


@pytest.mark.parametrize("name", ZOO)
def test_inference_matches_numpy(name, zoo_cache, llvm):
    model = zoo_cache(name)
    inputs, params = model.random_inputs(1), model.random_params(1)
    (out,) = _run(model, [*inputs, *params], llvm)
    named = {s.name: v.astype(np.float64) for s, v in zip(model.params, params, strict=True)}
    expected = reference.forward(model, named, [i.astype(np.float64) if i.dtype.kind == "f"
                                                else i for i in inputs])
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ZOO)
def test_training_loss_matches_numpy(name, zoo_cache, llvm):
    model = zoo_cache(name, training=True)
    args = model.random_arguments(2)
    outputs = _run(model, args, llvm)
    *inputs, labels = args[: model.num_input]
    named = {s.name: v.astype(np.float64)
             for s, v in zip(model.params, args[model.num_input:], strict=True)}
    logits = reference.forward(model, named, [i.astype(np.float64) if i.dtype.kind == "f"
                                              else i for i in inputs], training=True)
    np.testing.assert_allclose(outputs[0], reference.cross_entropy(logits, labels), rtol=1e-4)
    grads = outputs[1:]
    assert len(grads) == len(model.config["gradients"])
    by_name = {s.name: s for s in model.params}
    for gname, g in zip(model.config["gradients"], grads, strict=True):
        assert g.shape == by_name[gname].shape, gname


# ResNet in the sweep: test_gradients checks convolution and batch-norm gradients op by op.
@pytest.mark.parametrize("name", [n if n != "resnet" else pytest.param(n, marks=pytest.mark.sweep)
                                  for n in ZOO])
def test_training_gradients_match_finite_differences(name, zoo_cache, llvm):
    """For each of a few parameters p with computed gradient g, the central difference of the
    loss along v = g/|g| must equal g.v = |g| (a wrong gradient direction or scale fails)."""
    model = zoo_cache(name, training=True)
    ex = driver.build(model, llvm)
    vm = tvm.relax.VirtualMachine(ex, tvm.cpu())
    args = model.random_arguments(3)

    def call(arrays):
        out = vm["main"](*[tvm.runtime.tensor(a) for a in arrays])
        return [o.numpy() for o in out]

    base = call(args)
    names = model.config["gradients"]
    index = {s.name: model.num_input + i for i, s in enumerate(model.params)}
    picks = sorted({0, len(names) // 2, len(names) - 1})
    eps = 1e-2
    for k in picks:
        g = base[1 + k].astype(np.float64)
        norm = np.linalg.norm(g)
        if norm < 1e-6:
            continue
        v = (g / norm).astype(np.float32)
        plus, minus = list(args), list(args)
        pos = index[names[k]]
        plus[pos] = args[pos] + eps * v
        minus[pos] = args[pos] - eps * v
        fd = (float(call(plus)[0]) - float(call(minus)[0])) / (2 * eps)
        assert fd == pytest.approx(norm, rel=3e-2, abs=1e-4), names[k]


def test_sizes_overrides_and_errors():
    sizes = list_models()
    assert set(sizes) == set(ZOO) and "tiny" in sizes["gpt"]
    deeper = get_model("gpt", "tiny", layers=3)
    assert deeper.config["layers"] == 3
    assert len(deeper.params) == len(get_model("gpt", "tiny").params) + 16
    with pytest.raises(ModelLoadError, match="unknown model"):
        get_model("vgg")
    with pytest.raises(ModelLoadError, match="unknown size"):
        get_model("mlp", "huge")
    with pytest.raises(ModelLoadError, match="no field depth"):
        get_model("mlp", "tiny", depth=3)
    with pytest.raises(ValueError, match="not a multiple"):
        get_model("gpt", "tiny", heads=5)


def test_large_sizes_are_planning_only_graphs(llvm):
    """Big sizes build IR (and a graph) without allocating their weights."""
    model = get_model("mlp", "large")
    assert model.param_bytes > 2**31
    graph = driver.fused_graph(model, llvm)
    assert graph.bytes_of_kind("parameter") == model.param_bytes


def test_token_ids_are_drawn_across_the_table_they_index():
    """An integer input a lookup reads (cast and reshaped on the way) is drawn in [0, rows of
    the table); one that only masks stays 0 or 1."""
    from tvm import relax

    from tvm_ext.models.base import model_from_function

    ids = relax.Var("ids", relax.TensorType((2, 8), "int64"))
    mask = relax.Var("mask", relax.TensorType((2, 8), "int64"))
    table = relax.Var("table", relax.TensorType((50, 4), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [ids, mask, table]):
        with bb.dataflow():
            flat = bb.emit(relax.op.reshape(relax.op.astype(ids, "int32"), (16,)))
            rows = bb.emit(relax.op.reshape(relax.op.take(table, flat, axis=0), (2, 8, 4)))
            keep = bb.emit(relax.op.expand_dims(relax.op.astype(mask, "float32"), -1))
            out = bb.emit_output(relax.op.multiply(rows, keep))
        bb.emit_func_output(out)
    model = model_from_function("lookup", bb.get()["main"], 2)
    assert [(s.init, s.high) for s in model.inputs] == [("randint", 50), ("randint", 2)]
    drawn = model.random_inputs(0)[0]
    assert drawn.max() < 50 and drawn.max() >= 2
