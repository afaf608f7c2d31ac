"""scripts/compile.py --training --optimizer: N steps printed and checked against torch.optim
(tvm_ext/cli/training.py), and the options that would do nothing refused."""

from __future__ import annotations

import json

import pytest

from tvm_ext.cli import main


def test_zoo_steps_run_and_check(tmp_path, capsys):
    report = tmp_path / "r.json"
    argv = ["mlp", "--training", "--optimizer", "adamw", "--lr", "1e-2", "--steps", "3",
            "--run", "--check", "--report", str(report)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "adamw (lr 0.01, betas (0.9, 0.999), eps 1e-08, weight decay 0.01)" in out
    assert all(f"step {i} " in out for i in (1, 2, 3)) and "loss falls" in out
    assert "check   OK: 3 steps match torch.optim with gradients by a plain TVM build" in out
    data = json.loads(report.read_text())
    assert data["training"]["loss_falls"] and len(data["training"]["losses"]) == 3
    assert data["check"]["ok"] and data["model_summary"]["config"]["optimizer"]["kind"] == \
        "adamw"


@pytest.fixture(scope="module")
def pt2_net(tmp_path_factory):
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(8, 16)
            self.fc2 = torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("pt2") / "net.pt2"
    torch.export.save(torch.export.export(Net(), (torch.randn(3, 8),)), str(path))
    return path


def test_pt2_steps_check_against_torch_optim(pt2_net, capsys):
    argv = [str(pt2_net), "--training", "--optimizer", "momentum", "--lr", "0.1",
            "--momentum", "0.8", "--weight-decay", "0.01", "--check"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "check   OK: 5 steps match torch.optim with gradients by PyTorch" in out


@pytest.mark.parametrize("argv, message", [
    (["mlp", "--optimizer", "sgd"], "--optimizer adds the update to the training step: it "
     "needs --training"),
    (["mlp", "--training", "--lr", "0.1"], "--lr applies to an optimizer step: it needs "
     "--optimizer"),
    (["mlp", "--training", "--optimizer", "adam", "--momentum", "0.9"],
     "--momentum does nothing with --optimizer adam"),
    (["mlp", "--training", "--optimizer", "sgd", "--eps", "1e-6"],
     "--eps does nothing with --optimizer sgd"),
    (["mlp", "--training", "--optimizer", "sgd", "--steps", "3"],
     "--steps runs the optimizer step N times: it needs --run or --check"),
    (["mlp", "--training", "--optimizer", "sgd", "--steps", "0", "--run"],
     "--steps takes a number of steps >= 1"),
    (["mlp", "--training", "--optimizer", "adam", "--betas", "0.9"], "--betas 0.9: takes two"),
    (["mlp", "--training", "--optimizer", "adam", "--lr", "-1"], "--lr takes a number >= 0"),
    (["mlp", "--training", "--dtype", "bf16"], "--dtype of a training step computes it in mixed "
                                               "precision for an optimizer step"),
])
def test_idle_training_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert f"compile.py: error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("mode, expected", [
    # At 25% Adam's two largest updates run in chunks (in place, from and back into their
    # host buffers): still the same kernels' arithmetic, exactly.
    (["--device-memory", "25%"], "equal the unswapped build exactly (losses, parameters, "
     "state), every step within the budget, host memory constant"),
    (["--devices", "2", "--device-memory", "50%"], "match the single-device build (losses, "
     "parameters, state within 1e-5), every worker within the budget, host memory constant"),
])
def test_swapped_and_partitioned_steps(mode, expected, capsys):
    argv = ["mlp", "--training", "--optimizer", "adam", "--steps", "3", "--check", *mode]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"check   OK: 3 steps {expected}" in out
    assert "check   OK: 3 steps match torch.optim" in out


def test_bf16_steps_track_the_float32_curve(capsys):
    argv = ["mlp", "--training", "--optimizer", "adamw", "--lr", "1e-2", "--dtype", "bf16",
            "--check"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "GEMMs and convolutions in bf16" in out
    assert "check   OK: 5 bf16 losses track the float32 curve of torch.optim" in out



def test_tied_weights_train_as_one_parameter(tmp_path, capsys):
    """A language model's head tied to its embedding: the export keeps both names; the module
    takes the tensor once, its gradient sums both uses, and AdamW's steps match torch.optim
    on the tied module."""
    torch = pytest.importorskip("torch")
    from tvm_ext.models import load_model

    class TiedHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(16, 8)
            self.head = torch.nn.Linear(8, 16, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(torch.tanh(self.embed(ids)))

    torch.manual_seed(0)
    path = tmp_path / "tied.pt2"
    torch.export.save(torch.export.export(TiedHead(), (torch.zeros(2, 5, dtype=torch.long),)),
                      str(path))
    model = load_model(str(path))
    assert [p.name for p in model.params] == ["p_embed_weight"]
    assert model.config["tied_parameters"] == {"p_head_weight": "p_embed_weight"}
    argv = [str(path), "--training", "--optimizer", "adamw", "--lr", "0.05", "--check"]
    assert main(argv) == 0
    assert "check   OK: 5 steps match torch.optim" in capsys.readouterr().out


def test_a_float16_model_is_checked_at_float16_tolerance(tmp_path, capsys):
    """A model whose weights are float16: momentum SGD's updates differ from torch.optim's by
    an ulp of float16, within float16's tolerance (1e-2 / 1e-3), not float32's. AdamW's go to
    NaN on both sides (its eps, 1e-8, is 0 in float16: a zero gradient element divides 0 by
    0), which the check refuses to call a match."""
    pytest.importorskip("torch")
    import corpus

    path, _ = corpus.export(corpus.BY_NAME["linear_fp16"], str(tmp_path))
    argv = [path, "--training", "--optimizer", "momentum", "--check"]
    assert main(argv) == 0
    assert "check   OK: 5 steps match torch.optim" in capsys.readouterr().out
    assert main([*argv, "--rtol", "1e-5", "--atol", "1e-5"]) == 1
    assert main([path, "--training", "--optimizer", "adamw", "--check"]) == 1
    assert "a check of non-finite steps proves nothing" in capsys.readouterr().err


def test_steps_that_part_from_the_reference_pass_only_step_by_step(zoo_cache, capsys,
                                                                   monkeypatch):
    """Correct Adam steps can part from torch.optim's over several (a rounding-noise gradient
    becomes a step of lr either way): they pass if each step, from this build's own values,
    matches torch.optim's step from them; a wrong step fails, named."""
    import numpy as np

    from tvm_ext import driver
    from tvm_ext.cli import build_parser
    from tvm_ext.cli.training import check_training, match_build, reference_of, run_steps
    from tvm_ext.errors import CheckError
    from tvm_ext.models.optimizer import Optimizer, make_optimizer_step

    args = build_parser().parse_args(["mlp", "--training", "--optimizer", "adamw", "--lr",
                                      "1e-2", "--steps", "3", "--check", "--dtype", "fp32"])
    target = driver.resolve_target("llvm")
    gradient_model = zoo_cache("mlp", True)
    step = make_optimizer_step(gradient_model, Optimizer("adamw", lr=1e-2))
    session = driver.TrainingSession(driver.build(step, target), step, driver.device_of(target))
    batch = step.random_inputs(args.seed)
    with monkeypatch.context() as patch:  # a model too large to keep its values every step
        patch.setattr("tvm_ext.cli.training.TRAIL_BYTES", 1)
        assert run_steps(session, batch, args)[1] is None
    session = driver.TrainingSession(driver.build(step, target), step, driver.device_of(target))
    results, trail = run_steps(session, batch, args)
    assert len(trail) == 3
    # The steps of another batch stand in for a reference the steps have parted from.
    parted = reference_of(args, step, gradient_model, target, step.random_inputs(7), 3)

    def check(trail):
        report: dict = {}
        status = check_training(args, report, step, gradient_model, target, batch, results,
                                *trail[-1], parted, trail)
        return status, report["check"], capsys.readouterr()

    status, report, out = check(trail)
    assert status == 0 and report["ok"] and report["step_by_step"]["steps"] == 3
    assert "check   OK: each of 3 steps" in out.out and "over 3 steps the two part" in out.out
    wrong = [(list(p), s) for p, s in trail]
    wrong[1][0][0] = wrong[1][0][0] + np.float32(1e-3)  # the second step's first parameter
    status, report, out = check(wrong)
    assert status == 1 and not report["ok"]
    assert "step 2 differs from torch.optim's step from the same values" in out.err

    # Against another build (a partitioned or swapped step's check): the same judgement.
    other = driver.TrainingSession(driver.build(step, target), step, driver.device_of(target))
    expected = other.run([step.random_inputs(7)] * 3)
    with pytest.raises(CheckError):
        match_build(args, results, *trail[-1], expected, other, parted, 1e-5, 1e-5,
                    gradient_model, batch)
    assert match_build(args, results, *trail[-1], expected, other, parted, 1e-5, 1e-5,
                       gradient_model, batch, target, trail).steps == 3
    assert "each, taken from this build's own parameters and state, matches" in \
        capsys.readouterr().out
    with pytest.raises(CheckError, match="step 2 differs"):
        match_build(args, results, *trail[-1], expected, other, parted, 1e-5, 1e-5,
                    gradient_model, batch, target, wrong)


def test_a_step_that_misses_is_judged_by_float64_from_its_own_values(pt2_net, monkeypatch):
    """Step by step, a step that misses torch.optim's is judged by float64 from the values
    before it, against torch.optim's float32 there and, where that is too narrow, at
    parameters one rounding step away; over several steps that widening is never used (a
    neighbour's trajectory can part without bound)."""
    import numpy as np

    from tvm_ext import driver
    from tvm_ext.cli import build_parser, check
    from tvm_ext.cli import training as cli_training
    from tvm_ext.models import load_model
    from tvm_ext.models.optimizer import Optimizer, make_optimizer_step

    args = build_parser().parse_args([str(pt2_net), "--training", "--optimizer", "adamw",
                                      "--lr", "1e-2", "--steps", "3", "--check"])
    target = driver.resolve_target("llvm")
    gradient_model = load_model(str(pt2_net), training=True)
    step = make_optimizer_step(gradient_model, Optimizer("adamw", lr=1e-2))
    session = driver.TrainingSession(driver.build(step, target), step, driver.device_of(target))
    batch = step.random_inputs(args.seed)
    results, trail = cli_training.run_steps(session, batch, args)
    wrong = [(list(p), s) for p, s in trail]
    wrong[1][0][0] = wrong[1][0][0] + np.float32(1e-3)  # the second step's first parameter
    starts = []

    def spy(params, *rest):
        starts.append([np.array(p) for p in params])
        yield from check.ulp_neighbours(params, *rest)

    monkeypatch.setattr(cli_training, "ulp_neighbours", spy)
    monkeypatch.setattr(check, "NOISE_FACTOR", 0.0)  # nothing is that close: refused
    verdict = cli_training._step_by_step(args, step, gradient_model, target, batch, results,
                                         wrong, 1e-4, 1e-5)
    assert isinstance(verdict, str) and verdict.startswith("step 2 differs")
    # Judged once, at step 2, from the values step 1 left.
    assert len(starts) == 1
    assert all(np.array_equal(a, b) for a, b in zip(starts[0], trail[0][0], strict=True))
    monkeypatch.setattr(check, "NOISE_FACTOR", 1e30)  # everything is: the step passes
    verdict = cli_training._step_by_step(args, step, gradient_model, target, batch, results,
                                         wrong, 1e-4, 1e-5)
    assert isinstance(verdict, driver.training.TrainingCheck)
    assert verdict.steps == 3 and verdict.step_by_step
    # Over the three steps from the start: no neighbours.
    starts.clear()
    monkeypatch.setattr(check, "NOISE_FACTOR", 0.0)
    parted = cli_training.reference_of(args, step, gradient_model, target,
                                       step.random_inputs(7), 3)[0]
    assert cli_training._within_float64_noise(args, step, gradient_model, batch, results,
                                              *trail[-1], parted, 1e-4, 1e-5) is None
    assert starts == []
