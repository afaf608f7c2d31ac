"""`gpt`: a decoder-only transformer (token + position embedding, pre-norm blocks of causal
multi-head attention and a GELU MLP, final layer norm, untied LM head)."""

from __future__ import annotations

import math

import numpy as np
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ._nn import Embedding, export
from .base import Model, TensorSpec, default_param_spec

SIZES = {
    "tiny": dict(batch=2, seq=16, hidden=32, heads=2, layers=2, vocab=64),
    "small": dict(batch=4, seq=64, hidden=128, heads=4, layers=2, vocab=1024),
    "medium": dict(batch=8, seq=256, hidden=512, heads=8, layers=6, vocab=8192),
    # GPT-2-medium class, ~1.4 GB of weights.
    "large": dict(batch=8, seq=1024, hidden=1024, heads=16, layers=24, vocab=32000),
    # Hidden 4096 (the SwapAdvisor benchmark size): ~19 GB of weights, planning only.
    "xl": dict(batch=4, seq=1024, hidden=4096, heads=32, layers=24, vocab=32000),
}


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        if hidden % heads:
            raise ValueError(f"hidden {hidden} is not a multiple of heads {heads}")
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        # Separate projections rather than one fused qkv split three ways: a split's tuple
        # result keeps all three parts alive in the VM, and each projection partitions alone.
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: nn.Tensor, mask: nn.Tensor) -> nn.Tensor:
        b, t, d = x.shape
        head_dim = d // self.heads
        h = self.ln1(x)

        def split_heads(z):
            return op.permute_dims(op.reshape(z, [b, t, self.heads, head_dim]), [0, 2, 1, 3])

        q, k, v = split_heads(self.q(h)), split_heads(self.k(h)), split_heads(self.v(h))
        scores = op.matmul(q, op.permute_dims(k, [0, 1, 3, 2])) * (1.0 / math.sqrt(head_dim))
        attn = op.softmax(scores + mask, axis=-1)
        y = op.reshape(op.permute_dims(op.matmul(attn, v), [0, 2, 1, 3]), [b, t, d])
        x = x + self.proj(y)
        return x + self.fc2(op.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, seq: int, hidden: int, heads: int, layers: int, vocab: int):
        self.seq = seq
        self.wte = Embedding(vocab, hidden)
        self.wpe = Embedding(seq, hidden)
        self.blocks = nn.ModuleList([Block(hidden, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: nn.Tensor) -> nn.Tensor:
        _, t = ids.shape
        x = self.wte(ids) + self.wpe(op.arange(0, t, dtype="int32"))
        # Additive causal mask: -1e9 above the diagonal.
        mask = nn.Tensor.from_const(np.triu(np.full((t, t), -1e9, "float32"), 1))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def _init(name: str, shape: tuple, dtype: str) -> TensorSpec:
    if name.startswith(("wte", "wpe")):
        return TensorSpec(name, shape, dtype, init="normal", scale=0.02)
    if "ln" in name and name.endswith("weight"):
        return TensorSpec(name, shape, dtype, init="ones")
    return default_param_spec(name, shape, dtype)


def build(batch: int, seq: int, hidden: int, heads: int, layers: int, vocab: int) -> Model:
    config = dict(batch=batch, seq=seq, hidden=hidden, heads=heads, layers=layers, vocab=vocab)
    ids = TensorSpec("ids", (batch, seq), "int32", init="randint", high=vocab)
    return export("gpt", GPT(seq, hidden, heads, layers, vocab), [ids], config, init=_init)
