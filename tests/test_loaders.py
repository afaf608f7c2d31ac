"""Models from files: torch.export (.pt2), ONNX, Python; and clear errors for bad files."""

from __future__ import annotations

import logging
import textwrap

import numpy as np
import pytest
import tvm

from tvm_ext import driver
from tvm_ext.models import ModelLoadError, load_model


def _run(model, arguments):
    ex = driver.build(model, tvm.target.Target("llvm"))
    return driver.run(ex, arguments, tvm.cpu(), repeat=0).outputs


@pytest.fixture(scope="module")
def torch_mlp():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(3, 8)
    return torch, net, x


def test_pt2_matches_torch(torch_mlp, tmp_path):
    torch, net, x = torch_mlp
    path = str(tmp_path / "mlp.pt2")
    torch.export.save(torch.export.export(net, (x,)), path)
    model = load_model(path)
    assert model.weights is not None and len(model.params) == 4
    (out,) = _run(model, [x.numpy(), *model.random_params()])
    np.testing.assert_allclose(out, net(x).detach().numpy(), rtol=1e-5, atol=1e-5)


def test_loading_and_running_a_pt2_gives_no_torch_warning(torch_mlp, tmp_path):
    """torch's FutureWarnings about its own pytree API (on every load, copy and run of an
    exported program) are kept out of the way."""
    import warnings

    from tvm_ext.models.reference import torch_reference

    torch, net, x = torch_mlp
    path = str(tmp_path / "mlp.pt2")
    torch.export.save(torch.export.export(net, (x,)), path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model = load_model(path)
        torch_reference(path, [x.numpy()], model.random_params(),
                        [p.name for p in model.params])


def test_onnx_matches_torch(torch_mlp, tmp_path):
    torch, net, x = torch_mlp
    pytest.importorskip("onnx")
    path = str(tmp_path / "mlp.onnx")
    torch.onnx.export(net, (x,), path, dynamo=False)
    model = load_model(path)
    (out,) = _run(model, [x.numpy(), *model.random_params()])
    np.testing.assert_allclose(out, net(x).detach().numpy(), rtol=1e-5, atol=1e-5)


def test_onnx_check_runs_onnx_runtime_on_the_same_inputs_and_weights(torch_mlp, tmp_path,
                                                                    monkeypatch, capsys):
    """A .onnx model's --check has a second reference that reads the file itself (the plain
    TVM build shares the frontend's reading of it): ONNX Runtime."""
    pytest.importorskip("onnxruntime")
    import json

    from tvm_ext.cli import check, main

    torch, net, x = torch_mlp
    path = str(tmp_path / "mlp.onnx")
    torch.onnx.export(net, (x,), path, dynamo=False)
    report = tmp_path / "report.json"
    assert main([path, "--check", "--report", str(report)]) == 0
    entry = json.loads(report.read_text())["check"]["onnxruntime"]
    assert entry["ok"] and entry["reference"] == "ONNX Runtime (mlp.onnx)"
    assert "1 outputs match ONNX Runtime (mlp.onnx)" in capsys.readouterr().out
    # It is a verdict: outputs ONNX Runtime does not give fail the check.
    real = check.onnx_reference
    monkeypatch.setattr(check, "onnx_reference", lambda *a: [o + 1e-2 for o in real(*a)])
    assert main([path, "--check"]) == 1
    assert "FAILED against ONNX Runtime (mlp.onnx)" in capsys.readouterr().err
    # A training step is not compared (ONNX Runtime runs none), and says so.
    assert main([path, "--training", "--check"]) == 0
    assert "not compared with ONNX Runtime (mlp.onnx): ONNX Runtime runs no training step" \
        in capsys.readouterr().out


def _padded(torch):
    class Pad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(6, 4)

        def forward(self, x):
            pad = 6 - x.size(-1)
            return self.fc(torch.nn.functional.pad(x, (pad // 2, pad - pad // 2)))

    return Pad(), torch.randn(2, 3, 3)


def _geglu(torch):
    class GEGLU(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 8)

        def forward(self, x):
            h, gate = self.proj(x).chunk(2, dim=-1)
            return h * torch.nn.functional.gelu(gate)

    return GEGLU(), torch.randn(2, 3, 4)


@pytest.mark.parametrize("name, make, cause, refusal", [
    # torch's TorchScript exporter writes every `F.pad` as pads computed by ONNX ops, which
    # TVM's frontend refuses.
    ("pad", _padded, "Dynamic pads",
     "the TVM frontend cannot import this model: ValueError: Dynamic pads"),
    # GEGLU's `chunk(2, dim=-1)` (diffusers' UNets, ControlNet) exports as slices at bounds
    # computed from `Shape`: the frontend imports them as slices of a shape known only at run
    # time, which the pipeline could not fuse (a traceback).
    ("geglu", _geglu, "has a shape known only at run time",
     "has a shape known only at run time"),
])
def test_an_onnx_file_with_shape_computed_ops_imports_after_onnxsim(
        tmp_path, monkeypatch, capsys, name, make, cause, refusal):
    """At static shapes the computed pads and slice bounds are constants, which onnxsim
    folds; without onnxsim the file is refused with the frontend's reason."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxsim")
    from tvm_ext.cli import main
    from tvm_ext.models import onnx_files

    net, x = make(torch)
    path = str(tmp_path / f"{name}.onnx")
    torch.onnx.export(net, (x,), path, dynamo=False)
    assert main([path, "--check"]) == 0
    out = capsys.readouterr().out
    assert cause in out and "imported after onnxsim folded" in out
    assert f"1 outputs match ONNX Runtime ({name}.onnx)" in out
    monkeypatch.setattr(onnx_files, "simplified", lambda proto: None)
    with pytest.raises(ModelLoadError, match=refusal):
        load_model(path)


def _scatter_onnx(path: str) -> None:
    """ScatterND into a weight named as torch's TorchScript exporter (and onnxsim, folding a
    constant) names values."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    data = "/inner/model/Reshape_1_output_0"
    nodes = [helper.make_node("ScatterND", [data, "idx", "x"], ["/inner/y"]),
             helper.make_node("Relu", ["/inner/y"], ["y"])]
    graph = helper.make_graph(
        nodes, "scatter", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 4])],
        [numpy_helper.from_array(np.arange(32, dtype="float32").reshape(8, 4) - 16, data),
         numpy_helper.from_array(np.array([[1], [5]], "int64"), "idx")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def test_onnx_names_become_identifiers_and_weights_keep_their_file_names(tmp_path):
    path = str(tmp_path / "scatter.onnx")
    _scatter_onnx(path)
    model = load_model(path)
    assert [p.name for p in model.params] == ["inner_model_Reshape_1_output_0", "idx"]
    assert model.config["onnx_weight_names"] == {
        "inner_model_Reshape_1_output_0": "/inner/model/Reshape_1_output_0"}
    x = np.random.default_rng(0).standard_normal((2, 4)).astype("float32")
    (out,) = _run(model, [x, *model.random_params()])
    expected = np.arange(32, dtype="float32").reshape(8, 4) - 16
    expected[[1, 5]] = x
    np.testing.assert_array_equal(out, np.maximum(expected, 0))


def test_onnx_scatter_compiles_for_cuda(tmp_path, cuda_target):
    """TVM's GPU scatter writes its buffers' names into the CUDA source verbatim: with the
    exporter's names nvcc failed."""
    from tvm_ext.cli import main

    path = str(tmp_path / "scatter.onnx")
    _scatter_onnx(path)
    assert main([path, "--target", "cuda", "-o", str(tmp_path / "scatter.so")]) == 0


def test_onnx_clip_is_a_relax_op_so_the_training_step_and_autocast_build(tmp_path):
    """TVM's ONNX frontend writes Clip (ReLU6) as hand-made kernels, which Gradient cannot
    differentiate and autocast cannot retype; clip between constants and between tensor
    bounds both train, and match ONNX Runtime."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    from tvm_ext.cli import main

    def constant(name, value):
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(
            np.array(value, "float32"), name))

    nodes = [constant("zero", 0.0), constant("six", 6.0),
             helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Clip", ["h", "zero", "six"], ["r"]),
             helper.make_node("Clip", ["r", "lo"], ["y"])]
    graph = helper.make_graph(
        nodes, "clip", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8]),
                        helper.make_tensor_value_info("lo", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 6])],
        [numpy_helper.from_array(
            np.random.default_rng(0).standard_normal((8, 6)).astype("float32") * 3, "w")])
    path = str(tmp_path / "clip.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    script = load_model(path).mod["main"].script()
    assert "R.clip(" in script and "R.maximum(" in script and "call_tir" not in script
    assert main([path, "--check"]) == 0
    assert main([path, "--training", "--optimizer", "adamw", "--steps", "2", "--run"]) == 0
    assert main([path, "--dtype", "bf16", "--run"]) == 0


def test_onnx_pads_and_tile_are_relax_ops_so_the_training_step_builds(tmp_path):
    """TVM's ONNX frontend writes Pad and Tile as hand-made kernels, which Gradient cannot
    differentiate (SEW-D's, SwiftFormer's and UNet1D's training steps were refused): constant,
    reflecting and edge pads and a tile by constant repeats are Relax ops, match ONNX Runtime
    and train; a reflecting pad wider than its axis less one stays the frontend's kernel."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    from tvm_ext.cli import main

    def constant(name, value, dtype):
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(
            np.array(value, dtype), name))

    nodes = [constant("pads", [0, 1, 0, 2], "int64"), constant("half", 0.5, "float32"),
             constant("reps", [2, 1], "int64"), constant("mirror", [0, 1, 3, 1], "int64"),
             constant("edges", [2, 0, 0, 3], "int64"),
             helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Pad", ["h", "pads", "half"], ["p"], mode="constant"),
             helper.make_node("Tile", ["p", "reps"], ["t"]),
             helper.make_node("Pad", ["t", "mirror"], ["m"], mode="reflect"),
             helper.make_node("Pad", ["m", "edges"], ["y"], mode="edge")]

    def save(nodes, out_shape, name="pad_tile.onnx", opset=13):
        graph = helper.make_graph(
            nodes, "pad_tile", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
            [numpy_helper.from_array(
                np.random.default_rng(0).standard_normal((8, 6)).astype("float32"), "w")])
        path = str(tmp_path / name)
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]),
                  path)
        return path

    path = save(nodes, [14, 11])
    script = load_model(path).mod["main"].script()
    assert script.count("R.nn.pad(") == 3 and "R.tile(" in script and "call_tir" not in script
    assert 'pad_mode="reflect"' in script and 'pad_mode="replicate"' in script
    assert main([path, "--check"]) == 0
    assert main([path, "--training", "--run", "--check"]) == 0
    # A reflecting pad as wide as its axis reads past x: the frontend's kernel, as before.
    wide = save([*nodes[:3], constant("mirror", [0, 0, 0, 9], "int64"), *nodes[5:8],
                 helper.make_node("Pad", ["t", "mirror"], ["y"], mode="reflect")], [8, 18],
                "wide.onnx")
    assert load_model(wide).mod["main"].script().count("call_tir") == 1
    # Pad before opset 11 takes its widths and value as attributes.
    path = save([nodes[5], helper.make_node("Pad", ["h"], ["y"], pads=[1, 0, 0, 2], value=-1.5)],
                [5, 8], "pad2.onnx", opset=10)
    assert "R.nn.pad(" in load_model(path).mod["main"].script()
    assert main([path, "--check"]) == 0
    assert main([path, "--training", "--run", "--check"]) == 0


def test_onnx_unsorted_topk_and_a_reduce_max_import_and_train(tmp_path):
    """TVM's ONNX frontend refused TopK with sorted=0 (Doge's dynamic mask): imported as the
    sorted one, one of the orders an unsorted top-k may return; ReduceMax had no gradient."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    from tvm_ext.cli import main

    def constant(name, value):
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(
            np.array(value, "int64"), name))

    nodes = [constant("k", [3]), constant("axes", [1]),
             helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("TopK", ["h", "k"], ["v", "i"], axis=1, sorted=0),
             # The values summed: their order, unspecified, does not matter.
             helper.make_node("ReduceSum", ["v", "axes"], ["s"], keepdims=0),
             helper.make_node("ReduceMax", ["h"], ["m"], axes=[1], keepdims=0),
             helper.make_node("Add", ["s", "m"], ["y"])]
    graph = helper.make_graph(
        nodes, "topk", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(
            np.random.default_rng(0).standard_normal((8, 6)).astype("float32"), "w")])
    path = str(tmp_path / "topk.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    assert main([path, "--check"]) == 0
    assert main([path, "--training", "--run", "--check"]) == 0


def test_onnx_weights_torch_marks_as_buffers_or_constants_are_not_trained(tmp_path):
    """torch's dynamo exporter writes a module's buffers and the computation's constants (a
    Pow exponent) as weights beside its parameters, marking which is which: only its
    parameters, and values its optimizer folded from them (a transposed weight), are the
    model's (as in a .pt2 of it); the others are constants, so a training step does not
    train a Pow exponent into NaN (Wan). A file without the marks keeps every weight a
    parameter."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    from tvm_ext.cli import main

    rng = np.random.default_rng(0)
    weights = {"lin.weight": rng.standard_normal((8, 6)).astype("float32"),
               "val_9": rng.standard_normal((6, 6)).astype("float32"),
               "scale": np.array(2.0, "float32"), "buf": np.ones(6, "float32"),
               "val_0": np.array(2.0, "float32"), "val_4": np.array(0.5, "float32")}
    marks = {"lin.weight": {"kind": "PARAMETER"}, "scale": {"kind": "PARAMETER"},
             "buf": {"kind": "BUFFER"},
             "val_9": {"folded_from": "['proj.weight']"},       # proj.weight transposed
             "val_4": {"folded_from": "['val_2', 'val_3']"}}    # the exporter's literals
    keys = {"kind": "pkg.torch.export.graph_signature.InputSpec.kind",
            "folded_from": "pkg.onnxscript.optimizer.folded_from"}
    nodes = [helper.make_node("MatMul", ["x", "lin.weight"], ["h"]),
             helper.make_node("Pow", ["h", "val_0"], ["p"]),  # a negative base: d/dexp NaN
             helper.make_node("MatMul", ["p", "val_9"], ["q"]),
             helper.make_node("Mul", ["q", "scale"], ["s"]),
             helper.make_node("Add", ["s", "buf"], ["t"]),
             helper.make_node("Mul", ["t", "val_4"], ["y"])]

    def save(marked: bool) -> str:
        infos = []
        for name, entries in marks.items():
            info = helper.make_tensor_value_info(name, TensorProto.FLOAT, weights[name].shape)
            for key, value in entries.items() if marked else ():
                entry = info.metadata_props.add()
                entry.key, entry.value = keys[key], value
            infos.append(info)
        graph = helper.make_graph(
            nodes, "marks", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 6])],
            [numpy_helper.from_array(w, n) for n, w in weights.items()], value_info=infos)
        path = str(tmp_path / f"marks_{marked}.onnx")
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
        return path

    marked = save(True)
    model = load_model(marked)
    assert [p.name for p in model.params] == ["lin_weight", "val_9", "scale"]
    np.testing.assert_array_equal(model.weights[2], weights["scale"])
    assert main([marked, "--check"]) == 0
    assert main([marked, "--training", "--optimizer", "adamw", "--steps", "2", "--run",
                 "--check"]) == 0
    unmarked = save(False)
    assert [p.name for p in load_model(unmarked).params] == [
        "lin_weight", "val_9", "scale", "buf", "val_0", "val_4"]
    # Trained, the exponent's gradient at the negative bases is NaN: the check says so.
    assert main([unmarked, "--training", "--run", "--check"]) == 1


def test_onnx_negative_perms_a_folded_expand_shape_and_einsum_import_and_train(tmp_path,
                                                                               capsys):
    """Zamba2 through torch's TorchScript exporter: a Transpose perm counting from the end
    (ONNX Runtime refuses it), an Expand to a shape onnxsim left in an initializer (the
    frontend read it as a run-time shape: every shape after it unknown, its Einsum failed),
    and Einsum, which had no gradient."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    from tvm_ext.cli import main

    rng = np.random.default_rng(0)

    def weight(name, shape):
        return numpy_helper.from_array(rng.standard_normal(shape).astype("float32"), name)

    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Transpose", ["h"], ["t"], perm=[0, -1, -2]),
             helper.make_node("ReduceMean", ["x"], ["r"], axes=[1], keepdims=1),
             helper.make_node("Transpose", ["r"], ["rt"], perm=[0, 2, 1]),
             helper.make_node("Expand", ["rt", "shape"], ["e"]),
             helper.make_node("Mul", ["t", "e"], ["m"]),
             helper.make_node("Einsum", ["m", "w2"], ["y"], equation="bij,jk->bik")]
    graph = helper.make_graph(
        nodes, "zamba", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 5])],
        [weight("w", (4, 4)), weight("w2", (3, 5)),
         numpy_helper.from_array(np.array([2, 4, 3], "int64"), "shape")])
    path = str(tmp_path / "zamba.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    assert main([path, "--check"]) == 0
    assert "1 Transpose perms count dims from the end" in capsys.readouterr().out
    assert main([path, "--training", "--run", "--check"]) == 0


def test_a_kernel_without_a_gradient_is_named_when_the_training_step_is_built():
    from tvm import relax, topi

    from tvm_ext.models.base import make_training_step, model_from_function

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    w = relax.Var("w", relax.TensorType((8, 8), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            h = bb.emit(relax.op.matmul(x, w))
            out = bb.emit_output(bb.call_te(topi.maximum, h, 0.0))
        bb.emit_func_output(out)
    mod = bb.get()
    model = model_from_function("net", mod["main"], 1, module=mod)
    with pytest.raises(ValueError, match="cannot build the training step: the frontend wrote "
                                         "kernels that have no gradient"):
        make_training_step(model, loss="mse")


def test_file_training_step_uses_mse(torch_mlp, tmp_path):
    torch, net, x = torch_mlp
    path = str(tmp_path / "mlp.pt2")
    torch.export.save(torch.export.export(net, (x,)), path)
    model = load_model(path, training=True)
    target = np.random.default_rng(0).standard_normal((3, 4)).astype("float32")
    outputs = _run(model, [x.numpy(), target, *model.random_params()])
    expected = float(((net(x).detach().numpy() - target) ** 2).mean())
    assert float(outputs[0]) == pytest.approx(expected, rel=1e-5)
    assert len(outputs) == 1 + 4


PY_MODEL = textwrap.dedent('''
    from tvm.relax.frontend import nn
    from tvm_ext.models import TensorSpec

    class Net(nn.Module):
        def __init__(self, width):
            self.fc = nn.Linear(6, width)

        def forward(self, x):
            return nn.op.relu(self.fc(x))

    def get_model(width=5):
        return Net(width), {"x": TensorSpec("x", (2, 6))}
''')


def test_py_file_with_get_model(tmp_path):
    path = tmp_path / "net.py"
    path.write_text(PY_MODEL)
    model = load_model(str(path), width=7)
    x, w, b = model.random_arguments(0)
    assert w.shape == (7, 6)
    (out,) = _run(model, [x, w, b])
    np.testing.assert_allclose(out, np.maximum(x @ w.T + b, 0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("suffix", [".pt2", ".onnx"])
def test_garbage_file_names_the_file(tmp_path, suffix):
    if suffix == ".pt2":
        pytest.importorskip("torch")
    else:
        pytest.importorskip("onnx")
    path = tmp_path / f"broken{suffix}"
    path.write_bytes(b"\x00not a model\xff" * 10)
    with pytest.raises(ModelLoadError, match=f"broken{suffix}.*does not parse"):
        load_model(str(path))
    if suffix == ".pt2":  # a zip torch cannot read: one line, no torch log on the way
        import zipfile

        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("model/models/model.json", "{not json")
        handler = _Records()
        logging.getLogger().addHandler(handler)
        try:
            with pytest.raises(ModelLoadError, match="does not parse") as info:
                load_model(str(path))
        finally:
            logging.getLogger().removeHandler(handler)
        assert "\n" not in str(info.value) and not handler.records


class _Records(logging.Handler):
    """The log records emitted while it is attached."""

    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_bad_python_and_unknown_files(tmp_path):
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(ModelLoadError, match=r"empty\.py defines no get_model"):
        load_model(str(empty))
    broken = tmp_path / "broken.py"
    broken.write_text("def get_model(:\n")
    with pytest.raises(ModelLoadError, match=r"broken\.py does not parse"):
        load_model(str(broken))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "missing.onnx"))
    other = tmp_path / "weights.txt"
    other.write_text("1 2 3")
    with pytest.raises(ModelLoadError, match="unknown model file kind"):
        load_model(str(other))


# --------------------------------------------------------------------------------------------
# Third-party models: transformers GPT-2, attention, reduced precision, train/eval semantics
# --------------------------------------------------------------------------------------------


def _export(torch, module, args, path):
    torch.export.save(torch.export.export(module, args), str(path))
    return str(path)


@pytest.mark.parametrize("dtype, atol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_transformers_gpt2_sdpa_matches_torch(tmp_path, dtype, atol):
    """GPT-2's Conv1D views the sdpa output, which the decomposition gives other strides; in
    bfloat16 its layer norms and power (gelu_new) have no bfloat16 lowering in TVM."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1,
                                     n_head=2, attn_implementation="sdpa")
    lm = transformers.GPT2LMHeadModel(config).eval().to(getattr(torch, dtype))

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(input_ids=ids, use_cache=False).logits

    net = Logits().eval()
    ids = torch.randint(0, 64, (2, 8))
    model = load_model(_export(torch, net, (ids,), tmp_path / "gpt2.pt2"))
    (out,) = _run(model, [ids.numpy(), *model.random_params()])
    expected = net(ids).float().detach().numpy()
    np.testing.assert_allclose(out.astype("float32"), expected, rtol=1e-4, atol=atol)


def test_sdpa_masks_match_torch(tmp_path):
    torch = pytest.importorskip("torch")
    functional = torch.nn.functional

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
            additive = torch.triu(torch.full((t, t), -1e4), 1)
            keep = torch.tril(torch.ones(t, t, dtype=torch.bool))
            return (
                functional.scaled_dot_product_attention(q, k, v),
                functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                functional.scaled_dot_product_attention(q, k, v, attn_mask=additive),
                functional.scaled_dot_product_attention(q, k, v, attn_mask=keep),
                functional.scaled_dot_product_attention(q, k, v, scale=0.1),
            )

    torch.manual_seed(0)
    net = Attention().eval()
    x = torch.randn(2, 8, 16)
    model = load_model(_export(torch, net, (x,), tmp_path / "sdpa.pt2"))
    outputs = _run(model, [x.numpy(), *model.random_params()])
    expected = net(x)
    assert len(outputs) == len(expected)
    for name, out, ref in zip(("plain", "causal", "additive", "bool", "scale"), outputs,
                              expected, strict=True):
        np.testing.assert_allclose(out, ref.detach().numpy(), rtol=1e-5, atol=1e-5,
                                   err_msg=name)


@pytest.mark.parametrize("dtype, atol", [("float16", 2e-3), ("bfloat16", 2e-2)])
def test_reduced_precision_linear_and_conv_match_torch(tmp_path, dtype, atol):
    """The frontend gives matmuls and convolutions a float32 result: the bias add mixed dtypes."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(4 * 6 * 6, 16), torch.nn.GELU(), torch.nn.Linear(16, 4),
    )
    net = net.to(getattr(torch, dtype)).eval()
    x = torch.randn(2, 3, 8, 8).to(getattr(torch, dtype))
    model = load_model(_export(torch, net, (x,), tmp_path / f"{dtype}.pt2"))
    assert model.main.ret_ty.dtype == dtype
    x_np = x.float().numpy().astype(model.inputs[0].dtype)
    (out,) = _run(model, [x_np, *model.random_params()])
    expected = net(x).float().detach().numpy()
    np.testing.assert_allclose(out.astype("float32"), expected, rtol=1e-2, atol=atol)


def test_parse_and_import_errors_differ(tmp_path):
    torch = pytest.importorskip("torch")

    class Special(torch.nn.Module):
        def forward(self, x):
            return torch.special.bessel_j0(x)

    path = _export(torch, Special(), (torch.randn(4),), tmp_path / "special.pt2")
    with pytest.raises(ModelLoadError, match="cannot import this model") as info:
        load_model(path)
    assert "special.pt2" in str(info.value) and "does not parse" not in str(info.value)


class _LossAndLogits:
    """A module returning what `transformers` models return: an output dataclass (here the
    loss first, as a model given labels returns it)."""

    @staticmethod
    def export(torch, path, output_type):
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(6, 4)

            def forward(self, x):
                logits = self.fc(x)
                return output_type(loss=(logits ** 2).mean(), logits=logits)

        torch.manual_seed(0)
        net, x = Net().eval(), torch.randn(3, 6)
        _export(torch, net, (x,), path)
        with torch.no_grad():
            out = net(x)
        return x.numpy(), out.logits.numpy(), out.loss.numpy()


_LOAD_FRESH = textwrap.dedent("""
    import sys
    from tvm_ext.models import load_model
    model = load_model(sys.argv[1])
    print(model.config["returns"], ",".join(model.config["outputs"]))
""")


def test_an_unwrapped_transformers_export_loads_in_a_fresh_process(tmp_path):
    """The file names `transformers.modeling_outputs.CausalLMOutput` in its output spec: loaded
    where nothing imported `transformers` yet, with no torch warnings, the logits first."""
    import subprocess
    import sys

    torch = pytest.importorskip("torch")
    outputs = pytest.importorskip("transformers.modeling_outputs")
    path = str(tmp_path / "unwrapped.pt2")
    x, logits, loss = _LossAndLogits.export(torch, path, outputs.CausalLMOutput)
    done = subprocess.run([sys.executable, "-c", _LOAD_FRESH, path], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["CausalLMOutput", "logits,loss"]
    assert "Warning" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    model = load_model(path)
    out = _run(model, [x, *model.random_params()])
    np.testing.assert_allclose(out[0], logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[1], loss, rtol=1e-5, atol=1e-6)
    from tvm_ext.models.reference import torch_reference

    names = [p.name for p in model.params]
    ref = torch_reference(path, [x], model.random_params(), names)
    np.testing.assert_allclose(ref[0], logits, rtol=1e-6)


def test_an_export_returning_a_class_that_is_not_installed_loads(tmp_path):
    """Its outputs are read by the field names the file holds."""
    import dataclasses

    torch = pytest.importorskip("torch")
    from torch.utils import _pytree

    @dataclasses.dataclass
    class Outputs:
        loss: object
        logits: object

    name = "tvm_ext_test_not_installed.Outputs"
    _pytree.register_dataclass(Outputs, serialized_type_name=name)
    path = str(tmp_path / "gone.pt2")
    try:
        _LossAndLogits.export(torch, path, Outputs)
    finally:
        _pytree._deregister_pytree_node(Outputs)
    model = load_model(path)
    assert (model.config["returns"], model.config["outputs"]) == ("Outputs", ["logits", "loss"])
    from tvm_ext.models.reference import torch_reference

    ref = torch_reference(path, [np.ones((3, 6), "float32")], model.random_params(),
                          [p.name for p in model.params])
    assert [r.shape for r in ref] == [(3, 4), ()]


def _batch_norm_cnn(torch):
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Dropout(0.3),
        torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 5),
    )
    with torch.no_grad():
        # Running statistics far from any batch's, so the two semantics give different losses.
        net[1].running_mean.uniform_(-0.5, 0.5)
        net[1].running_var.uniform_(0.5, 2.0)
    return net


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_training_step_follows_export_mode(tmp_path, mode):
    """An eval-mode export trains on running statistics, a train-mode one on batch statistics;
    loss and gradients as torch.autograd gives them on the module in that mode."""
    torch = pytest.importorskip("torch")
    net = _batch_norm_cnn(torch)
    if mode == "train":
        net[3].p = 0.0  # the step applies no dropout
    getattr(net, mode)()
    x, target = torch.randn(2, 3, 8, 8), torch.randn(2, 5)
    step = load_model(_export(torch, net, (x,), tmp_path / f"{mode}.pt2"), training=True)
    assert step.config["training_semantics"] == mode
    assert step.summary()["training_semantics"] == mode
    loss, *grads = _run(step, [x.numpy(), target.numpy(), *step.random_params()])

    net.zero_grad()
    expected = ((net(x) - target) ** 2).mean()
    expected.backward()
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    params = dict(net.named_parameters())
    assert len(grads) == len(params)
    for name, grad in zip(step.config["gradients"], grads, strict=True):
        ref = params[name.removeprefix("p_").replace("_", ".")].grad.numpy()
        np.testing.assert_allclose(grad, ref, rtol=1e-4, atol=1e-6, err_msg=name)


def test_transformers_llama_training_step_matches_torch(tmp_path):
    """Llama with its default (empty) key/value cache: torch.cat skips the empty cache, and
    the rotary tables (arange) meet the parameters in the gradient."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=16)
    lm = transformers.LlamaForCausalLM(config).eval()

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(input_ids=ids).logits

    net = Logits().eval()
    ids = torch.randint(0, 64, (2, 8))
    path = _export(torch, net, (ids,), tmp_path / "llama.pt2")
    step = load_model(path, training=True)
    target = torch.randn(2, 8, 64)
    # The plain build: this checks the import and the gradients, and compiles faster.
    executable = driver.build_reference(step, tvm.target.Target("llvm"))
    arguments = [ids.numpy(), target.numpy(), *step.random_params()]
    loss, *grads = driver.run(executable, arguments, tvm.cpu(), repeat=0).outputs

    expected = ((net(ids) - target) ** 2).mean()
    expected.backward()
    assert float(loss) == pytest.approx(expected.item(), rel=1e-5)
    to_param = torch.export.load(path).graph_signature.inputs_to_parameters
    params = dict(net.named_parameters())
    for name, grad in zip(step.config["gradients"], grads, strict=True):
        np.testing.assert_allclose(grad, params[to_param[name]].grad.numpy(), rtol=1e-4,
                                   atol=1e-6, err_msg=name)


def _bert(torch, transformers):
    """BertModel: its word embeddings have padding_idx 0, which gets no gradient from ids 0."""
    config = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=32, attn_implementation="eager")
    model = transformers.BertModel(config).eval()
    ids = torch.randint(1, 128, (2, 8))
    ids[:, -2:] = 0  # padding
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[1, -2:] = 0
    return model, (ids, mask)


def _wav2vec2(torch, transformers):
    """Wav2Vec2Model: strided Conv1d feature extractor and a grouped Conv1d position embedding."""
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4, feat_extract_norm="layer", do_stable_layer_norm=True,
        attn_implementation="eager")
    return transformers.Wav2Vec2Model(config).eval(), (torch.randn(2, 200),)


# In the sweep: every line these cover is covered by other CI tests (the Llama step's below and
# test_corpus's training cells among them).
@pytest.mark.sweep
@pytest.mark.parametrize("build", [_bert, _wav2vec2], ids=["bert", "wav2vec2"])
def test_transformers_training_step_matches_torch(tmp_path, build):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, inputs = build(torch, transformers)

    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, *args):
            return self.inner(*args).last_hidden_state

    net = Hidden().eval()
    path = _export(torch, net, inputs, tmp_path / "model.pt2")
    step = load_model(path, training=True)
    target = torch.randn(net(*inputs).shape)
    executable = driver.build_reference(step, tvm.target.Target("llvm"))
    arguments = [*(x.numpy() for x in inputs), target.numpy(), *step.random_params()]
    loss, *grads = driver.run(executable, arguments, tvm.cpu(), repeat=0).outputs

    expected = ((net(*inputs) - target) ** 2).mean()
    expected.backward()
    assert float(loss) == pytest.approx(expected.item(), rel=1e-5)
    to_param = torch.export.load(path).graph_signature.inputs_to_parameters
    params = dict(net.named_parameters())
    for name, grad in zip(step.config["gradients"], grads, strict=True):
        ref = params[to_param[name]].grad
        ref = np.zeros_like(grad) if ref is None else ref.numpy()
        np.testing.assert_allclose(grad, ref, rtol=1e-4, atol=1e-6, err_msg=name)


def test_an_autocast_onnx_model_is_judged_by_onnx_runtimes_float32(tmp_path, monkeypatch,
                                                                  capsys):
    """ONNX Runtime has no autocast: where a bfloat16 build misses the plain TVM build's
    tolerance, it passes only about as close to ONNX Runtime's float32 as that build is."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    from tvm_ext.cli import check, main

    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 16)).astype("float32")
    # 50 x the difference of two nearly equal products: bfloat16's rounding of each is far
    # past bfloat16's tolerance, here as in the plain build.
    nodes = [helper.make_node("MatMul", ["x", "a"], ["p"]),
             helper.make_node("MatMul", ["x", "b"], ["q"]),
             helper.make_node("Sub", ["p", "q"], ["d"]),
             helper.make_node("Mul", ["d", "k"], ["y"])]
    graph = helper.make_graph(
        nodes, "cancel", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])],
        [numpy_helper.from_array(w, "a"),
         numpy_helper.from_array(w + 0.01 * rng.standard_normal((32, 16)).astype("float32"),
                                 "b"),
         numpy_helper.from_array(np.array(50.0, "float32"), "k")])
    path = str(tmp_path / "cancel.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    assert main([path, "--dtype", "bf16", "--run", "--check"]) == 0
    assert "as close to ONNX Runtime float32 as the plain TVM build is" in \
        capsys.readouterr().out
    # Not excused where the build is farther from float32 than half the plain build's error.
    monkeypatch.setattr(check, "NOISE_FACTOR", 0.5)
    assert main([path, "--dtype", "bf16", "--run", "--check"]) == 1


def test_an_integer_onnx_clip_keeps_its_dtype(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    def constant(name, value):
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(
            np.array(value, "int64"), name))

    nodes = [constant("lo", 0), constant("hi", 5), helper.make_node("Clip", ["x", "lo", "hi"],
                                                                     ["y"])]
    graph = helper.make_graph(
        nodes, "clip", [helper.make_tensor_value_info("x", TensorProto.INT64, [6])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [6])])
    path = str(tmp_path / "clip_int.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    (out,) = _run(load_model(path), [np.array([-3, 0, 2, 5, 7, 9], "int64")])
    np.testing.assert_array_equal(out, [0, 0, 2, 5, 5, 5])
