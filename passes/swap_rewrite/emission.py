"""What SwapOffload's emitters share while they write the planned function: the graph and the
plan, the block builder, where each tensor is now (its device value, its host copy), the
device pools and the host pool, and the swap-outs still in flight."""

from __future__ import annotations

import tvm
from tvm import relax

from tvm_ext.errors import InputError
from tvm_ext.runtime import swap_calls
from tvm_ext.swap import SwapPlan
from tvm_ext.swap.placement import DEVICE, HOST

D2H, H2D = 0, 1  # copy stream ids


class SwapOffloadError(InputError):
    """The module is not in a form SwapOffload rewrites, or the plan does not fit it."""


class Emission:
    """The state of one rewrite, and the steps every emitter takes on it."""

    def __init__(self, graph, bindings, constants, plan: SwapPlan,
                 match_casts: dict | None = None, mod: tvm.IRModule | None = None):
        self.g = graph
        self.mod = mod  # the kernels: for in-place forms and the chunk kernels of split ops
        self.bindings = bindings
        self.match_casts = match_casts or {}
        self.const_expr = {tid: c for c, tid in constants.items()}
        self.plan = plan
        self.bb = relax.BlockBuilder()
        self.cur: dict[int, relax.Expr] = {}  # tensor -> its device value now
        self.host_val: dict[int, relax.Expr] = {}  # tensor -> its host copy
        self.swapped_out_var: dict[int, relax.Expr] = {}  # swap-out index -> device value copied
        self.waited_out: set[int] = set()  # swap-outs already waited for (waits are in order)
        self.pools: list = []  # the device pools, made first in the function
        self.host_pool = None  # one host buffer for what the plan swaps out
        self.host_offsets: dict[int, int] = {}  # tensor -> its offset in the host pool

    def emit(self, expr, name: str = "") -> relax.Var:
        return self.bb.emit(expr, name) if name else self.bb.emit(expr)

    def value_of(self, tid: int) -> relax.Expr:
        """The device value of tensor `tid` for a use now (views re-derived from their base)."""
        t = self.g.tensors[tid]
        if t.overwrites is not None:  # an in-place update: the same buffer as its base
            return self.value_of(self.g.base(tid))
        if t.alias_of is None:
            if tid not in self.cur:
                raise SwapOffloadError(f"plan error: {t.name} is not resident where it is used")
            return self.cur[tid]
        base = self.value_of(self.g.base(tid))
        return self.emit(relax.op.reshape(base, relax.ShapeExpr(list(t.shape))))

    def place(self, residency_index: int) -> relax.Var:
        """The tensor of a residency, at its window in its pool: its device value from now."""
        r = self.plan.residencies[residency_index]
        t = self.g.tensors[r.tensor]
        alloc = relax.op.memory.alloc_tensor(self.pools[r.pool], relax.prim_value(r.offset),
                                             relax.ShapeExpr(list(t.shape)), t.dtype)
        var = self.emit(relax.op.memory.ensure_zero_offset(self.emit(alloc)))
        self.cur[r.tensor] = var
        return var

    def wait_swap_out(self, k: int) -> None:
        """Before a region is overwritten: the copy-out of what it held must be done."""
        if k >= 0 and k not in self.waited_out:
            self.emit(swap_calls.wait_call(self.swapped_out_var[k], D2H))
            self.waited_out.add(k)

    def host_copy_of(self, tid: int) -> relax.Expr:
        """The host copy of base tensor `tid`: an argument left there, or its place in the
        host pool (a split op's output lands there)."""
        if tid not in self.host_val:
            self.host_val[tid] = self._new_host_copy(tid)
        return self.host_val[tid]

    def _new_host_copy(self, tid: int) -> relax.Var:
        """Base tensor `tid`'s place on the host: in the host pool, or its own host tensor
        where it is returned from the host."""
        t = self.g.tensors[tid]
        if tid not in self.host_offsets:
            return self.emit(swap_calls.host_empty_call(t.shape, t.dtype, HOST, DEVICE))
        return self.emit(relax.op.memory.alloc_tensor(
            self.host_pool, relax.prim_value(self.host_offsets[tid]),
            relax.ShapeExpr(list(t.shape)), t.dtype))
