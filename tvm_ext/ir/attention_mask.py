"""The causal line of an attention's constant biases: how far right of the diagonal the keys
a query row sees may reach.

A fused attention kernel skips a tile of keys for a tile of queries only where this is
proved: every key j > i + offset of query row i is -inf in a constant bias, in every batch and
head. Such a tile's probabilities are exp(-inf) = 0, so skipping it changes no sum, maximum or
gradient, provided each row keeps some unmasked key (a row with every key masked is NaN or
zeros as the unfused graph computes it; with none of its tiles visited the backward would
give zeros where the graph gives NaN, so such a mask is not used). The one input for which
the skip differs from the unfused graph is a non-finite value under the mask (an inf or NaN
score, value or gradient), which the unfused products would carry into the result.
"""

from __future__ import annotations

import numpy as np


def causal_offset(biases: list, q_len: int, kv_len: int) -> int | None:
    """The least offset such that every key j > i + offset of each query row i is -inf in one
    of `biases` (arrays broadcast to [batch, heads, q_len, kv_len]; None for a bias that is
    not a constant) for every batch and head; None where no key is masked so (no tile could
    be skipped) or where some row has every key masked."""
    masked = np.zeros((q_len, kv_len), bool)
    for bias in biases:
        if bias is None:
            continue
        a = np.asarray(bias)
        if not np.issubdtype(a.dtype, np.floating) or a.ndim > 4:
            continue
        a = a.reshape((1,) * (4 - a.ndim) + a.shape)
        masked |= np.broadcast_to(np.all(np.isneginf(a), axis=(0, 1)), (q_len, kv_len))
    unmasked = ~masked
    if not unmasked.any(axis=1).all():
        return None
    last = kv_len - 1 - np.argmax(unmasked[:, ::-1], axis=1)  # each row's last unmasked key
    offset = int((last - np.arange(q_len)).max())
    return offset if offset < kv_len - 1 else None
