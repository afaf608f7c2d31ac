"""A `transformers` mixture of experts (Mixtral) as a user exports it: its file names
transformers' own custom op, which the loader registers; the import converts that op and
`histc`; the training step (its loss is the forward) matches torch.autograd."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")



class _Logits(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, ids):
        return self.inner(ids).logits


@pytest.fixture(scope="module")
def mixtral_pt2(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, max_position_embeddings=8,
        num_local_experts=4, num_experts_per_tok=2)
    model = _Logits(transformers.MixtralForCausalLM(config).eval())
    program = torch.export.export(model, (torch.randint(0, 64, (2, 8)),))
    ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "transformers.grouped_mm_fallback.default" in ops  # what this test is about
    path = tmp_path_factory.mktemp("moe") / "mixtral.pt2"
    torch.export.save(program, str(path))
    return path


def _load_in_fresh_process(*paths) -> list[str]:
    """What `load_program` says of each file in a process that has registered no op."""
    code = ("import sys; from tvm_ext.models.pt2_files import load_program\n"
            "for path in sys.argv[1:]:\n"
            "    try:\n        load_program(path); print('loaded')\n"
            "    except Exception as err:\n        print(type(err).__name__, err)\n")
    run = subprocess.run([sys.executable, "-c", code, *map(str, paths)], capture_output=True,
                         text=True, timeout=300, check=True)
    return [line for line in run.stdout.splitlines() if line.strip()][-len(paths):]


def test_the_loader_registers_transformers_custom_op_and_names_any_other(mixtral_pt2,
                                                                          tmp_path):
    lib = torch.library.Library("tvm_ext_test_ops", "DEF")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")

    class Net(torch.nn.Module):
        def forward(self, x):
            return torch.ops.tvm_ext_test_ops.twice(x) + 1

    custom = tmp_path / "custom.pt2"
    torch.export.save(torch.export.export(Net(), (torch.randn(3),)), str(custom))
    # This process registered both ops when it built the models; a user's process has not.
    mixtral, other = _load_in_fresh_process(mixtral_pt2, custom)
    assert mixtral == "loaded"
    assert other.startswith("Pt2ParseError") and "custom op tvm_ext_test_ops::twice" in other


def test_mixtral_training_step_matches_pytorch(mixtral_pt2):
    """The loss (the forward) and the gradients (the experts', and the router's through
    top-k) against torch.autograd on the same weights and batch."""
    import numpy as np
    import tvm

    from tvm_ext import driver
    from tvm_ext.models import load_model
    from tvm_ext.models.reference import tolerance, torch_training_step

    step = load_model(str(mixtral_pt2), training=True)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 64, (2, 8)).astype("int64")
    labels = rng.standard_normal((2, 8, 64)).astype("float32")
    params = step.random_params()
    executable = driver.build(step, tvm.target.Target("llvm"))
    ours = driver.run(executable, [ids, labels, *params], tvm.cpu(), repeat=0).outputs
    expected = torch_training_step(str(mixtral_pt2), [ids], labels, params,
                                   [p.name for p in step.params], step.config["gradients"])
    assert len(ours) == len(expected) == 1 + len(step.config["gradients"])
    rtol, atol = tolerance("float32")
    for name, got, want in zip(["loss", *step.config["gradients"]], ours, expected,
                               strict=True):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=name)
