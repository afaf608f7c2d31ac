"""Inference with torch.autocast's policy (`tvm_ext.models.autocast`, `--dtype bf16|fp16`
without `--training`): the rewrite op by op, its refusals, and whole corpus models checked
against PyTorch eager under `torch.autocast`."""

from __future__ import annotations

import json
import os

import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_ext import cli
from tvm_ext.errors import InputError
from tvm_ext.models import get_model
from tvm_ext.models.autocast import autocast_inference
from tvm_ext.models.base import make_training_step, model_from_function


def _model(func: relax.Function, num_input: int = 1):
    return model_from_function("m", func, num_input)


def _main(mod: tvm.IRModule) -> relax.Function:
    return mod["main"].with_attr("global_symbol", "main")


def test_gemms_take_low_operands_and_round_once_after_their_bias():
    """The bias add joins the GEMM's float32 result; the softmax (float32) reads it unrounded,
    the GELU rounded; a float32 and a bfloat16 tensor meet in float32, a 0-d float32 constant
    takes the tensor's bfloat16."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 3), "float32"), w: R.Tensor((4, 3), "float32"),
                 b: R.Tensor((4,), "float32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                lv = R.permute_dims(w)
                y = R.matmul(x, lv)
                z = R.add(y, b)
                s = R.nn.softmax(z)
                h = R.nn.gelu(z)
                t = R.add(s, h)
                u = R.multiply(h, R.const(0.5, "float32"))
                gv = (t, u)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 3), "float32"), w: R.Tensor((4, 3), "float32"),
                 b: R.Tensor((4,), "float32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                lv = R.permute_dims(w)
                x1 = R.astype(x, "bfloat16")
                lv1 = R.astype(lv, "bfloat16")
                y = R.matmul(x1, lv1, out_dtype="float32")
                z = R.add(y, b)
                s = R.nn.softmax(z)
                z1 = R.astype(z, "bfloat16")
                h = R.nn.gelu(z1)
                h1 = R.astype(h, "float32")
                t = R.add(s, h1)
                half = R.astype(R.const(0.5, "float32"), "bfloat16")
                u = R.multiply(h, half)
                gv = (t, u)
                R.output(gv)
            return gv

    after = autocast_inference(_model(Before["main"]), "bf16")
    tvm.ir.assert_structural_equal(_main(after.mod), _model(Expected["main"]).main)
    assert after.config["compute_dtype"] == "bfloat16" and after.config["autocast"]


def test_only_a_bias_joins_a_convolutions_float32_result():
    """A per-channel bias joins the convolution's float32 result; a tensor from the weights
    alone that is not one value per channel (RAFT adds its constant pixel grid to a predicted
    flow) meets the rounded result, in float32: coordinates in bfloat16 would step by 1/16
    of a pixel."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 3, 4, 4), "float32"), w: R.Tensor((2, 3, 1, 1), "float32"),
                 b: R.Tensor((1, 2, 1, 1), "float32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                y = R.nn.conv2d(x, w)
                z = R.add(y, b)
                grid = R.add(R.const(0.0, "float32"), R.ones((1, 2, 4, 4), "float32"))
                c = R.add(z, grid)
                gv = R.nn.relu(c)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 3, 4, 4), "float32"), w: R.Tensor((2, 3, 1, 1), "float32"),
                 b: R.Tensor((1, 2, 1, 1), "float32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                x1 = R.astype(x, "bfloat16")
                w1 = R.astype(w, "bfloat16")
                y = R.nn.conv2d(x1, w1, out_dtype="float32")
                z = R.add(y, b)
                grid = R.add(R.const(0.0, "float32"), R.ones((1, 2, 4, 4), "float32"))
                z1 = R.astype(z, "bfloat16")
                z2 = R.astype(z1, "float32")
                c = R.add(z2, grid)
                gv = R.nn.relu(c)
                R.output(gv)
            return gv

    after = autocast_inference(_model(Before["main"]), "bf16")
    tvm.ir.assert_structural_equal(_main(after.mod), _model(Expected["main"]).main)


def test_a_returned_gemm_result_is_rounded_and_weights_feed_a_gemm_cast():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 3), "float32"), w: R.Tensor((3, 4), "float32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                gv = R.matmul(x, w)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 3), "float32"), w: R.Tensor((3, 4), "float32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                x1 = R.astype(x, "float16")
                w1 = R.astype(w, "float16")
                y = R.matmul(x1, w1, out_dtype="float32")
                gv = R.astype(y, "float16")
                R.output(gv)
            return gv

    after = autocast_inference(_model(Before["main"]), "fp16")
    tvm.ir.assert_structural_equal(_main(after.mod), _model(Expected["main"]).main)


def test_norms_compute_in_float32_and_every_convolution_in_the_low_dtype():
    model = autocast_inference(get_model("resnet", "tiny"), "bf16")
    convs, norms = [], []

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            if expr.op.name == "relax.nn.conv2d":
                convs.append((str(expr.args[0].ty.dtype), str(expr.args[1].ty.dtype),
                              str(expr.ty.dtype)))
            elif expr.op.name == "relax.nn.batch_norm":
                norms.append(str(expr.args[0].ty.dtype))

    relax.analysis.post_order_visit(model.main, visit)
    assert convs and set(convs) == {("bfloat16", "bfloat16", "float32")}
    assert norms and set(norms) == {"float32"}


def test_an_autocast_models_float_outputs_are_checked_at_its_low_dtypes_tolerance():
    """Its float32 outputs carry bfloat16 roundings: their tolerance is raised to bfloat16's;
    an integer output stays exact, and a tolerance above the floor is kept."""
    from tvm_ext.models.reference import TOLERANCES, tolerance

    low = TOLERANCES["bfloat16"]
    assert tolerance("float32", low) == low
    assert tolerance("float32") == TOLERANCES["float32"]
    assert tolerance("int64", low) == (0.0, 0.0)
    assert tolerance("float16", (1e-3, 1e-2)) == (TOLERANCES["float16"][0], 1e-2)


def test_what_autocast_cannot_change_is_refused():
    @I.ir_module
    class NoGemm:
        @R.function
        def main(x: R.Tensor((2, 3), "float32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                gv = R.nn.relu(x)
                R.output(gv)
            return gv

    with pytest.raises(InputError, match="no matmul or convolution to compute in bfloat16"):
        autocast_inference(_model(NoGemm["main"]), "bf16")
    step = make_training_step(get_model("mlp", "tiny"), loss="mse")
    with pytest.raises(InputError, match="autocast applies to inference"):
        autocast_inference(step, "bf16")
    with pytest.raises(InputError, match="unknown compute dtype"):
        autocast_inference(get_model("mlp", "tiny"), "int8")


@pytest.mark.parametrize("name, dtype", [("gpt2_eager", "bf16"), ("resnet", "fp16"),
                                         ("olmo2", "bf16"), ("albert", "bf16")])
def test_corpus_models_match_pytorch_under_autocast(name, dtype, tmp_path):
    torch = pytest.importorskip("torch")  # noqa: F841
    corpus = pytest.importorskip("corpus")
    path, _ = corpus.export(corpus.BY_NAME[name], str(tmp_path))
    report = tmp_path / "report.json"
    assert cli.main([path, "--dtype", dtype, "--run", "--check", "--report",
                     str(report)]) == 0
    check = json.loads(report.read_text())["check"]
    low = {"bf16": "bfloat16", "fp16": "float16"}[dtype]
    assert check["ok"] and check["torch"]["ok"]
    assert check["torch"]["reference"].startswith(f"PyTorch eager under autocast to {low}")
    rtol = {"bf16": 5e-2, "fp16": 1e-2}[dtype]
    assert {r for r, _ in check["torch"]["tolerances"].values()} == {rtol}


def test_a_bf16_inference_compiles_for_cuda(cuda_target, tmp_path):
    out = str(tmp_path / "gpt_bf16.so")
    assert cli.main(["gpt", "--dtype", "bf16", "--target", "cuda", "--output", out]) == 0
    assert os.path.getsize(out) > 0


def test_a_swapped_bf16_inference_equals_the_unswapped_build(tmp_path):
    report = tmp_path / "report.json"
    assert cli.main(["gpt", "--dtype", "bf16", "--device-memory", "50%", "--swap-time-budget",
                     "1", "--run", "--check", "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["check"]["ok"] and data["check"]["within_budget"]
    assert data["model_summary"]["config"]["compute_dtype"] == "bfloat16"


def _bf16_torch_check(torch, program, tmp_path, name: str) -> dict:
    """The report's PyTorch entry of `compile.py FILE --dtype bf16 --run --check` on the
    exported `program`, saved as `name`; the run must pass."""
    path = str(tmp_path / name)
    torch.export.save(program, path)
    report = tmp_path / "report.json"
    assert cli.main([path, "--dtype", "bf16", "--run", "--check", "--report",
                     str(report)]) == 0
    return json.loads(report.read_text())["check"]["torch"]


def test_pytorch_under_autocast_runs_exported_casts_and_is_compared_by_value(tmp_path):
    """An RMSNorm's `x.to(torch.float32)` exports with a check that its input is float32,
    which autocast makes bfloat16 (Olmo2, Gemma2 failed there): the reference runs without
    those checks. A final layer norm of a product is float32 here (CUDA autocast's policy)
    and bfloat16 from torch's CPU autocast (ALBERT): compared in float32, and said."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 16)
            self.out = torch.nn.Linear(16, 16)
            self.norm = torch.nn.LayerNorm(16)

        def forward(self, x):
            h = self.fc(x).to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            return self.norm(self.out(h))

    x = torch.randn(4, 16)
    program = torch.export.export(Net().eval(), (x,))
    assert any("_assert_tensor_metadata" in str(n.target) for n in program.graph.nodes)
    torch_check = _bf16_torch_check(torch, program, tmp_path, "net.pt2")
    assert torch_check["ok"]
    assert torch_check["dtype_notes"] == [
        "output 0 is float32 here, bfloat16 from PyTorch (its CPU autocast keeps some ops, "
        "layer norms, in the low dtype)"]


def test_pytorch_under_autocast_fills_with_its_low_dtypes_own_extreme(tmp_path):
    """SEW-D masks attention scores with `torch.finfo(scores.dtype).min`: exported, that is
    float32's, which autocast's bfloat16 scores cannot hold (PyTorch refuses the fill); run
    eagerly, the model fills with bfloat16's. The reference clamps a fill to its tensor's
    range, as the eager model computes it."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(16, 16)
            self.k = torch.nn.Linear(16, 16)

        def forward(self, x, mask):
            scores = self.q(x) @ self.k(x).transpose(-1, -2)
            low = torch.tensor(torch.finfo(scores.dtype).min)
            return torch.softmax(scores.masked_fill(~mask, low), -1)

    net = Net().eval()
    x, mask = torch.randn(2, 8, 16), torch.rand(2, 8, 8) > 0.3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        net(x, mask)  # the eager model runs under autocast
    program = torch.export.export(net, (x, mask))
    assert _bf16_torch_check(torch, program, tmp_path, "fill.pt2")["ok"]


def test_a_model_pytorchs_autocast_cannot_run_is_checked_against_float32_and_said(tmp_path):
    """BigBird scatters a product (bfloat16 under autocast) into a float32 tensor, which
    PyTorch's own autocast refuses, eager or exported: the check compares with PyTorch's
    float32 run at bfloat16's tolerance instead, and says so."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 16)

        def forward(self, x):
            rows = torch.tensor([[2, 0, 3, 1]]).expand(16, 4).t()
            return torch.zeros(4, 16).scatter(0, rows, self.fc(x))

    net, x = Net().eval(), torch.randn(4, 16)
    with pytest.raises(RuntimeError, match="scatter"), torch.autocast("cpu",
                                                                      dtype=torch.bfloat16):
        net(x)
    torch_check = _bf16_torch_check(torch, torch.export.export(net, (x,)), tmp_path,
                                    "scatter.pt2")
    assert torch_check["ok"] and "scatter" in torch_check["autocast_error"]
    assert torch_check["reference"] == "PyTorch eager in float32 (scatter.pt2)"


def _cancelling_net(torch, tmp_path) -> str:
    """50 x the difference of two nearly equal linear layers: bfloat16's rounding of each,
    in PyTorch's autocast as here, is far past bfloat16's fixed tolerance."""
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(32, 16)
            self.b = torch.nn.Linear(32, 16)
            with torch.no_grad():
                self.b.weight.copy_(self.a.weight + 0.01 * torch.randn(16, 32))
                self.b.bias.copy_(self.a.bias)

        def forward(self, x):
            return (self.a(x) - self.b(x)) * 50

    path = str(tmp_path / "cancel.pt2")
    torch.export.save(torch.export.export(Net().eval(), (torch.randn(4, 32),)), path)
    return path


def test_where_pytorchs_own_autocast_misses_the_tolerance_its_distance_from_float32_judges(
        tmp_path, monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    from tvm_ext.models import reference

    path = _cancelling_net(torch, tmp_path)
    report = tmp_path / "report.json"
    assert cli.main([path, "--dtype", "bf16", "--run", "--check", "--report",
                     str(report)]) == 0
    check = json.loads(report.read_text())["check"]
    noise = check["torch"]["noise"]
    assert "elements beyond rtol=0.05" in check["torch"]["error"]  # the fixed tolerance misses
    assert noise["reference"] == "PyTorch float32"
    assert 0 < noise["ours"] <= 2 * noise["torch"]
    assert "as close to PyTorch float32 as PyTorch's own autocast is" in \
        capsys.readouterr().out
    # Not excused where PyTorch's autocast would be exact: its run made float32's.
    real = reference.torch_reference
    monkeypatch.setattr(reference, "torch_reference",
                        lambda *args, autocast=None, **kw: real(*args, **kw))
    assert cli.main([path, "--dtype", "bf16", "--run", "--check"]) == 1
