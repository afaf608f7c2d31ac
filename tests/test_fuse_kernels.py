"""FuseKernels (tvm_ext.passes.fuse_kernels), on the recurrent training steps that needed it."""

from __future__ import annotations

import pytest
import tvm
from tvm import relax

from tvm_ext import cli
from tvm_ext.models import load_model
from tvm_ext.passes import FuseKernels


class _Recurrent:
    """A token classifier over a bidirectional two-layer LSTM or GRU (its zero initial state
    multiplied by a weight in the first step of each direction)."""

    @staticmethod
    def module(torch, cell: str):
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = torch.nn.Embedding(20, 6)
                rnn = torch.nn.LSTM if cell == "lstm" else torch.nn.GRU
                self.rnn = rnn(6, 8, num_layers=2, batch_first=True, bidirectional=True)
                self.fc = torch.nn.Linear(16, 3)

            def forward(self, ids):
                h, _ = self.rnn(self.emb(ids))
                return self.fc(h[:, -1])

        return Net().eval()


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_recurrent_training_steps_compile_and_match_torch(cell, tmp_path):
    """The GRU's step fails TVM's FuseTIR after FoldConstant, and is fused without it (with a
    warning); the LSTM's zero state reached GroupAccumulations' fused kernels as a constant,
    which FuseTIR refuses. Both match torch.autograd (the reversed direction through `flip`'s
    gradient)."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    path = str(tmp_path / f"{cell}.pt2")
    ids = torch.randint(0, 20, (2, 5))
    torch.export.save(torch.export.export(_Recurrent.module(torch, cell), (ids,)), path)
    assert cli.main([path, "--target", "llvm", "--training", "--run", "--check"]) == 0

    with tvm.target.Target("llvm"):
        legal = tvm.transform.Sequential([relax.transform.LegalizeOps(),
                                          relax.transform.AnnotateTIROpPattern()])(
            load_model(path, training=True).mod)
        if cell == "gru":
            with pytest.raises(tvm.error.InternalError, match="buffer_idx"):
                tvm.transform.Sequential([relax.transform.FoldConstant(),
                                          relax.transform.FuseOps(),
                                          relax.transform.FuseTIR()])(legal)
            with pytest.warns(UserWarning, match="fused without folding"):
                FuseKernels()(legal)
        else:
            FuseKernels()(legal)
