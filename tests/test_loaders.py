"""Models from files: torch.export (.pt2), ONNX, Python; and clear errors for bad files."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import tvm

from tvm_ext import compiler
from tvm_ext.models import ModelLoadError, load_model


def _run(model, arguments):
    ex = compiler.build(model, tvm.target.Target("llvm"))
    return compiler.run(ex, arguments, tvm.cpu(), repeat=0).outputs


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


def test_onnx_matches_torch(torch_mlp, tmp_path):
    torch, net, x = torch_mlp
    pytest.importorskip("onnx")
    path = str(tmp_path / "mlp.onnx")
    torch.onnx.export(net, (x,), path, dynamo=False)
    model = load_model(path)
    (out,) = _run(model, [x.numpy(), *model.random_params()])
    np.testing.assert_allclose(out, net(x).detach().numpy(), rtol=1e-5, atol=1e-5)


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
