"""The planned function around the emitters: its arguments on the device or the host virtual
device, the device pools and the host pool first, then the schedule (each position's waits,
its op called whole or in chunks, the copies issued after it), a wait for every copy, and the
outputs (from the device, or from their host copies)."""

from __future__ import annotations

import json

import tvm
from tvm import relax

from tvm_ext.ir.pass_records import STATE_ATTR, SWAP_ARGS_ATTR, SWAP_PLAN_ATTR, UPDATES_ATTR
from tvm_ext.runtime import swap_calls
from tvm_ext.swap import SwapPlan
from tvm_ext.swap.alignment import align
from tvm_ext.swap.placement import DEVICE, HOST, argument_devices

from .chunked_ops import ChunkedOps
from .emission import H2D, Emission
from .whole_ops import WholeOps


class FunctionRewriter:
    """Writes the function a plan runs (see passes/swap_offload.py)."""

    def __init__(self, graph, bindings, constants, plan: SwapPlan, device, host,
                 match_casts: dict | None = None, mod: tvm.IRModule | None = None):
        self.em = Emission(graph, bindings, constants, plan, match_casts, mod)
        self.device, self.host = device, host
        self.whole = WholeOps(self.em)
        self.chunked = ChunkedOps(self.em)

    @property
    def new_kernels(self) -> list:
        """(GlobalVar, PrimFunc) of every kernel the rewrite made: in-place forms, chunk
        kernels."""
        return [*self.whole.kernels, *self.chunked.chunk_kernels.values()]

    @property
    def replaced_kernels(self) -> list:
        """The kernels whose calls all became calls of their in-place forms."""
        return [gv for gv, _ in self.whole.replaced]

    def rewrite(self, func: relax.Function) -> relax.Function:
        em = self.em
        g, plan = em.g, em.plan
        on_host = set(plan.host_start)
        where = argument_devices(g, plan)
        params = [relax.Var(p.name, relax.TensorType(
                      p.ty.shape, p.ty.dtype, self.host if w == HOST else self.device))
                  for p, w in zip(func.params, where, strict=True)]
        for t in g.tensors:
            if t.arg_index is not None:
                (em.host_val if t.id in on_host else em.cur)[t.id] = params[t.arg_index]
            elif t.kind == "constant" and t.id in em.const_expr:
                em.cur[t.id] = em.const_expr[t.id]

        produced_at, swap_in_after, swap_out_after, waits_before = _issue_points(plan)
        split_at = plan.split_at()
        kept = {k: func.attrs[k] for k in (UPDATES_ATTR, STATE_ATTR)
                if func.attrs is not None and k in func.attrs}
        attrs = {**kept, "num_input": g.num_input, "relax.force_pure": True,
                 SWAP_PLAN_ATTR: json.dumps(plan.summary()),
                 SWAP_ARGS_ATTR: ["host" if w == HOST else "device" for w in where]}
        # Pure from the outside (force_pure): the impure copies and waits stay inside.
        with em.bb.function("main", params, attrs=attrs, pure=True):
            em.pools = [em.emit(relax.op.memory.alloc_storage(
                relax.ShapeExpr([size]), DEVICE, "global", "uint8"), f"pool{i}")
                for i, size in enumerate(plan.pools)]
            em.host_pool = self._host_pool()
            self.whole.emit_scalar_ops()
            self.whole.swap_ins(swap_in_after.get(-1, []))
            for pos, op_id in enumerate(plan.schedule):
                for ri in produced_at.get(pos, []):
                    em.wait_swap_out(plan.residencies[ri].wait_swap_out)
                for k in waits_before.get(pos, []):
                    em.emit(swap_calls.wait_call(em.cur[plan.swap_ins[k].tensor], H2D))
                if pos in split_at:
                    self.chunked.split_op(split_at[pos], produced_at.get(pos, []))
                else:
                    self.whole.op(op_id, produced_at.get(pos, []))
                self.whole.swap_outs(swap_out_after.get(pos, []))
                self.whole.swap_ins(swap_in_after.get(pos, []))
            em.emit(swap_calls.wait_all_call())
            em.bb.emit_func_output(self._outputs(func))
        return em.bb.get()["main"]

    def _outputs(self, func: relax.Function) -> relax.Expr:
        """What the function returns: each output's device value, or its host copy."""
        em = self.em
        g, plan = em.g, em.plan
        outputs = []
        for tid in g.outputs:
            base = g.base(tid)
            if base in plan.outputs_on_host:
                value = em.host_val[base]
                if base != tid and g.tensors[tid].overwrites is None:
                    value = em.emit(relax.op.reshape(
                        value, relax.ShapeExpr(list(g.tensors[tid].shape))))
                outputs.append(value)
            else:
                outputs.append(em.value_of(tid))
        ret = func.body.body
        return relax.Tuple(outputs) if isinstance(ret, relax.Tuple) or len(outputs) != 1 \
            else outputs[0]

    def _host_pool(self):
        """One host buffer holding every tensor the plan swaps out, each at its own offset,
        but the outputs returned from the host: each its own host tensor, so that the return
        value the caller keeps holds nothing else."""
        em = self.em
        offsets, total = {}, 0
        returned = set(em.plan.outputs_on_host)
        for s in em.plan.swap_outs:
            if s.tensor not in offsets and s.tensor not in returned:
                offsets[s.tensor] = total
                total += align(em.g.tensors[s.tensor].nbytes)
        em.host_offsets = offsets
        if not total:
            return None
        return em.emit(swap_calls.host_storage_call(total, HOST, DEVICE), "host_pool")


def _issue_points(plan: SwapPlan) -> tuple[dict, dict, dict, dict]:
    """Per schedule position: the residencies produced there, the swap-ins issued after it, the
    swap-outs issued after it (those of a split op's outputs are its own), and the swap-ins
    waited for before it (a split op streams its own inputs)."""
    produced_at: dict[int, list[int]] = {}
    swap_in_after: dict[int, list[int]] = {}
    swap_out_after: dict[int, list[int]] = {}
    waits_before: dict[int, list[int]] = {}
    for i, r in enumerate(plan.residencies):
        if r.source == "produced":
            produced_at.setdefault(r.begin, []).append(i)
    streamed = {(t, sp.position) for sp in plan.splits for t in sp.cut_outputs}
    for k, s in enumerate(plan.swap_ins):
        if s.residency >= 0:
            swap_in_after.setdefault(s.after, []).append(k)
            waits_before.setdefault(s.before, []).append(k)
    for k, s in enumerate(plan.swap_outs):
        if (s.tensor, s.after) not in streamed:
            swap_out_after.setdefault(s.after, []).append(k)
    return produced_at, swap_in_after, swap_out_after, waits_before
