"""A training step through PyTorch's zeroed fully-masked rows (`tvm_ext.models.masked_softmax`):
a left-padded sequence under a causal mask has query rows that see no key; PyTorch gives them
zeros forward and a zero gradient, and so must the step (Relax's softmax gradient alone turns
every upstream gradient NaN)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_ext.models import masked_softmax
from tvm_ext.models.base import make_training_step


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """The corpus's left-padded Llama loaded as `compile.py` does, its inputs and labels, and
    PyTorch's loss and gradients by parameter name."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import corpus

    from tvm_ext.models.loaders import load_file

    module, inputs = corpus.llama("sdpa", left_padded=True)()
    path = str(tmp_path_factory.mktemp("masked") / "llama.pt2")
    with torch.no_grad():
        torch.export.save(torch.export.export(module, inputs), path)
    logits = module(*inputs)
    vocab = logits.shape[-1]
    labels = torch.randint(0, vocab, logits.shape[:-1], generator=torch.Generator().manual_seed(2))
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))
    loss.backward()
    grads = {"p_" + n.replace(".", "_"): p.grad.numpy() for n, p in module.named_parameters()}
    return (load_file(path), [*(x.numpy() for x in inputs), labels.numpy()], float(loss),
            grads)


def _step_outputs(model, arrays):
    step = make_training_step(model)
    vm = relax.VirtualMachine(tvm.compile(step.mod, target="llvm"), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in [*arrays, *model.weights]])
    return step, [o.numpy() for o in out]


def test_the_step_gives_pytorchs_gradients_through_the_empty_rows(padded):
    model, arrays, loss, grads = padded
    assert len(masked_softmax.zeroed_row_softmaxes(model.mod["main"])) == 2  # one a layer
    step, out = _step_outputs(model, arrays)
    assert abs(float(out[0]) - loss) < 1e-5 * abs(loss)
    names = step.config["gradients"]
    assert len(names) == len(out) - 1 == len(grads)
    for name, got in zip(names, out[1:], strict=True):
        assert np.isfinite(got).all(), name
        np.testing.assert_allclose(got, grads[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_without_the_rewrite_the_gradients_are_nan(padded, monkeypatch):
    """What the rewrite is for: softmax's gradient reading the NaN rows."""
    import tvm_ext.models.base as base

    model, arrays, _, _ = padded
    monkeypatch.setattr(base, "read_zeroed_rows", lambda step, names: step)
    _, out = _step_outputs(model, arrays)
    assert any(np.isnan(g).any() for g in out[1:])
