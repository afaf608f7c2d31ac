"""Kernels that reduce into an intermediate and finish from it: split in time along the
reduced dim as a reduction run in chunks, then the finishing part once.

A fused kernel such as `matmul + bias`, `mean` (a sum, then a division) or a convolution's
weight gradient followed by a slice reduces over a dim into a buffer of its own and computes its
outputs from that buffer in later blocks (the index analysis lists the reduction as an `inner`
one). Run over chunks of the reduced dim, the reduction adds up chunk by chunk like any other
(`accumulating_kernels`), but the finishing blocks must run once, after the last chunk:
`reduction_epilogue` cuts the kernel after the reduction (`split_kernel`) into a reduction part
(some of the kernel's inputs -> the intermediates) and an epilogue (the intermediates and inputs
the chunks do not cut -> the outputs). Where the epilogue computes one output element from the
same element of one intermediate of the output's shape and dtype (a bias add, a scale), it runs
in place (proved by `inplace_kernels.inplace_obstacle`): the reduction adds up in the output's
own buffer, which the epilogue reads and writes, and no memory is needed besides it; otherwise
the intermediates are scratch while the op runs.
"""

from __future__ import annotations

import dataclasses

from .accumulating_kernels import adds_to_outputs, output_params
from .inplace_kernels import inplace_obstacle
from .kernel_cost import buffer_bytes
from .kernel_dims import KernelDims
from .local_kernels import KernelPart, LoweringError, inner_blocks, split_kernel


@dataclasses.dataclass
class ReductionEpilogue:
    """A kernel cut after its reduction over one dim (see the module docstring)."""

    reduction: KernelPart  # kernel inputs -> intermediates ("tmp" keys), run per chunk
    epilogue: KernelPart  # intermediates and inputs the chunks do not cut -> kernel outputs
    # The epilogue may write its output over its one intermediate (the caller passes the
    # output's buffer as both); else the intermediates are scratch of their own.
    in_place: bool
    intermediate_sizes: list[int]  # bytes of each intermediate


def reduction_epilogue(kd: KernelDims, dim: int) -> ReductionEpilogue | None:
    """The kernel of `kd` cut after the blocks that reduce over `dim`, where it can run so: the
    dim is reduced only into intermediates (no output is indexed by it), the kernel has no
    scalar parameters, the cut gives two parts, the first's outputs are intermediates each
    written by one block with an init (it adds up chunk by chunk), and the second reads no
    input that `dim` cuts. None otherwise."""
    spec = kd.spec.dims[dim]
    if not spec.valid or not spec.inner or any(o is not None for o in spec.outputs):
        return None
    if any(getattr(p, "shape", None) is None for p in kd.func.params):
        return None  # scalars (a partitioned kernel's chunk index) do not follow the cut
    try:
        parts = split_kernel(kd.func, kd.spec.num_outputs, inner_blocks(kd, [dim]))
    except LoweringError:
        return None
    if len(parts) != 2:
        return None
    reduction, epilogue = parts
    if any(k[0] != "tmp" for k in reduction.outputs) or \
            not adds_to_outputs(reduction.func, output_params(reduction.func,
                                                              len(reduction.outputs))):
        return None
    if any(k[0] == "out" or (k[0] == "in" and spec.inputs[k[1]] is not None)
           for k in epilogue.inputs) or \
            sorted(epilogue.outputs) != [("out", j) for j in range(kd.spec.num_outputs)]:
        return None
    tmps = output_params(reduction.func, len(reduction.outputs))
    sizes = [buffer_bytes(b.ty.shape, b.ty.dtype) for b in tmps]
    return ReductionEpilogue(reduction, epilogue, _in_place(epilogue), sizes)


def _in_place(epilogue: KernelPart) -> bool:
    """Whether the epilogue may write its one output over its one intermediate of the same
    shape and dtype: `inplace_obstacle` proves that each element is read only by the iteration
    that writes it. The kernel keeps both parameters (the caller passes one buffer twice, as
    for `accumulating_kernels`): a block that reads and writes one buffer would defeat the
    schedules, which bind threads only to blocks whose reads and writes do not overlap."""
    tmp = [i for i, k in enumerate(epilogue.inputs) if k[0] == "tmp"]
    if len(tmp) != 1 or len(epilogue.outputs) != 1:
        return False
    params = [p for p in epilogue.func.params if getattr(p, "shape", None) is not None]
    src, out = params[tmp[0]], params[-1]
    if [int(n) for n in src.ty.shape] != [int(n) for n in out.ty.shape] or \
            str(src.ty.dtype) != str(out.ty.dtype):
        return False
    return inplace_obstacle(epilogue.func, src, out) is None
