"""--check where an output misses its dtype's fixed tolerance: PyTorch at a higher precision
(float64; float32 for an autocast model) judges whether this build is about as close to it as
PyTorch's own outputs are (`cli.check._within_pytorch_noise`)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from tvm_ext.cli import check
from tvm_ext.models import reference


def _case(tmp_path, monkeypatch, exact, training=False, autocast=False):
    """A stand-in .pt2 model whose higher-precision PyTorch run gives `exact`; records the
    calls made."""
    path = tmp_path / "net.pt2"
    path.write_bytes(b"")
    calls = []

    def run(*args, **kwargs):
        calls.append(kwargs)
        return exact

    monkeypatch.setattr(reference, "torch_reference", run)
    monkeypatch.setattr(reference, "torch_training_step", run)
    config = {"gradients": ["w"]} if training else {}
    if autocast:
        config.update(autocast=True, compute_dtype="bfloat16")
    model = types.SimpleNamespace(config=config, num_input=2 if training else 1,
                                  params=[types.SimpleNamespace(name="w")], training=training)
    args = types.SimpleNamespace(model=str(path), rtol=None, atol=None)
    arguments = [np.zeros(3, "float32")] * (model.num_input + 1)
    return (lambda outputs, expected: check._within_pytorch_noise(
        args, model, arguments, outputs, expected)), calls


def test_a_build_as_close_to_float64_as_pytorch_passes_and_one_farther_does_not(
        tmp_path, monkeypatch):
    exact = [np.array([1.0, 2.0, 3.0])]
    judge, calls = _case(tmp_path, monkeypatch, exact)
    torch_out = [np.array([1.0, 2.004, 3.0], "float32")]
    noise = judge([np.array([1.003, 2.0, 3.0], "float32")], torch_out)
    assert noise["reference"] == "PyTorch float64"
    assert noise["ours"] == pytest.approx(0.003, rel=1e-3)
    assert noise["torch"] == pytest.approx(0.004, rel=1e-3)
    assert calls == [{"float64": True}]
    # More than twice PyTorch's own distance from float64: a verdict against the build.
    assert judge([np.array([1.0, 2.0, 3.009], "float32")], torch_out) is None
    # Every output must be: one that is too far fails them all.
    two = [exact[0], exact[0]]
    judge, _ = _case(tmp_path, monkeypatch, two)
    assert judge([exact[0], exact[0] + 1], [exact[0] + 1e-3, exact[0] + 1e-3]) is None


def test_a_training_step_is_judged_by_its_float64_gradients_and_autocast_by_float32(
        tmp_path, monkeypatch):
    exact = [np.array(0.5), np.array([1.0, -1.0])]
    judge, calls = _case(tmp_path, monkeypatch, exact, training=True)
    assert judge([np.array(0.5), np.array([1.001, -1.0])],
                 [np.array(0.5), np.array([1.0, -1.002])]) is not None
    assert calls == [{"float64": True}]
    judge, calls = _case(tmp_path, monkeypatch, [np.array([4.0])], autocast=True)
    noise = judge([np.array([4.01])], [np.array([4.03])])
    assert noise["reference"] == "PyTorch float32" and calls == [{}]


def test_pytorch_runs_an_exported_program_in_float64(tmp_path):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                              torch.nn.Linear(16, 4))
    x = torch.randn(3, 8)
    path = str(tmp_path / "net.pt2")
    torch.export.save(torch.export.export(net, (x,)), path)
    params = [p.detach().numpy() for p in net.parameters()]
    names = [f"p_{n.replace('.', '_')}" for n, _ in net.named_parameters()]
    (out32,) = reference.torch_reference(path, [x.numpy()], params, names)
    (out64,) = reference.torch_reference(path, [x.numpy()], params, names, float64=True)
    assert out32.dtype == np.float32 and out64.dtype == np.float64
    expected = net.double()(x.double()).detach().numpy()
    np.testing.assert_allclose(out64, expected, rtol=1e-12)
    labels = np.zeros((3, 4), "float32")
    loss, *grads = reference.torch_training_step(path, [x.numpy()], labels, params, names,
                                                 names, float64=True)
    assert loss.dtype == np.float64 and all(g.dtype == np.float64 for g in grads)
    assert float(loss) == pytest.approx(float((expected ** 2).mean()), rel=1e-12)


def test_only_tensors_that_miss_the_tolerance_are_judged_and_one_must():
    exact = [np.array([1.0, 2.0]), np.array([5.0])]
    torch_out = [np.array([1.0, 2.0]), np.array([5.1])]
    tol = [(1e-4, 1e-5)] * 2
    # The first meets the tolerance (its tiny distances are not compared); the second is
    # closer to float64 than PyTorch's.
    noise = check.noise_verdict([np.array([1.0, 2.0 + 1e-9]), np.array([5.05])], torch_out,
                                torch_out, exact, tol, "PyTorch float64")
    assert noise == {"reference": "PyTorch float64", "ours": pytest.approx(0.05),
                     "torch": pytest.approx(0.1)}
    # Nothing missed the tolerance: nothing to excuse, no verdict from here.
    assert check.noise_verdict(torch_out, torch_out, torch_out, exact, tol, "x") is None
    # Against another build: the yardstick is still PyTorch's own distance from float64.
    other = [np.array([1.0, 2.0]), np.array([5.0])]
    assert check.noise_verdict([np.array([1.0, 2.0]), np.array([5.15])], other, torch_out,
                               exact, tol, "x")["torch"] == pytest.approx(0.1)
    assert check.noise_verdict([np.array([1.0, 2.0]), np.array([5.25])], other, torch_out,
                               exact, tol, "x") is None
    # Shapes that differ are not compared.
    assert check.noise_verdict([np.array([1.0])], torch_out[:1], torch_out[:1], exact[:1],
                               tol[:1], "x") is None


def test_neighbours_widen_the_yardstick_only_where_needed_and_as_far_as_they_reach():
    exact = [np.array([1.0]), np.array([5.0])]
    torch_out = [np.array([1.0]), np.array([5.001])]  # lucky at this point: 1e-3 off
    tol = [(1e-4, 1e-5)] * 2
    ours = [np.array([1.0]), np.array([5.05])]
    runs = []

    def neighbours():  # float32's error at points one rounding step away: 0.01, then 0.04
        for err in (0.01, 0.04, 0.5):
            runs.append(err)
            yield [np.array([1.0]), np.array([7.0 + err])], [np.array([1.0]), np.array([7.0])]

    assert check.noise_verdict(ours, torch_out, torch_out, exact, tol, "x") is None
    noise = check.noise_verdict(ours, torch_out, torch_out, exact, tol, "x", neighbours)
    # 0.05 <= 2 x 0.04: the second neighbour decides, the third is never run.
    assert noise == {"reference": "x", "ours": pytest.approx(0.05),
                     "torch": pytest.approx(0.04), "neighbours": 2}
    assert runs == [0.01, 0.04]
    assert "one rounding step from these (2 tried)" in check.near_line(noise)
    # Further than any neighbour's float32: still refused, after trying them all.
    runs.clear()
    far = [np.array([1.0]), np.array([6.5])]
    assert check.noise_verdict(far, torch_out, torch_out, exact, tol, "x", neighbours) is None
    assert runs == [0.01, 0.04, 0.5]
    # Within PyTorch's own error at this point: no neighbour is run.
    runs.clear()
    assert check.noise_verdict([np.array([1.0]), np.array([5.0015])], exact, torch_out,
                               exact, tol, "x", neighbours)["torch"] == pytest.approx(1e-3)
    assert runs == []


def test_ulp_neighbours_move_each_float32_element_one_representable_step():
    params = [np.array([1.0, 0.0, -3.5, 1e30], np.float32), np.arange(3, dtype=np.int64),
              np.array([2.0], np.float64)]
    near = list(check.ulp_neighbours(params, count=3))
    assert len(near) == 3
    directions = set()
    for values in near:
        moved = values[0]
        assert moved.dtype == np.float32
        up = np.nextafter(params[0], np.float32(np.inf))
        down = np.nextafter(params[0], np.float32(-np.inf))
        assert np.all((moved == up) | (moved == down))
        directions |= {bool(b) for b in moved == up}
        assert values[1] is params[1] and values[2] is params[2]
    assert directions == {True, False}
