"""PyTorch's run of an exported program (the `--check` reference) with gradients, where the
program was exported without them: a `view` the export kept can meet a tensor it cannot view
(`reference._views_as_reshapes`), and an in-place write can overwrite what autograd saved
(the program's functional form is run then)."""

from __future__ import annotations

import numpy as np
import pytest

from tvm_ext.models import reference


def _attention(torch):
    """Attention with a relative position bias (Data2VecVision's), whose `.contiguous()` before the
    final `view` a no-grad export drops: sdpa's output is contiguous after the permute then,
    and is not with gradients."""
    functional = torch.nn.functional

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (torch.nn.Linear(16, 16) for _ in range(3))
            self.table = torch.nn.Parameter(torch.randn(9, 2))
            self.register_buffer("index", torch.randint(0, 9, (5, 5)))

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = (f(x).view(b, t, 2, 8).transpose(1, 2) for f in (self.q, self.k, self.v))
            bias = self.table[self.index.view(-1)].view(5, 5, 2).permute(2, 0, 1).contiguous()
            y = functional.scaled_dot_product_attention(q, k, v, attn_mask=bias.unsqueeze(0),
                                                        scale=0.35)
            return y.permute(0, 2, 1, 3).contiguous().view(b, t, 16)

    return Attention().eval()


def test_a_training_reference_runs_a_view_the_no_grad_export_kept(tmp_path):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net, x = _attention(torch), torch.randn(2, 5, 16)
    with torch.no_grad():
        program = torch.export.export(net, (x,))
    with pytest.raises(RuntimeError, match="view size"):  # the program as exported
        program.module()(x).sum().backward()
    path = str(tmp_path / "attention.pt2")
    torch.export.save(program, path)
    params = [p.detach().numpy() for p in net.parameters()]
    names = [f"p_{n.replace('.', '_')}" for n, _ in net.named_parameters()]
    labels = np.zeros((2, 5, 16), "float32")
    loss, *grads = reference.torch_training_step(path, [x.numpy()], labels, params, names, names)
    value = (net(x) ** 2).mean()
    want = torch.autograd.grad(value, list(net.parameters()))
    assert float(loss) == pytest.approx(float(value), rel=1e-6)
    for got, exp in zip(grads, want, strict=True):
        np.testing.assert_allclose(got, exp.numpy(), rtol=1e-5, atol=1e-7)


def test_a_training_reference_runs_a_program_that_writes_what_autograd_saved(tmp_path):
    """RWKV's exported state update, in small: a tensor saved for the backward pass written
    in place afterwards. Autograd refuses the program as exported; its functional form gives
    the gradient of the data flow, which is what the compiled step computes."""
    torch = pytest.importorskip("torch")

    class Cached(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = torch.nn.Parameter(torch.randn(4, 4))
            self.w2 = torch.nn.Parameter(torch.randn(4))

        def forward(self, x):
            s = x @ self.w1
            y = s * self.w2  # saves s for w2's gradient
            s[:, :2] = x[:, 2:]  # the state written after its use (a copy_ into a slice)
            return y + s

    torch.manual_seed(0)
    net, x = Cached().eval(), torch.randn(3, 4)
    with torch.no_grad():
        program = torch.export.export(net, (x,))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        program.module()(x).sum().backward()
    path = str(tmp_path / "cached.pt2")
    torch.export.save(program, path)
    params = [p.detach().numpy() for p in net.parameters()]
    names = ["p_w1", "p_w2"]
    labels = np.zeros((3, 4), "float32")
    loss, g1, g2 = reference.torch_training_step(path, [x.numpy()], labels, params, names, names)
    s = x @ net.w1
    value = ((s * net.w2 + torch.cat([x[:, 2:], s[:, 2:]], 1)) ** 2).mean()
    want = torch.autograd.grad(value, [net.w1, net.w2])
    assert float(loss) == pytest.approx(float(value), rel=1e-6)
    np.testing.assert_allclose(g1, want[0].detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g2, want[1].detach().numpy(), rtol=1e-5, atol=1e-6)
