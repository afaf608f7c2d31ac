"""Dropout of a train-mode export, applied with a seeded mask.

PyTorch draws a new Bernoulli mask on every call; a compiled module cannot follow its random
stream, and TVM's torch frontend drops dropout altogether (the eval-mode result). Here the mask
is a function of a seed (the model's `dropout_seed` input: a new seed, a new mask), of which
dropout op it is, and of each element's position:

    key  = mix(seed + op * 0x9E3779B9)                    (uint32 arithmetic, wrapping)
    u(i) = (mix(i ^ key) >> 8) / 2**24                    (i: the element's row-major index)
    y(i) = x(i) * (u(i) >= p) / (1 - p)

with `mix` the "lowbias32" integer hash (two multiply-xorshift rounds). The mask kernel reads
only the seed and its indices, so every run of it gives the same mask: where a swap plan
recomputes the op or the gradient needs the mask again, where a split runs it in chunks (with
the chunk's global indices) or a partition on each device's share. `mask_numpy` computes the
same mask for PyTorch, which `--check` runs with it in place of its own dropout.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SEED_INPUT = "dropout_seed"
# The dropouts applied here, as torch names them before and after the decompositions.
OPS = ("dropout", "dropout_", "native_dropout")
_GOLDEN = 0x9E3779B9
_MIX = (0x7FEB352D, 0x846CA68B)


def active(node) -> float | None:
    """The probability of a dropout node (an fx node of one of `OPS`) that drops in this
    export (train mode, p > 0), else None: the op is the identity."""
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return float(p) if p and train is not False else None


def _mix_numpy(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(_MIX[0])
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(_MIX[1])
    return x ^ (x >> np.uint32(16))


def scale(p: float) -> np.float32:
    """The factor of a kept element (0 where p >= 1: everything is dropped)."""
    return np.float32(0.0) if p >= 1 else np.float32(1.0 / (1.0 - p))


def mask_numpy(seed: int, op: int, shape: Sequence[int], p: float,
               dtype: str = "float32") -> np.ndarray:
    """The mask of dropout op `op` under `seed`: 0 for a dropped element, 1 / (1 - p) for a
    kept one."""
    with np.errstate(over="ignore"):
        key = _mix_numpy(np.array([(int(seed) + op * _GOLDEN) & 0xFFFFFFFF], np.uint32))
        index = np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.uint64)
        h = _mix_numpy((index & np.uint64(0xFFFFFFFF)).astype(np.uint32) ^ key)
    u = (h >> np.uint32(8)).astype(np.float32) * np.float32(2.0 ** -24)
    return np.where(u >= np.float32(p), scale(p), np.float32(0.0)).astype(dtype).reshape(shape)


def mask_compute(seed, op: int, shape: Sequence[int], p: float, dtype: str):
    """The mask as a TE compute over `seed` (a 0-d int64 tensor): what `mask_numpy` gives."""
    from tvm import te, tirx

    def u32(value: int):
        return tirx.const(value, "uint32")

    def times(x, factor: int):
        # In uint64, cut to 32 bits: TVM's uint32 multiply does not wrap (it gave 2**32 - 1).
        wide = x.astype("uint64") * tirx.const(factor, "uint64")
        return (wide & tirx.const(0xFFFFFFFF, "uint64")).astype("uint32")

    def mix(x):
        x = x ^ (x >> u32(16))
        x = times(x, _MIX[0])
        x = x ^ (x >> u32(15))
        x = times(x, _MIX[1])
        return x ^ (x >> u32(16))

    strides = [int(np.prod(shape[k + 1:], dtype=np.int64)) for k in range(len(shape))]

    def element(*idx):
        salted = seed[()].astype("uint64") + tirx.const((op * _GOLDEN) & 0xFFFFFFFF, "uint64")
        key = mix((salted & tirx.const(0xFFFFFFFF, "uint64")).astype("uint32"))
        flat = sum((i.astype("int64") * s for i, s in zip(idx, strides, strict=True)),
                   tirx.const(0, "int64"))
        h = mix(flat.astype("uint32") ^ key)
        u = (h >> u32(8)).astype("float32") * tirx.const(2.0 ** -24, "float32")
        return tirx.Select(u >= tirx.const(p, "float32"), tirx.const(float(scale(p)), dtype),
                           tirx.const(0.0, dtype))

    return te.compute(tuple(int(s) for s in shape), element, name="dropout_mask")
