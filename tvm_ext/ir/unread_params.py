"""Kernel parameters a PrimFunc never touches.

Some legalized kernels take a tensor only for its shape: `take_backward` (an embedding's
gradient) is passed the embedding table it scatters into and reads none of it. Passed anyway,
the table must sit on the device while the kernel runs, and a swap plan counts it in the
kernel's working set. `unread_params` finds such parameters, `without_params` drops them from
the signature.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx


def unread_params(func: tirx.PrimFunc) -> list[int]:
    """Positions of `func`'s buffer parameters that its body never names (no load, store,
    region, or pointer use) and whose symbolic offsets and strides nothing else uses: the
    kernel computes the same without them."""
    named: list = []
    tvm_ffi.structural_walk(func.body, [(tvm.ir.expr.Var, named.append)])
    # Symbolic variables of the other parameters' types (shared offsets, strides, shapes).
    for p in func.params:
        ty = getattr(p, "ty", None)
        if _is_buffer(p):
            for field in (ty.shape, ty.strides, [ty.elem_offset]):
                for e in field:
                    tvm_ffi.structural_walk(e, [(tvm.ir.expr.Var, named.append)])
        else:
            named.append(p)
    out = []
    for i, p in enumerate(func.params):
        if not _is_buffer(p) or any(v.same_as(p) for v in named):
            continue
        own = [v for e in (*p.ty.shape, *p.ty.strides, p.ty.elem_offset)
               for v in _vars(e)]
        # Its own symbolic offset is named once by its own type, above; more names mean a use.
        if all(sum(u.same_as(v) for u in named) <= sum(u.same_as(v) for u in own)
               for v in own):
            out.append(i)
    return out


def without_params(func: tirx.PrimFunc, positions) -> tirx.PrimFunc:
    """`func` with the parameters at `positions` (from `unread_params`) left out."""
    drop = set(positions)
    params = [p for i, p in enumerate(func.params) if i not in drop]
    return tirx.PrimFunc(params, func.body, func.ret_type, func.attrs)


def _is_buffer(param) -> bool:
    return getattr(param, "shape", None) is not None


def _vars(expr) -> list:
    found: list = []
    tvm_ffi.structural_walk(expr, [(tvm.ir.expr.Var, found.append)])
    return found
