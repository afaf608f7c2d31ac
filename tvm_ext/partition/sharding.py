"""The pieces of a tensor each device holds under a layout (numpy, no IR).

Implements the index convention of `layout.py`: devices are numbered with level 1 most
significant, `worker = sum_l c_l * stride_l`, `stride_l = p_{l+1} * ... * p_L`; along an axis cut
at the levels S (m = the deepest), index i belongs to block `i // (n / (p_1 * ... * p_m))`, whose
mixed-radix digits (level 1 first) must equal the device's coordinates at the levels in S; a
device's piece is its blocks in increasing order. Used to place arguments on the workers and
to gather outputs (`tvm_ext.runtime.distributed.run_partitioned`), and by the tests as the
reference of the mesh collectives.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .layout import REP, local_shape

__all__ = ["coordinates", "level_stride", "local_shape", "shard", "shards", "unshard"]


def coordinates(worker: int, mesh: Sequence[int]) -> list[int]:
    """The mesh coordinates (level 1 first) of a worker."""
    coords = []
    for p in reversed(mesh):
        coords.append(worker % p)
        worker //= p
    return coords[::-1]


def level_stride(mesh: Sequence[int], level: int) -> int:
    """Worker-id distance between neighbours at a level."""
    return int(np.prod(mesh[level + 1:], dtype=np.int64))


def axis_indices(n: int, mesh: Sequence[int], layout: Sequence[int], axis: int,
                 coords: Sequence[int]) -> np.ndarray:
    """Indices along `axis` (extent n) a device at `coords` holds."""
    levels = [lvl for lvl, s in enumerate(layout) if s == axis]
    if not levels:
        return np.arange(n)
    deepest = max(levels)
    radices = list(mesh[:deepest + 1])
    blocks = int(np.prod(radices))
    if n % blocks:
        raise ValueError(f"axis {axis} of extent {n} does not divide into {blocks} blocks")
    block = np.arange(n) // (n // blocks)
    keep = np.ones(n, dtype=bool)
    for lvl in range(deepest, -1, -1):
        digit = block % radices[lvl]
        block //= radices[lvl]
        if lvl in levels:
            keep &= digit == coords[lvl]
    return np.nonzero(keep)[0]


def _check(shape: Sequence[int], mesh: Sequence[int], layout: Sequence[int]) -> None:
    if len(layout) != len(mesh):
        raise ValueError(f"a layout of {len(layout)} levels for a mesh of {len(mesh)}")
    for s in layout:
        if s != REP and not 0 <= s < len(shape):
            raise ValueError(f"layout {list(layout)} cuts an axis a {len(shape)}-d tensor lacks")


def shard(array: np.ndarray, mesh: Sequence[int], layout: Sequence[int],
          worker: int) -> np.ndarray:
    """The piece of `array` a worker holds under `layout` (one scheme per mesh level)."""
    array = np.asarray(array)
    _check(array.shape, mesh, layout)
    coords = coordinates(worker, mesh)
    out = array
    for axis in sorted({s for s in layout if s != REP}):
        out = np.take(out, axis_indices(array.shape[axis], mesh, layout, axis, coords), axis=axis)
    return np.asarray(out, order="C")


def shards(array: np.ndarray, mesh: Sequence[int], layout: Sequence[int]) -> list[np.ndarray]:
    """Every worker's piece, by worker id."""
    k = int(np.prod(mesh, dtype=np.int64))
    return [shard(array, mesh, layout, w) for w in range(k)]


def unshard(pieces: Sequence[np.ndarray], mesh: Sequence[int], layout: Sequence[int],
            shape: Sequence[int]) -> np.ndarray:
    """The whole tensor of `shape` from every worker's piece (replicated parts from the first
    worker holding them)."""
    shape = tuple(int(s) for s in shape)
    _check(shape, mesh, layout)
    k = int(np.prod(mesh, dtype=np.int64))
    if len(pieces) != k:
        raise ValueError(f"{len(pieces)} pieces for {k} workers")
    out = np.empty(shape, dtype=np.asarray(pieces[0]).dtype)
    for w in reversed(range(k)):  # worker 0 written last: its copy of replicated parts wins
        coords = coordinates(w, mesh)
        index = np.ix_(*[axis_indices(n, mesh, layout, a, coords) for a, n in enumerate(shape)])
        out[index] = pieces[w]
    return out

