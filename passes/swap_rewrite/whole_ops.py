"""Ops called whole, and the copies between them: each kernel at its position of the schedule
with its outputs placed in their windows (a tensor the plan recomputes is its kernel called
again at its second position, into its second window: nothing else marks it), an optimizer
update written into its argument's device copy through the in-place form of its kernel, and
the swap-outs (device to host, stream 0) and swap-ins (host to device, stream 1) the plan
issues after an op."""

from __future__ import annotations

import tvm
from tvm import relax

from tvm_ext.ir.inplace_kernels import InPlaceError, inplace_kernel
from tvm_ext.runtime import swap_calls

from .emission import D2H, H2D, Emission, SwapOffloadError


class WholeOps:
    """Emits ops called whole and the plan's swap-outs and swap-ins."""

    def __init__(self, em: Emission):
        self.em = em
        self.kernels: list = []  # (GlobalVar, PrimFunc) of the in-place kernels made
        self.replaced: list = []  # (kernel, its in-place form)
        self.scalar_ops: set[int] = set()

    def emit_scalar_ops(self) -> None:
        """Packed calls with no tensor argument or result (the worker id a partitioned kernel
        computes its chunk index from) and the symbolic values they define: first, since the
        calls that use those values do not depend on them through tensors."""
        em = self.em
        for op in em.g.ops:
            if op.kind != "builtin" or op.inputs or op.outputs:
                continue
            binding = em.bindings[op.id]
            var = em.emit(binding.value, binding.var.name)
            for cast in em.match_casts.get(binding.var, []):
                em.bb.match_cast(var, cast.ty, cast.var.name)
            self.scalar_ops.add(op.id)

    def op(self, op_id: int, residencies: list[int]) -> None:
        """Op `op_id` called whole, its outputs placed at the windows of `residencies`."""
        em = self.em
        g = em.g
        op = g.ops[op_id]
        value = em.bindings[op_id].value
        if op.kind == "view" or op_id in self.scalar_ops:
            return  # views are re-derived at each use; scalar ops were emitted first
        outs_by_tensor = {em.plan.residencies[ri].tensor: ri for ri in residencies}
        placed, written = {}, {}  # written: output index -> base it overwrites in place
        for j, tid in enumerate(op.outputs):
            if g.tensors[tid].overwrites is not None:
                written[j] = g.base(tid)
                continue
            if tid not in outs_by_tensor:
                raise SwapOffloadError(f"plan error: {g.tensors[tid].name} has no window at "
                                       f"its producer {op.name}")
            placed[j] = em.place(outs_by_tensor[tid])
        outs = [placed[j] for j in range(len(op.outputs)) if j in placed]
        name = value.op.name if isinstance(value.op, tvm.ir.Op) else ""
        if name not in ("relax.call_dps_packed", "relax.call_tir"):
            raise SwapOffloadError(f"{op.name}: SwapOffload cannot place the outputs of "
                                   f"{op.kernel} (not a destination-passing kernel)")
        # Tensor arguments by their values now; the others (scalars of kernels; shapes and
        # flags of collectives) stay in place, before the outputs.
        inputs = iter(op.inputs)
        packed = value.args[1]
        fields = packed.fields if isinstance(packed, relax.Tuple) else [packed]
        tensors = [next(inputs) if isinstance(f.ty, relax.TensorType) else None for f in fields]
        args = [em.value_of(t) if t is not None else f
                for t, f in zip(tensors, fields, strict=True)]
        # call_tir's third argument (symbolic shape values) follows the outputs.
        extra = list(value.args[2:3]) if name == "relax.call_tir" else []
        callee = value.args[0]
        if written:
            callee, passed = self._in_place(op, callee, name, tensors, written)
            if name == "relax.call_dps_packed":  # an extern writes its destination whole
                outs = [em.value_of(written[j]) if j in written else placed[j]
                        for j in range(len(op.outputs))]
            else:
                args += [em.value_of(b) for b in passed]
        em.emit(relax.Call(callee, [*args, *outs, *extra]))

    def _in_place(self, op, callee, name: str, tensors: list, written: dict):
        """The callee writing the outputs of `written` into their bases' device copies, and
        the bases passed as buffers to write (those the callee does not read)."""
        em = self.em
        g = em.g
        positions = {}
        for j, base in written.items():
            found = [i for i, t in enumerate(tensors) if t is not None and g.base(t) == base]
            positions[j] = found[0] if found else None
        if name == "relax.call_dps_packed":
            if any(p is not None for p in positions.values()):
                raise SwapOffloadError(f"{op.name}: {op.kernel} would read and write one "
                                       "buffer in place")
            return callee, [written[j] for j in sorted(written)]
        try:
            kernel = inplace_kernel(em.mod[callee], len(tensors), positions)
        except InPlaceError as err:
            raise SwapOffloadError(f"{op.name}: {err}") from err
        names = {gv.name_hint for gv in em.mod.functions} | \
            {gv.name_hint for gv, _ in self.kernels}
        kname, k = f"{callee.name_hint}_inplace", 1
        while kname in names:
            kname, k = f"{callee.name_hint}_inplace{k}", k + 1
        gv = em.bb.add_func(kernel.without_attr("global_symbol"), kname)
        self.kernels.append((gv, em.bb.get()[gv]))
        self.replaced.append((callee, gv))
        return gv, [written[j] for j in sorted(written) if positions[j] is None]

    def swap_outs(self, indices: list[int]) -> None:
        em = self.em
        for k in indices:
            s = em.plan.swap_outs[k]
            t = em.g.tensors[s.tensor]
            src = em.cur[s.tensor]
            em.emit(swap_calls.copy_async_call(src, em.host_copy_of(s.tensor), D2H, t.name))
            em.swapped_out_var[k] = src
            del em.cur[s.tensor]

    def swap_ins(self, indices: list[int]) -> None:
        em = self.em
        for k in indices:
            s = em.plan.swap_ins[k]
            t = em.g.tensors[s.tensor]
            # No wait here for the swap-out of what the window held (or of the tensor's own
            # data): the runtime orders copies on different streams that touch the same memory
            # (src/swap/copy_streams.cc), so the swap-in waits on its stream as the simulator
            # has it, and the compute goes on.
            dst = em.place(s.residency)
            em.emit(swap_calls.copy_async_call(em.host_val[s.tensor], dst, H2D, t.name))
