"""NumPy reference implementations of the zoo models, written from their definitions, for
checking the compiled Relax modules numerically."""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

_erf = np.vectorize(math.erf)


def gelu(x):
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def layer_norm(x, w, b, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def linear(p, name, x):
    out = x @ p[f"{name}.weight"].T
    bias = p.get(f"{name}.bias")
    return out if bias is None else out + bias


def mlp(p, x, layers):
    for i in range(layers):
        x = linear(p, f"layers.{i}", x)
        if i + 1 < layers:
            x = gelu(x)
    return x


def gpt(p, ids, heads, layers):
    b, t = ids.shape
    x = p["wte.weight"][ids] + p["wpe.weight"][np.arange(t)]
    d = x.shape[-1]
    hd = d // heads
    mask = np.triu(np.full((t, t), -1e9), 1)
    for i in range(layers):
        pre = f"blocks.{i}"
        h = layer_norm(x, p[f"{pre}.ln1.weight"], p[f"{pre}.ln1.bias"])

        def split_heads(z):
            return z.reshape(b, t, heads, hd).transpose(0, 2, 1, 3)

        q = split_heads(linear(p, f"{pre}.q", h))
        k = split_heads(linear(p, f"{pre}.k", h))
        v = split_heads(linear(p, f"{pre}.v", h))
        att = softmax(q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd) + mask)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
        x = x + linear(p, f"{pre}.proj", y)
        h = layer_norm(x, p[f"{pre}.ln2.weight"], p[f"{pre}.ln2.bias"])
        x = x + linear(p, f"{pre}.fc2", gelu(linear(p, f"{pre}.fc1", h)))
    x = layer_norm(x, p["ln_f.weight"], p["ln_f.bias"])
    return x @ p["head.weight"].T


def conv2d(x, w, stride=1, padding=0):
    if padding:
        x = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    kh, kw = w.shape[2:]
    win = sliding_window_view(x, (kh, kw), axis=(2, 3))[:, :, ::stride, ::stride]
    return np.einsum("nchwij,ocij->nohw", win, w)


def batch_norm(p, name, x, eps=1e-5, training=False):
    """Running statistics for inference; batch statistics for a training step."""
    shape = (1, -1, 1, 1)
    if training:
        mean = x.mean(axis=(0, 2, 3), keepdims=True)
        var = x.var(axis=(0, 2, 3), keepdims=True)
    else:
        mean = p[f"{name}.running_mean"].reshape(shape)
        var = p[f"{name}.running_var"].reshape(shape)
    return (x - mean) / np.sqrt(var + eps) * p[f"{name}.weight"].reshape(shape) + \
        p[f"{name}.bias"].reshape(shape)


def max_pool_3x3_s2_p1(x):
    x = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=-np.inf)
    win = sliding_window_view(x, (3, 3), axis=(2, 3))[:, :, ::2, ::2]
    return win.max(axis=(-1, -2))


def resnet(p, x, widths, blocks, training=False):
    def relu(z):
        return np.maximum(z, 0)

    def bn(name, z):
        return batch_norm(p, name, z, training=training)

    x = relu(bn("bn", conv2d(x, p["stem.weight"], padding=1)))
    x = max_pool_3x3_s2_p1(x)
    i, cin = 0, widths[0]
    for stage, (width, count) in enumerate(zip(widths, blocks, strict=True)):
        for j in range(count):
            stride = 2 if (stage > 0 and j == 0) else 1
            pre = f"layers.{i}"
            y = relu(bn(f"{pre}.bn1", conv2d(x, p[f"{pre}.conv1.weight"], stride, 1)))
            y = bn(f"{pre}.bn2", conv2d(y, p[f"{pre}.conv2.weight"], 1, 1))
            if stride != 1 or cin != width:
                skip = bn(f"{pre}.bn_sc", conv2d(x, p[f"{pre}.shortcut.weight"], stride))
            else:
                skip = x
            x = relu(y + skip)
            cin, i = width, i + 1
    return linear(p, "fc", x.mean(axis=(2, 3)))


def cross_entropy(logits, labels):
    logits = logits.reshape(-1, logits.shape[-1])
    labels = labels.reshape(-1)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return -logp[np.arange(len(labels)), labels].mean()


def forward(model, params: dict, inputs: list, training: bool = False):
    """The reference output of a zoo model's forward pass (batch-statistics batch norm in a
    training step)."""
    c = model.config
    if model.name == "mlp":
        return mlp(params, inputs[0], c["layers"])
    if model.name == "gpt":
        return gpt(params, inputs[0], c["heads"], c["layers"])
    if model.name == "resnet":
        return resnet(params, inputs[0], c["widths"], c["blocks"], training)
    raise ValueError(model.name)
