"""The granularity at which swap plans place tensors in device pools."""

from __future__ import annotations

ALIGNMENT = 256  # byte alignment of every tensor placed in a pool (CUDA's allocation granule)


def align(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """`nbytes` rounded up to a multiple of `alignment`."""
    return -(-int(nbytes) // alignment) * alignment
