"""FuseKernels: FoldConstant, GroupAccumulations, FuseOps and FuseTIR, with FoldConstant left
out where the fusion cannot take what it folded.

Input: a module after `LegalizeOps` and `AnnotateTIROpPattern`. FoldConstant runs the kernels
whose arguments are all constants at compile time; on a GRU's training step (the gates of
its zero initial state) what it leaves makes TVM's FuseTIR fail an internal check ("buffer_idx
== buffers.size()") in some runs and not others (TVM's fusion order varies between runs).
Folding only saves work, so the module is then fused as it stood before it: the same values,
with those constant kernels run at run time.
"""

from __future__ import annotations

import warnings

import tvm
from tvm import relax

from .group_accumulations import GroupAccumulations


def _fused(mod: tvm.IRModule, fold: bool) -> tvm.IRModule:
    passes = [relax.transform.FoldConstant()] if fold else []
    passes += [GroupAccumulations(), relax.transform.FuseOps(), relax.transform.FuseTIR()]
    return tvm.transform.Sequential(passes)(mod)


@tvm.transform.module_pass(opt_level=0, name="FuseKernels")
class FuseKernels:
    """Fuse the kernels, folding constants where the fusion allows it (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        try:
            return _fused(mod, fold=True)
        except tvm.error.InternalError as err:
            folded_error = str(err).strip().splitlines()[-1]
        fused = _fused(mod, fold=False)
        warnings.warn(f"TVM's fusion failed after FoldConstant ({folded_error}); the module is "
                      "fused without folding its constant kernels", stacklevel=2)
        return fused
