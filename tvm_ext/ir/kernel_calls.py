"""Reading the `R.call_tir` calls of a fused Relax function: which kernel, which arguments."""

from __future__ import annotations

import tvm
from tvm import relax

CALL_TIR = "relax.call_tir"


def call_tir_kernel(call: relax.Call) -> str | None:
    """The name of the kernel a `call_tir` calls, else None."""
    if isinstance(call.op, tvm.ir.Op) and call.op.name == CALL_TIR and \
            isinstance(call.args[0], tvm.ir.GlobalVar):
        return call.args[0].name_hint
    return None


def call_tir_args(call: relax.Call) -> list:
    """The tensor arguments of a `call_tir` (its packed tuple, unpacked)."""
    packed = call.args[1]
    return list(packed.fields) if isinstance(packed, relax.Tuple) else [packed]
