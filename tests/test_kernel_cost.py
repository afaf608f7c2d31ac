"""`tvm_ext.ir.kernel_cost`: what it reads from TVM's legalized kernels."""

from __future__ import annotations

import pytest
import tvm
from tvm import relax
from tvm.script import relax as R

from tvm_ext.ir.kernel_cost import analyze_kernel


def _pool_kernel(size: int, out: int) -> tvm.tirx.PrimFunc:
    @tvm.script.ir_module
    class Pool:
        @R.function
        def main(x: R.Tensor((2, 3, size, size), "float32")):
            return R.nn.adaptive_avg_pool2d(x, (out, out))

    mod = relax.transform.LegalizeOps()(Pool)
    (kernel,) = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    return kernel


@pytest.mark.parametrize("size,out", [(8, 2), (1, 7), (3, 7)])
def test_adaptive_pool_windows_read_the_outer_index(size, out):
    """TVM writes an adaptive pool's window as a block nested in the output's, its extents
    reading the output index (VGG's 7 x 7 pool of a 1 x 1 map: `1 - v_ax2`): bounded through
    the loop that index is bound to, not refused as unbounded."""
    cost = analyze_kernel(_pool_kernel(size, out))
    assert cost.bytes_moved == 4 * 2 * 3 * (size * size + out * out)
    assert cost.reduces and 0 < cost.flops < float("inf")
