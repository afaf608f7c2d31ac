"""Chunks of a dim read through windows: a convolution's or a pooling's output rows.

Chunk c of such a dim (s of its rows, `yy` local in [0, s)) reads the input rows of its windows:
a chunk of the input axis (S = the axis' extent / the chunk count) with `halo_lo` rows before it
and `halo_hi` after (`kernel_dims`' `AxisCut`). Run on its own, the chunk's kernel takes that
range, rows `c * S - halo_lo` to `(c + 1) * S + halo_hi` (the rows outside the tensor are never
read: the kernel's padding tests, which see global rows, skip them), so every index into the
input's axis is its global value less `c * S - halo_lo`: the index as written, with local
variables, plus `halo_lo` (a window's coefficient times s is S, `kernel_dims` checked). A
window variable (`pad_temp`'s row, whose consumer reads it at `2 * yy + ry`) runs over the rows
the chunk's windows span, `const + a * (s - 1) + sum(c_v * (extent_v - 1)) + 1`, where its global
value (for the padding test) is its local one plus `a * s * c`; the buffer it writes shrinks
so. Only time splits run such chunks (each chunk's input range is copied in, overlapping the
next); across devices the halo rows would need an exchange, which PartitionOperators does not
do.
"""

from __future__ import annotations

import dataclasses

from .kernel_dims import KernelDims, _int, _iter_blocks


@dataclasses.dataclass
class HaloChunk:
    """What `local_kernel` changes beyond shrinking dim `dim` to one of `factor` chunks."""

    dim: int
    factor: int
    window_extent: dict  # window variable (block Var) -> its extent in a chunk
    window_step: dict  # window variable -> its global value's step per chunk (a * s)
    input_halo: dict  # input position -> (axis, halo_lo, halo_hi)


def halo_obstacle(kdims: KernelDims, dim: int) -> str | None:
    """Why chunks of `dim` cannot run on their windows' input rows (None: they can)."""
    for var, window in _windows_of(kdims, dim).items():
        if window is None:
            return f"window variable {var.name} reads the dim through a non-affine window"
        coeffs, const = window
        mine = [v for v in coeffs if kdims.var_dims.get(v) == dim]
        if len(mine) != 1:
            return f"window variable {var.name} reads {len(mine)} variables of the dim"
        if const < 0 or any(c < 0 for c in coeffs.values()):
            return f"window variable {var.name} runs backwards or before 0"
    return None


def halo_chunk(kdims: KernelDims, dim: int, factor: int) -> HaloChunk:
    """The window extents and input halos of one of `factor` chunks of `dim`."""
    spec = kdims.spec.dims[dim]
    s = spec.extent // factor
    extent = {}
    for block in _iter_blocks(kdims.func):
        for iv in block.iter_vars:
            extent[iv.var] = _int(iv.dom.extent)
    window_extent, window_step = {}, {}
    for var, (coeffs, const) in _windows_of(kdims, dim).items():
        span = const + 1
        for v, c in coeffs.items():
            mine = kdims.var_dims.get(v) == dim
            span += c * ((s if mine else extent[v]) - 1)
            if mine:
                window_step[var] = c * s
        window_extent[var] = min(span, extent[var])
    input_halo = {i: (c.axis, c.halo_lo, c.halo_hi) for i, c in enumerate(spec.inputs)
                  if c is not None and c.halo}
    return HaloChunk(dim, factor, window_extent, window_step, input_halo)


def chunk_rows(axis_extent: int, factor: int, halo_lo: int, halo_hi: int) -> int:
    """Rows of one chunk's input range along a halo axis."""
    return axis_extent // factor + halo_lo + halo_hi


def _windows_of(kdims: KernelDims, dim: int) -> dict:
    """The window variables whose windows read a variable of `dim`."""
    out = {}
    for var, window in kdims.windows.items():
        if window is None:
            if dim in kdims.window_dims:
                out[var] = None
            continue
        if any(kdims.var_dims.get(v) == dim for v in window[0]):
            out[var] = window
    return out

