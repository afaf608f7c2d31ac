"""SwapOffload: run a Relax function in less device memory than it needs, by a swap plan.

Input: a module after legalization and fusion (`tvm_ext.pipeline.legalize_passes`), before
dataflow lowering. The pass builds the function's `DataflowGraph`, asks a planner for a
`SwapPlan` under the device budget (or takes the plan given) and rewrites `main` into the
lowered, destination-passing form the rest of the pipeline leaves alone:

1. the bindings in the planned order;
2. explicit device memory: one `R.memory.alloc_storage` per planned pool at the start, every
   tensor placed at its window (`R.memory.alloc_tensor(pool, offset, ...)`, offsets aligned to
   256 bytes) and each kernel called with its outputs (`gv(inputs..., outputs...)`), so
   `StaticPlanBlockMemory` has nothing to plan and the pools are all the device memory used
   beyond the arguments kept there;
3. copies on two streams through the runtime library (`tvm_ext.runtime.swap_streams`): swap-outs
   (stream 0, device to host, into one host pool) after the op the plan names, swap-ins
   (stream 1) into their window, a `wait` right before the first op that reads a swapped-in
   tensor and before any op that overwrites a region still being copied out, and `wait_all`
   before returning. A swap-in into a region still being copied out (or of data still being
   copied out) is not waited for by the caller: the runtime orders it after that swap-out on
   the copy streams, so the compute goes on as the simulator assumes;
4. arguments the plan leaves on the host are declared on a host virtual device (VM device 1),
   the others on the device (VM device 0);
5. the function attribute `tvm_ext.swap_plan` records the plan summary (budget, planned peak,
   bytes swapped, predicted time) and `tvm_ext.swap_arguments` where each argument lives;
6. an optimizer step's update (an op that overwrites an argument in place, see
   `tvm_ext.graph`) writes into the argument's current device copy (its pool window, or the
   argument itself when the plan keeps it on the device) through the in-place form of its
   kernel (`tvm_ext.ir.inplace_kernels`); the plan copies an argument kept on the host back
   into the argument's host buffer after it is overwritten, so each step starts where the last
   one left it.

Run it after the legalize phase (and the partition phase, per device) and before the schedule
phase and `dataflow_lower_passes`, as the "tvm_ext" pipeline does with `device_memory=`. A
function already rewritten is left unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import tvm
from tvm import relax

from tvm_ext.cost import Hardware
from tvm_ext.errors import InputError
from tvm_ext.ir.accumulating_kernels import accumulating_kernel, output_params
from tvm_ext.ir.epilogue_kernels import reduction_epilogue
from tvm_ext.ir.graph_builder import read_pass_input
from tvm_ext.ir.halo_chunks import chunk_rows
from tvm_ext.ir.inplace_kernels import InPlaceError, drop_unused, inplace_kernel
from tvm_ext.ir.kernel_cost import buffer_bytes
from tvm_ext.ir.kernel_dims import kernel_dims
from tvm_ext.ir.kernel_fission import fission_kernels
from tvm_ext.ir.local_kernels import LoweringError, chunk_params, has_halo, local_kernel
from tvm_ext.ir.pass_records import (
    STATE_ATTR,
    SWAP_ARGS_ATTR,
    SWAP_PLAN_ATTR,
    UPDATES_ATTR,
    has_record,
)
from tvm_ext.ir.swap_planning import plan_module_swaps
from tvm_ext.ir.targets import host_vdevice
from tvm_ext.ir.time_splits import annotate_time_splits
from tvm_ext.runtime import swap_calls
from tvm_ext.swap import SwapPlan, validate
from tvm_ext.swap.alignment import align
from tvm_ext.swap.placement import DEVICE, HOST, argument_devices
from tvm_ext.swap.problem import problem_for_budget
from tvm_ext.swap.split import chunk_kernel_name, tensor_chunk_bytes

D2H, H2D = 0, 1  # copy stream ids


class SwapOffloadError(InputError):
    """The module is not in a form SwapOffload rewrites, or the plan does not fit it."""


@tvm.transform.module_pass(opt_level=0, name="SwapOffload")
class SwapOffload:
    """Plan and apply swapping so that `main` runs within `device_memory` bytes.

    Args:
        device_memory: the device budget: bytes, a size string ("512MiB"), or a percentage of
            the no-swap peak ("25%").
        host: the host virtual device (default: `host_vdevice(target)`).
        hardware: the cost-model preset (or `Hardware`) the planner times ops and copies with.
        planner: "swapadvisor", "vdnn", "lru" (see `tvm_ext.swap.plan_swaps`).
        time_budget_s, seed: for the SwapAdvisor search.
        plan: a `SwapPlan` (or its JSON) to apply instead of planning.
        op_times: measured seconds per op, instead of the roofline.
        function: the function to rewrite.
        reserved_bytes: device memory outside the graph (the vendor library's workspace): an
            absolute budget is shared with it.
    """

    def __init__(
        self,
        device_memory: int | str | None = None,
        *,
        host: relax.VDevice | None = None,
        hardware: str | Hardware = "h100",
        planner: str = "swapadvisor",
        time_budget_s: float = 10.0,
        seed: int = 0,
        plan: SwapPlan | str | None = None,
        op_times: Sequence[float] | None = None,
        function: str = "main",
        reserved_bytes: int = 0,
    ):
        if device_memory is None and plan is None:
            raise ValueError("SwapOffload needs device_memory or a plan")
        self.device_memory = device_memory
        self.host = host
        self.hardware = hardware
        self.planner = planner
        self.time_budget_s = time_budget_s
        self.seed = seed
        self.plan = SwapPlan.from_json(plan) if isinstance(plan, str) else plan
        self.op_times = op_times
        self.function = function
        self.reserved_bytes = reserved_bytes

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext):
        names = [gv.name_hint for gv in mod.functions]
        if self.function in names and has_record(mod[self.function], SWAP_PLAN_ATTR):
            return mod  # already swapped
        given = mod
        if self.plan is not None and self.plan.fissioned:
            given = self._fission(given, self.plan.fissioned)
        mod, graph, bindings, constants = read_pass_input(
            given, self.function, "SwapOffload", SwapOffloadError, _check_form)
        annotate_time_splits(mod, graph)
        target = tvm.target.Target.current(allow_none=True) or tvm.target.Target("llvm")
        if self.plan is not None:
            budget = self.plan.budget if self.device_memory is None else self.device_memory
            # A plan's own budget is what it was planned under, the reserve already out.
            reserved = self.reserved_bytes if self.device_memory is not None else 0
            problem = problem_for_budget(graph, budget, self.hardware, self.op_times, reserved)
            plan = self.plan
            try:
                validate(problem, plan)
            except Exception as err:  # PlanError, or ids that do not fit this graph
                raise SwapOffloadError(f"the plan given does not fit this function: {err}") \
                    from err
        else:
            plan = plan_module_swaps(
                mod, self.device_memory, target=str(target.kind.name), hardware=self.hardware,
                planner=self.planner, seed=self.seed, time_budget_s=self.time_budget_s,
                op_times=self.op_times, reserved=self.reserved_bytes, function=self.function,
                graph=graph).plan
            if plan.fissioned:  # rewritten on the graph of its parts, which it indexes
                given = self._fission(given, plan.fissioned)
                mod, graph, bindings, constants = read_pass_input(
                    given, self.function, "SwapOffload", SwapOffloadError, _check_form)
                annotate_time_splits(mod, graph)
        func = given[self.function]
        device = relax.VDevice(target, 0, "global")
        host = self.host or host_vdevice(target)
        rewriter = _Rewriter(graph, bindings, constants, plan, device, host,
                             _match_casts(mod[self.function]), mod)
        new_func = rewriter.rewrite(func)
        mod = mod.clone()
        mod.update_func(mod.get_global_var(self.function), new_func)
        for gv, kernel in [*rewriter.kernels, *rewriter.chunk_kernels.values()]:
            mod[gv] = kernel
        mod.update_global_info("vdevice", [device, host])
        return drop_unused(mod, [gv for gv, _ in rewriter.replaced])

    def _fission(self, mod: tvm.IRModule, kernels: list[str]) -> tvm.IRModule:
        """`mod` with the named kernels run as their parts (`kernel_fission`)."""
        try:
            return fission_kernels(mod, kernels, self.function)
        except (LoweringError, KeyError, ValueError) as err:
            raise SwapOffloadError(f"the plan runs kernels as their parts, which this module "
                                   f"cannot: {err}") from err


def _match_casts(func: relax.Function) -> dict:
    """Var -> the MatchCast bindings of it (the symbolic values it defines)."""
    casts: dict = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            if isinstance(binding, relax.MatchCast) and isinstance(binding.value, relax.Var):
                casts.setdefault(binding.value, []).append(binding)
    return casts


def _check_form(func: relax.Function) -> None:
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and \
                    value.op.name in ("relax.builtin.alloc_tensor", "relax.memory.alloc_storage",
                                      "relax.vm.alloc_storage"):
                raise SwapOffloadError(
                    "the function is already lowered to explicit memory: run SwapOffload "
                    "before dataflow lowering (tvm_ext.pipeline.dataflow_lower_passes, i.e. "
                    "before CallTIRRewrite)")


class _Rewriter:
    """Emits the planned function (see the module docstring)."""

    def __init__(self, graph, bindings, constants, plan: SwapPlan, device, host,
                 match_casts: dict | None = None, mod: tvm.IRModule | None = None):
        self.g = graph
        self.mod = mod  # the kernels: for in-place forms and the chunk kernels of split ops
        self.kernels: list = []  # (GlobalVar, PrimFunc) of the in-place kernels made
        self.replaced: list = []  # (kernel, its in-place form)
        self.bindings = bindings
        self.match_casts = match_casts or {}
        self.scalar_ops: set[int] = set()
        self.const_expr = {tid: c for c, tid in constants.items()}
        self.plan = plan
        self.device, self.host = device, host
        self.bb = relax.BlockBuilder()
        self.cur: dict[int, relax.Expr] = {}  # tensor -> its device value now
        self.host_val: dict[int, relax.Expr] = {}  # tensor -> its host copy
        self.swapped_out_var: dict[int, relax.Expr] = {}  # swap-out index -> device value copied
        self.waited_out: set[int] = set()  # swap-outs already waited for (waits are in order)
        self.chunk_kernels: dict[tuple, tuple] = {}  # (kernel, dim, chunks, adds) -> (gv, PrimFunc)
        # kernel -> its KernelDims; (kernel, dim, "epilogue") -> its ReductionEpilogue
        self.analyses: dict = {}

    # ------------------------------------------------------------------ helpers
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

    # ------------------------------------------------------------------ the function
    def rewrite(self, func: relax.Function) -> relax.Function:
        g, plan = self.g, self.plan
        on_host = set(plan.host_start)
        where = argument_devices(g, plan)
        params = [relax.Var(p.name, relax.TensorType(
                      p.ty.shape, p.ty.dtype, self.host if w == HOST else self.device))
                  for p, w in zip(func.params, where, strict=True)]
        for t in g.tensors:
            if t.arg_index is not None:
                (self.host_val if t.id in on_host else self.cur)[t.id] = params[t.arg_index]
            elif t.kind == "constant" and t.id in self.const_expr:
                self.cur[t.id] = self.const_expr[t.id]

        produced_at: dict[int, list[int]] = {}
        swap_in_after: dict[int, list[int]] = {}
        swap_out_after: dict[int, list[int]] = {}
        waits_before: dict[int, list[int]] = {}
        for i, r in enumerate(plan.residencies):
            if r.source == "produced":
                produced_at.setdefault(r.begin, []).append(i)
        split_at = plan.split_at()
        streamed = {(t, sp.position) for sp in plan.splits for t in sp.cut_outputs}
        for k, s in enumerate(plan.swap_ins):
            if s.residency >= 0:  # a split op streams its own inputs
                swap_in_after.setdefault(s.after, []).append(k)
                waits_before.setdefault(s.before, []).append(k)
        for k, s in enumerate(plan.swap_outs):
            if (s.tensor, s.after) not in streamed:  # ... and outputs
                swap_out_after.setdefault(s.after, []).append(k)

        kept = {k: func.attrs[k] for k in (UPDATES_ATTR, STATE_ATTR)
                if func.attrs is not None and k in func.attrs}
        attrs = {**kept, "num_input": g.num_input, "relax.force_pure": True,
                 SWAP_PLAN_ATTR: json.dumps(plan.summary()),
                 SWAP_ARGS_ATTR: ["host" if w == HOST else "device" for w in where]}
        # Pure from the outside (force_pure): the impure copies and waits stay inside.
        with self.bb.function("main", params, attrs=attrs, pure=True):
            self.pools = [self.emit(relax.op.memory.alloc_storage(
                relax.ShapeExpr([size]), DEVICE, "global", "uint8"), f"pool{i}")
                for i, size in enumerate(plan.pools)]
            self.host_pool = self._host_pool()
            self._scalar_ops()
            self._swap_ins(swap_in_after.get(-1, []))
            for pos, op_id in enumerate(plan.schedule):
                for ri in produced_at.get(pos, []):
                    self.wait_swap_out(plan.residencies[ri].wait_swap_out)
                for k in waits_before.get(pos, []):
                    self.emit(swap_calls.wait_call(
                        self.cur[plan.swap_ins[k].tensor], H2D))
                if pos in split_at:
                    self._split_op(split_at[pos], produced_at.get(pos, []))
                else:
                    self._op(op_id, produced_at.get(pos, []))
                self._swap_outs(swap_out_after.get(pos, []))
                self._swap_ins(swap_in_after.get(pos, []))
            self.emit(swap_calls.wait_all_call())
            outputs = []
            for tid in g.outputs:
                base = g.base(tid)
                if base in plan.outputs_on_host:
                    value = self.host_val[base]
                    if base != tid and g.tensors[tid].overwrites is None:
                        value = self.emit(relax.op.reshape(
                            value, relax.ShapeExpr(list(g.tensors[tid].shape))))
                    outputs.append(value)
                else:
                    outputs.append(self.value_of(tid))
            ret = func.body.body
            result = relax.Tuple(outputs) if isinstance(ret, relax.Tuple) or len(outputs) != 1 \
                else outputs[0]
            self.bb.emit_func_output(result)
        return self.bb.get()["main"]

    def _host_pool(self):
        """One host buffer holding every tensor the plan swaps out, each at its own offset,
        but the outputs returned from the host: each its own host tensor, so that the return
        value the caller keeps holds nothing else."""
        offsets, total = {}, 0
        returned = set(self.plan.outputs_on_host)
        for s in self.plan.swap_outs:
            if s.tensor not in offsets and s.tensor not in returned:
                offsets[s.tensor] = total
                total += align(self.g.tensors[s.tensor].nbytes)
        self.host_offsets = offsets
        if not total:
            return None
        return self.emit(swap_calls.host_storage_call(total, HOST, DEVICE), "host_pool")

    def _scalar_ops(self) -> None:
        """Packed calls with no tensor argument or result (the worker id a partitioned kernel
        computes its chunk index from) and the symbolic values they define: first, since the
        calls that use those values do not depend on them through tensors."""
        for op in self.g.ops:
            if op.kind != "builtin" or op.inputs or op.outputs:
                continue
            binding = self.bindings[op.id]
            var = self.emit(binding.value, binding.var.name)
            for cast in self.match_casts.get(binding.var, []):
                self.bb.match_cast(var, cast.ty, cast.var.name)
            self.scalar_ops.add(op.id)

    def _op(self, op_id: int, residencies: list[int]) -> None:
        g = self.g
        op = g.ops[op_id]
        value = self.bindings[op_id].value
        if op.kind == "view" or op_id in self.scalar_ops:
            return  # views are re-derived at each use; scalar ops were emitted first
        outs_by_tensor = {self.plan.residencies[ri].tensor: ri for ri in residencies}
        placed, written = {}, {}  # written: output index -> base it overwrites in place
        for j, tid in enumerate(op.outputs):
            if g.tensors[tid].overwrites is not None:
                written[j] = g.base(tid)
                continue
            if tid not in outs_by_tensor:
                raise SwapOffloadError(f"plan error: {g.tensors[tid].name} has no window at "
                                       f"its producer {op.name}")
            placed[j] = self.place(outs_by_tensor[tid])
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
        args = [self.value_of(t) if t is not None else f
                for t, f in zip(tensors, fields, strict=True)]
        # call_tir's third argument (symbolic shape values) follows the outputs.
        extra = list(value.args[2:3]) if name == "relax.call_tir" else []
        callee = value.args[0]
        if written:
            callee, passed = self._in_place(op, callee, name, tensors, written)
            if name == "relax.call_dps_packed":  # an extern writes its destination whole
                outs = [self.value_of(written[j]) if j in written else placed[j]
                        for j in range(len(op.outputs))]
            else:
                args += [self.value_of(b) for b in passed]
        self.emit(relax.Call(callee, [*args, *outs, *extra]))

    def _in_place(self, op, callee, name: str, tensors: list, written: dict):
        """The callee writing the outputs of `written` into their bases' device copies, and
        the bases passed as buffers to write (those the callee does not read)."""
        g = self.g
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
            kernel = inplace_kernel(self.mod[callee], len(tensors), positions)
        except InPlaceError as err:
            raise SwapOffloadError(f"{op.name}: {err}") from err
        names = {gv.name_hint for gv in self.mod.functions} | \
            {gv.name_hint for gv, _ in self.kernels}
        kname, k = f"{callee.name_hint}_inplace", 1
        while kname in names:
            kname, k = f"{callee.name_hint}_inplace{k}", k + 1
        gv = self.bb.add_func(kernel.without_attr("global_symbol"), kname)
        self.kernels.append((gv, self.bb.get()[gv]))
        self.replaced.append((callee, gv))
        return gv, [written[j] for j in sorted(written) if positions[j] is None]

    # ------------------------------------------------------------------ split ops
    def _split_op(self, sp, residencies: list[int]) -> None:
        """An op run in chunks (`tvm_ext.swap.split`): its cut inputs come in from their host
        copies a chunk at a time into its buffers (with two, the next chunk is copied while
        the current one is read), its cut outputs leave for their host copies from its
        buffers, and the chunk kernel runs once per chunk with its chunk's index. A split that
        accumulates writes its outputs whole into their windows (`residencies`): chunk 0's
        kernel starts them, every later chunk's adds to them; with an epilogue they add up
        its intermediates, and the epilogue runs once after the last chunk."""
        g = self.g
        op = g.ops[sp.op]
        value = self.bindings[sp.op].value
        self.wait_swap_out(sp.wait_swap_out)
        cut_in, cut_out = set(sp.cut_inputs), set(sp.cut_outputs)
        offset = [sp.offset]
        axis = self._cut_axes(op, sp)
        halos = self._halos(op, sp)

        def buffers(tid: int) -> list:
            pair, offset[0] = self._chunk_buffers(sp, tid, axis[tid], halos.get(tid), offset[0])
            return pair

        # One pair per tensor, also where the op reads it twice; copied in the plan's stream
        # order (its cut inputs' order).
        ins: dict[int, list] = {}
        for tid in sorted((t for t in op.inputs if g.base(t) in cut_in),
                          key=lambda t: list(sp.cut_inputs).index(g.base(t))):
            if tid not in ins:
                ins[tid] = buffers(tid)
        viewed = {tid for tid in op.inputs if g.base(tid) in set(sp.viewed_inputs)}
        outs = [] if sp.accumulate else [buffers(tid) for tid in op.outputs]
        whole = self._place_whole_outputs(op, residencies) if sp.accumulate else []
        # What the chunks add up: the outputs, or an epilogue's intermediates (in the outputs'
        # own buffers where the epilogue finishes in place, else after the chunk buffers).
        epilogue = self._epilogue(op, sp) if sp.epilogue else None
        targets = whole if epilogue is None else \
            self._intermediates(epilogue, whole, sp, offset[0])
        for tid in cut_out:
            self._host_copy_of(tid)
        gv = self._chunk_kernel(op, sp)
        gv_rest = self._accumulating_chunk_kernel(op, sp) if sp.accumulate else gv
        index_params = self._new_chunk_params(op, sp)
        inner = sp.option().inner_chunks(sp.chunks)
        fields = value.args[1].fields if isinstance(value.args[1], relax.Tuple) \
            else [value.args[1]]
        nb = sp.buffers
        if offset[0] - sp.offset > sp.nbytes:
            raise SwapOffloadError(f"plan error: {op.name}'s chunk buffers take "
                                   f"{offset[0] - sp.offset} bytes, the plan has {sp.nbytes}")
        for tid, pair in ins.items():
            self._copy_chunk(tid, axis[tid], sp, 0, pair[0], H2D, halos.get(tid))
        for j in range(sp.chunks):
            b = j % nb
            for tid, pair in ins.items():
                if j > 0 and nb == 1:  # the buffer is free again: the kernel has run
                    self._copy_chunk(tid, axis[tid], sp, j, pair[0], H2D, halos.get(tid))
                if j + 1 < sp.chunks and nb == 2:
                    self._copy_chunk(tid, axis[tid], sp, j + 1, pair[1 - b], H2D,
                                     halos.get(tid))
                self.emit(swap_calls.wait_call(pair[b], H2D))
            if j >= nb:
                for pair in outs:  # its previous chunk has left
                    self.emit(swap_calls.wait_call(pair[b], D2H))
            args = self._chunk_args(op, fields, sp, j, {t: p[b] for t, p in ins.items()},
                                    viewed, axis)
            if epilogue is not None:  # the reduction part reads some of the inputs
                args = [args[k[1]] for k in epilogue.reduction.inputs]
            # The index of the chunk along the split dim (within its item, with an outer dim,
            # whose index no kernel takes).
            chunk = [relax.prim_value(tvm.tirx.IntImm("int64", j % inner))
                     for _ in range(index_params)]
            # Chunks after the first start from what the targets hold: passed as inputs.
            prev = targets if j > 0 else []
            self.emit(relax.Call(gv if j == 0 else gv_rest,
                                 [*args, *chunk, *prev, *(pair[b] for pair in outs), *targets]))
            for tid, pair in zip(op.outputs if outs else [], outs, strict=True):
                self._copy_chunk(tid, axis[tid], sp, j, pair[b], D2H)
        if epilogue is not None:
            self._finish(op, sp, epilogue, targets, whole)
        self._note_last_chunks_swapped_out(op, sp, outs)

    def _note_last_chunks_swapped_out(self, op, sp, outs: list) -> None:
        """A cut output's swap-out is done when its last chunk's copy is: later waits on the
        swap-out wait on that chunk buffer."""
        cut_out = set(sp.cut_outputs)
        for k, s in enumerate(self.plan.swap_outs):
            if s.tensor in cut_out and s.after == sp.position:
                self.swapped_out_var[k] = outs[list(op.outputs).index(s.tensor)][
                    (sp.chunks - 1) % sp.buffers]

    def _epilogue(self, op, sp):
        """`op`'s kernel cut after its reduction over the split dim (`epilogue_kernels`)."""
        key = (op.kernel, sp.dim, "epilogue")
        if key not in self.analyses:
            self.analyses[key] = reduction_epilogue(self._kernel_dims(op), sp.dim)
            if self.analyses[key] is None:
                raise SwapOffloadError(f"{op.name}: {op.kernel} has no epilogue after its "
                                       f"reduction over dim {sp.dim} to run once")
        return self.analyses[key]

    def _intermediates(self, epilogue, whole: list, sp, offset: int) -> list:
        """The buffers an epilogue split's chunks add up: the output's own where the
        epilogue finishes in place, else scratch placed after the chunk buffers."""
        if epilogue.in_place:
            return whole
        out = []
        for buf in output_params(epilogue.reduction.func, len(epilogue.reduction.outputs)):
            alloc = relax.op.memory.alloc_tensor(
                self.pools[sp.pool], relax.prim_value(offset),
                relax.ShapeExpr([int(n) for n in buf.ty.shape]), str(buf.ty.dtype))
            out.append(self.emit(relax.op.memory.ensure_zero_offset(self.emit(alloc))))
            offset += align(buffer_bytes(buf.ty.shape, buf.ty.dtype))
        return out

    def _finish(self, op, sp, epilogue, targets: list, whole: list) -> None:
        """After the last chunk: the epilogue computes the outputs from the intermediates
        (`targets`) and the inputs it reads whole, in place or into the outputs."""
        key = (op.kernel, sp.dim, sp.chunks, "epilogue")
        if key not in self.chunk_kernels:
            name = chunk_kernel_name(op.kernel, sp.chunks, sp.dim, epilogue=True,
                                     outer_dim=sp.outer_dim)
            kernel = epilogue.epilogue.func.with_attr("global_symbol", name)
            self.chunk_kernels[key] = (self.bb.add_func(kernel, name), kernel)
        # In place, the intermediate is the output's buffer: passed as both.
        made = dict(zip(epilogue.reduction.outputs, targets, strict=True))
        args = [made[k] if k[0] == "tmp" else self.value_of(op.inputs[k[1]])
                for k in epilogue.epilogue.inputs]
        self.emit(relax.Call(self.chunk_kernels[key][0], [*args, *whole]))

    def _chunk_args(self, op, fields, sp, j: int, buffers: dict, viewed: set,
                    axis: dict) -> list:
        """The arguments of chunk j's kernel call before its chunk indices: each cut input's
        chunk (its buffer now, or a view of it where it stays on the device), the other
        tensors whole, and the call's other arguments as they are."""
        inputs = iter(op.inputs)
        args = []
        for f in fields:
            if isinstance(f.ty, relax.TensorType):
                tid = next(inputs)
                if tid in viewed:  # kept on the device: chunk j is a view of it
                    args.append(self._device_chunk(tid, axis[tid], sp, j))
                else:
                    args.append(buffers[tid] if tid in buffers else self.value_of(tid))
            else:
                args.append(f)
        return args

    def _place_whole_outputs(self, op, residencies: list[int]) -> list[relax.Var]:
        """The outputs of a split that accumulates, each in its window."""
        by_tensor = {self.plan.residencies[ri].tensor: ri for ri in residencies}
        missing = [self.g.tensors[t].name for t in op.outputs if t not in by_tensor]
        if missing:
            raise SwapOffloadError(f"plan error: {', '.join(missing)} has no window at its "
                                   f"producer {op.name}")
        return [self.place(by_tensor[t]) for t in op.outputs]

    def _device_chunk(self, tid: int, axis: int, sp, j: int) -> relax.Var:
        """Chunk j of a cut input kept on the device: a view of its bytes (its leading axis is
        cut, at an offset that is a multiple of the alignment, so a kernel may read it)."""
        t = self.g.tensors[tid]
        if sp.outer_dim >= 0:
            raise SwapOffloadError(f"plan error: {t.name} is read in place by a split with an "
                                   "outer dim (its chunks are strided)")
        view = self.emit(relax.op.memory.view(
            self.value_of(tid), relax.ShapeExpr(_cut_shape(t.shape, axis, sp.chunks)), None,
            relax.prim_value(tvm.tirx.IntImm("int64",
                                             j * self._chunked_bytes(tid) // sp.chunks))))
        return self.emit(relax.op.memory.ensure_zero_offset(view))

    def _copy_chunk(self, tid: int, axis: int, sp, j: int, buffer: relax.Var,
                    stream: int, halo: tuple[int, int] | None = None) -> None:
        """Chunk j of tensor `tid` (cut along `axis` as the op reads or writes it) from its
        base's host copy into `buffer` (H2D), or from `buffer` back (D2H); the runtime copies
        it whole when every axis before `axis` is 1, else row by row (`copy_chunk_async`). With
        a `halo` (rows before, after), the chunk's input range in (`copy_window_async`). With
        an outer dim, the inner chunk of its item (`SplitOption.outer_dim`)."""
        t = self.g.tensors[tid]
        host = self._host_copy_of(self.g.base(tid))
        item, j = divmod(j, sp.option().inner_chunks(sp.chunks))
        if tid != self.g.base(tid) or sp.outer_dim >= 0:
            # The base's bytes, shaped as the op reads them; of a split with an outer dim, those
            # of the chunk's item (its axis 0 cut so), whose inner chunk j this copies.
            shape = _cut_shape(t.shape, 0, sp.outer_chunks)
            host = self.emit(relax.op.memory.view(
                host, relax.ShapeExpr(shape), None,
                relax.prim_value(item * self._chunked_bytes(tid) // sp.outer_chunks)))
        inner = sp.option().inner_chunks(sp.chunks)
        name = self.g.tensors[self.g.base(tid)].name
        if halo is not None:
            start = j * (int(t.shape[axis]) // inner) - halo[0]
            self.emit(swap_calls.copy_window_async_call(host, buffer, stream, axis, start, name))
            return
        self.emit(swap_calls.copy_chunk_async_call(host, buffer, stream, axis, j,
                                                   stream == H2D, name))

    def _stream(self, src, dst, stream: int) -> None:
        self.emit(swap_calls.copy_async_call(src, dst, stream, ""))

    def _host_copy_of(self, tid: int) -> relax.Expr:
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

    def _chunked_bytes(self, tid: int) -> int:
        """Bytes of tensor `tid` as a split op cuts it: a view's are its base's (a view holds no
        bytes of its own in the graph; `time_splits` offers only views that cover their base)."""
        return self.g.tensors[self.g.base(tid)].nbytes

    @staticmethod
    def _chunk_key(op, sp, accumulating: bool = False) -> tuple:
        return (op.kernel, sp.dim, sp.outer_dim, sp.chunks, accumulating)

    def _kernel_dims(self, op):
        """The index analysis of `op`'s kernel (once per kernel)."""
        if op.kernel not in self.analyses:
            self.analyses[op.kernel] = kernel_dims(self.mod[op.kernel], len(op.outputs),
                                                      op.kernel)
        return self.analyses[op.kernel]

    def _cut_axes(self, op, sp) -> dict[int, int]:
        """The axis split op `op`'s dim cuts in each of its cut inputs and outputs, as the op
        reads and writes them."""
        dim = self._kernel_dims(op).spec.dims[sp.dim]
        axes = {tid: c.axis for tid, c in zip(op.inputs, dim.inputs, strict=True)
                if c is not None}
        if not sp.accumulate:  # (a reduction's outputs are not cut)
            axes.update(zip(op.outputs, dim.outputs, strict=True))
        return axes

    def _chunk_buffers(self, sp, tid: int, axis: int, halo: tuple[int, int] | None,
                       offset: int) -> tuple[list, int]:
        """`sp.buffers` chunk buffers of tensor `tid` (cut along `axis`; with a `halo`, the
        chunk's input range, halo rows included) in the split's window from `offset`; and the
        offset after them."""
        t = self.g.tensors[tid]
        inner = sp.option().inner_chunks(sp.chunks)
        shape = _cut_shape(_cut_shape(t.shape, 0, sp.outer_chunks), axis, inner)
        if halo is not None:
            shape[axis] = chunk_rows(int(t.shape[axis]), inner, *halo)
        # As the plan sized them (its halo rows included).
        nbytes = tensor_chunk_bytes(sp.option(), self.g.base(tid), self._chunked_bytes(tid),
                                    sp.chunks)
        pair = []
        for _ in range(sp.buffers):
            alloc = relax.op.memory.alloc_tensor(self.pools[sp.pool], relax.prim_value(offset),
                                                 relax.ShapeExpr(shape), t.dtype)
            pair.append(self.emit(relax.op.memory.ensure_zero_offset(self.emit(alloc))))
            offset += nbytes
        return pair, offset

    def _halos(self, op, sp) -> dict[int, tuple[int, int]]:
        """The inputs split op `op` reads through windows: (halo rows before, after)."""
        dim = self._kernel_dims(op).spec.dims[sp.dim]
        return {tid: (c.halo_lo, c.halo_hi) for tid, c in zip(op.inputs, dim.inputs, strict=True)
                if c is not None and c.halo}

    def _new_chunk_params(self, op, sp) -> int:
        """How many chunk indices the chunk kernel of `op` takes beyond those of the op's own
        kernel (a kernel partitioned across devices already takes its device's chunk, which
        the op's call passes)."""
        chunk_kernel = self.chunk_kernels[self._chunk_key(op, sp)][1]
        return len(chunk_params(chunk_kernel)) - len(chunk_params(self._kernel_dims(op).func))

    def _chunk_kernel(self, op, sp):
        """The kernel of one chunk of `op` (`local_kernel`), made once per kernel and split."""
        key = self._chunk_key(op, sp)
        if key not in self.chunk_kernels:
            part = self._epilogue(op, sp).reduction if sp.epilogue else None
            try:
                kd = self._kernel_dims(op)
                factors = {sp.dim: sp.option().inner_chunks(sp.chunks)}
                if sp.outer_dim >= 0:
                    factors[sp.outer_dim] = sp.outer_chunks
                kernel = local_kernel(kd, factors,
                                      func=part.func if part else None, halo=has_halo(kd, sp.dim),
                                      num_outputs=len(part.outputs) if part else None)
            except LoweringError as err:
                raise SwapOffloadError(f"{op.name}: cannot run in {sp.chunks} chunks: {err}") \
                    from err
            name = chunk_kernel_name(op.kernel, sp.chunks, sp.dim, outer_dim=sp.outer_dim)
            kernel = kernel.with_attr("global_symbol", name)
            self.chunk_kernels[key] = (self.bb.add_func(kernel, name), kernel)
        return self.chunk_kernels[key][0]

    def _accumulating_chunk_kernel(self, op, sp):
        """The kernel of every chunk of `op` after the first in a split that accumulates: the
        chunk kernel starting from what the outputs hold (`accumulating_kernel`; the outputs
        are passed twice, as its `_prev` inputs and as its outputs)."""
        key = self._chunk_key(op, sp, accumulating=True)
        if key not in self.chunk_kernels:
            self._chunk_kernel(op, sp)
            first = self.chunk_kernels[self._chunk_key(op, sp)][1]
            n_out = len(self._epilogue(op, sp).reduction.outputs) if sp.epilogue \
                else len(op.outputs)
            try:
                kernel = accumulating_kernel(first, output_params(first, n_out))
            except ValueError as err:
                raise SwapOffloadError(f"{op.name}: cannot add its chunks up: {err}") from err
            name = chunk_kernel_name(op.kernel, sp.chunks, sp.dim, accumulating=True,
                                     outer_dim=sp.outer_dim)
            kernel = kernel.with_attr("global_symbol", name)
            self.chunk_kernels[key] = (self.bb.add_func(kernel, name), kernel)
        return self.chunk_kernels[key][0]

    def _swap_outs(self, indices: list[int]) -> None:
        for k in indices:
            s = self.plan.swap_outs[k]
            t = self.g.tensors[s.tensor]
            src = self.cur[s.tensor]
            self.emit(swap_calls.copy_async_call(src, self._host_copy_of(s.tensor), D2H, t.name))
            self.swapped_out_var[k] = src
            del self.cur[s.tensor]

    def _swap_ins(self, indices: list[int]) -> None:
        for k in indices:
            s = self.plan.swap_ins[k]
            t = self.g.tensors[s.tensor]
            # No wait here for the swap-out of what the window held (or of the tensor's own
            # data): the runtime orders copies on different streams that touch the same memory
            # (src/swap/copy_streams.cc), so the swap-in waits on its stream as the simulator
            # has it, and the compute goes on.
            dst = self.place(s.residency)
            self.emit(swap_calls.copy_async_call(self.host_val[s.tensor], dst, H2D, t.name))


def _cut_shape(shape, axis: int, chunks: int) -> list[int]:
    """The shape of one of `chunks` chunks of a tensor cut along `axis`."""
    dims = [int(x) for x in shape]
    dims[axis] //= chunks
    return dims
