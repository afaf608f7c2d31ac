"""PartitionOperators: rewrite `main` into the code every one of k devices runs (SPMD), by a
Tofu partition plan, with explicit collectives between the operators.

Input: a module after the legalize phase (`tvm_ext.pipeline.legalize_passes`: legalized and
fused), before dataflow lowering. The pass

1. reads `main` into a `DataflowGraph` and each kernel's dims from its TIR
   (`tvm_ext.ir.kernel_dims`), finds the dims this lowering cannot express
   (`tvm_ext.ir.local_kernels.lowering_obstacle`, `reshape_obstacle`) and plans with those dims
   disallowed (`plan_partition(..., disallow=...)`), so that the plan's traffic and per-device
   memory are those of the code that runs; or checks a given plan against the graph;
2. emits the local view of every operator: each argument with its stored layout's local shape;
   before an op, each input converted from its stored layout to the scheme the op's strategy
   requires; the op itself on the local pieces (a kernel shrunk along its split dims,
   `tvm_ext.ir.local_kernels.local_kernel`; a reshape of the local piece); after it, each output
   converted from the produced scheme (PARTIAL after a split reduction) to its stored layout.
   A kernel that reduces over a split dim and reads the result again (a matmul with its bias,
   softmax, layer norm, batch statistics) is cut after each such block (`split_kernel`) with an
   allreduce between the parts; a kernel that uses a split dim's index as a value (one-hot,
   argmax positions) or in the index of an axis the dim does not cut (an input read whole)
   takes the index of its chunk, computed from `runtime.disco.worker_id`, and maps its local
   indices to global ones: a contiguous chunk, or the strided blocks of a dim split below a
   mesh level that does not split it.
   Not lowered (so never planned, and reported): windows reading across chunks (a
   convolution or pooling split on height or width needs a halo exchange), reshapes whose
   pieces are not reshapes of each other, loops that do not bind a split variable directly;
3. conversions per mesh level, in the plan's order (slices and reduce-scatters, then
   all-to-alls and allreduces, then allgathers, deepest level first): TVM's
   `R.ccl.allreduce` / `R.ccl.allgather` (legalized) when a collective spans every device, else
   the runtime library's mesh collectives `tvm_ext.ccl.mesh_*` (one mesh level, any axis, see
   src/ccl/ccl_mesh.cc); a slice reads the worker's mesh coordinate at run time (no messages);
4. records the layouts of the arguments and outputs, the plan summary and every fallback (a
   split the partitioner could choose but this lowering cannot express, with the reason, and
   the ops where the unrestricted plan chose it) in the function attribute
   `tvm_ext.partition` (JSON); `tvm_ext.ir.pass_records.partition_record(mod)` reads it back.

The devices form the plan's mesh (level 1 outermost); worker w has coordinates c with
`w = sum_l c_l * p_{l+1} * ... * p_L` and holds, of each tensor, the blocks named by the index
convention of `tvm_ext.partition.layout` (`tvm_ext.partition.sharding` places and gathers them).
A module partitioned here runs on a `tvm_ext.runtime.distributed.Session` of k workers (cpu or
nccl).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from tvm_ext.cost import Hardware
from tvm_ext.errors import InputError
from tvm_ext.graph import DataflowGraph
from tvm_ext.ir.graph_builder import read_pass_input
from tvm_ext.ir.kernel_dims import problem_from_module
from tvm_ext.ir.local_kernels import LoweringError, chunk_params
from tvm_ext.ir.partition_lowering import PartitionLowering
from tvm_ext.ir.pass_records import PARTITION_ATTR, SWAP_PLAN_ATTR, has_record
from tvm_ext.partition import PartitionPlan, plan_partition
from tvm_ext.partition.layout import PARTIAL, REP, conversion_sequence, local_shape
from tvm_ext.partition.plan import in_place_mismatches, layouts_of
from tvm_ext.partition.sharding import level_stride
from tvm_ext.units import json_default

_REDUCE_KIND = {"sum": 0, "prod": 1, "min": 2, "max": 3, "avg": 4}
_HINT = ("run the legalize phase first (tvm_ext.pipeline.legalize_passes: LegalizeOps, "
         "AnnotateTIROpPattern, FoldConstant, FuseOps, FuseTIR)")


class PartitionError(InputError):
    """The module is not in a form PartitionOperators rewrites, or the plan does not fit it."""


def _plan(problem, lowering, num_devices, hardware, strategy, link, topology, compare):
    if num_devices < 1:
        raise PartitionError(f"the number of devices must be at least 1, got {num_devices}")
    plan = plan_partition(problem, num_devices, link=link, strategy=strategy,
                          hardware=hardware, topology=topology, disallow=lowering.disallow)
    unrestricted = None
    if compare and num_devices > 1 and any(lowering.disallow.values()):
        unrestricted = plan_partition(problem, num_devices, link=link, strategy=strategy,
                                      hardware=hardware, topology=topology)
    fallbacks = lowering.fallbacks(unrestricted)
    summary = unrestricted.summary() if unrestricted is not None else {}
    return plan, fallbacks, summary


def _read(mod: tvm.IRModule, function: str):
    mod, graph, bindings, constants = read_pass_input(
        mod, function, "PartitionOperators", PartitionError, _check_form)
    problem = problem_from_module(mod, graph, function)
    return mod, graph, bindings, constants, problem


def _check_form(func: relax.Function) -> None:
    if has_record(func, SWAP_PLAN_ATTR):
        raise PartitionError("the function is already swapped (SwapOffload): partition first, "
                             "then swap per device")
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if not isinstance(value, relax.Call):
                continue
            if isinstance(value.op, tvm.ir.GlobalVar) or (
                    isinstance(value.op, tvm.ir.Op) and value.op.name in (
                        "relax.builtin.alloc_tensor", "relax.memory.alloc_storage",
                        "relax.memory.alloc_tensor")):
                raise PartitionError(
                    "the function is already lowered (destination-passing calls, explicit "
                    "memory): run PartitionOperators after the legalize phase and before "
                    "dataflow lowering (tvm_ext.pipeline.dataflow_lower_passes)")
            if isinstance(value.op, tvm.ir.Op) and value.op.name.startswith("relax.") and \
                    value.op.name not in ("relax.call_tir", "relax.call_tir_inplace",
                                          "relax.call_dps_packed", "relax.call_packed",
                                          "relax.call_pure_packed", "relax.reshape",
                                          "relax.memory.view",
                                          "relax.memory.ensure_zero_offset"):
                raise PartitionError(f"{binding.var.name}: operator {value.op.name} is not "
                                     f"lowered to a kernel; {_HINT}")


@tvm.transform.module_pass(opt_level=0, name="PartitionOperators")
class PartitionOperators:
    """Partition `main` over `num_devices` devices and rewrite it into per-worker code.

    Args:
        num_devices: k >= 1 (k = 1 leaves the computation as it is, with the attribute).
        hardware: the cost-model preset (or `Hardware`) the partitioner times ops with.
        strategy: "tofu", "data_parallel", "megatron", "exact" (see `plan_partition`).
        plan: a `PartitionPlan` (or its JSON) to apply instead of planning; it must be a plan
            of this function (same ops and tensors) for `num_devices` devices.
        link: the link between devices (see `tvm_ext.cost.LINKS`).
        topology: mesh levels `[(devices, link), ...]`, outermost first (see `make_model`).
        compare_unrestricted: also plan without the lowering's restrictions, to report which
            of the partitioner's preferred splits fell back.
        function: the function to rewrite.
    """

    def __init__(
        self,
        num_devices: int,
        *,
        hardware: str | Hardware = "h100",
        strategy: str = "tofu",
        plan: PartitionPlan | str | None = None,
        link: str = "nvlink",
        topology=None,
        compare_unrestricted: bool = True,
        function: str = "main",
    ):
        if not isinstance(num_devices, (int, np.integer)) or num_devices < 1:
            raise PartitionError(f"the number of devices must be an integer >= 1, got "
                                 f"{num_devices!r}")
        self.num_devices = int(num_devices)
        self.hardware = hardware
        self.strategy = strategy
        self.plan = PartitionPlan.from_json(plan) if isinstance(plan, str) else plan
        if self.plan is not None and self.plan.num_devices != self.num_devices:
            raise PartitionError(f"the plan given partitions over {self.plan.num_devices} "
                                 f"devices, not {self.num_devices}: plan again for "
                                 f"{self.num_devices} devices")
        self.link = link
        self.topology = topology
        self.compare_unrestricted = compare_unrestricted
        self.function = function

    def plan_module(self, mod: tvm.IRModule) -> tuple[PartitionPlan, list[dict], dict]:
        """Plan a legalized, fused module as the pass would (without rewriting it): the plan,
        the fallbacks (see `PartitionLowering.fallbacks`) and the unrestricted plan's summary
        (what the partitioner would choose if every split could be lowered; {} unless
        `compare_unrestricted`). With a given plan: that plan, checked against the module."""
        mod, graph, _, _, problem = _read(mod, self.function)
        return self._decide(graph, problem, PartitionLowering(mod, graph, problem))

    def _decide(self, graph: DataflowGraph, problem, lowering: PartitionLowering):
        if self.plan is not None:
            _validate(self.plan, graph, problem, lowering)
            decided = self.plan, lowering.fallbacks(), {}
        else:
            decided = _plan(problem, lowering, self.num_devices, self.hardware, self.strategy,
                            self.link, self.topology, self.compare_unrestricted)
        mismatched = in_place_mismatches(decided[0], graph)
        if mismatched:
            raise PartitionError(f"the plan lays out {', '.join(mismatched[:3])} unlike the "
                                 "argument each overwrites in place: an update must keep its "
                                 "argument's layout")
        return decided

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext):
        names = [gv.name_hint for gv in mod.functions]
        if self.function in names and has_record(mod[self.function], PARTITION_ATTR):
            return mod  # already partitioned
        mod, graph, bindings, constants, problem = _read(mod, self.function)
        lowering = PartitionLowering(mod, graph, problem)
        plan, fallbacks, unrestricted = self._decide(graph, problem, lowering)
        bb = relax.BlockBuilder(mod)
        func = _Emitter(graph, bindings, constants, problem, plan, lowering, bb).emit(
            mod[self.function])
        mod = bb.get()
        del mod["__partitioned_main"]
        info = {
            **layouts_of(plan, graph),
            "plan": plan.summary(), "fallbacks": fallbacks, "unrestricted": unrestricted,
        }
        func = func.with_attr(PARTITION_ATTR, json.dumps(info, default=json_default))
        original = mod[self.function].attrs
        if original is None or "global_symbol" not in original:
            func = func.without_attr("global_symbol")
        else:
            func = func.with_attr("global_symbol", original["global_symbol"])
        mod.update_func(mod.get_global_var(self.function), func)
        return _drop_unused_kernels(mod)


def _validate(plan: PartitionPlan, graph: DataflowGraph, problem, lowering) -> None:
    """A given plan must describe this graph and split only what this lowering expresses."""
    k = 1
    for p in plan.mesh:
        k *= p
    if k != plan.num_devices:
        raise PartitionError(f"the plan's mesh {plan.mesh} has {k} devices, not "
                             f"{plan.num_devices}")
    if len(plan.ops) != len(graph.ops) or len(plan.tensors) != len(graph.tensors):
        raise PartitionError(f"the plan has {len(plan.ops)} ops and {len(plan.tensors)} "
                             f"tensors; the function {len(graph.ops)} and {len(graph.tensors)}: "
                             "it is a plan of another model (plan this module again)")
    for o, op in zip(plan.ops, graph.ops, strict=True):
        if o.kernel != op.kernel or len(o.strategy) != len(plan.mesh):
            raise PartitionError(f"plan op {o.id} is {o.kernel}, the function's op "
                                 f"{op.id} is {op.kernel}: it is a plan of another model")
        key = problem.op_spec[op.id]
        for d in o.strategy:
            if d >= 0 and (key is None or d >= len(problem.specs[key].dims)):
                raise PartitionError(f"plan op {op.name} splits dim {d}, which {op.kernel} "
                                     "does not have")
            if d >= 0 and d in lowering.disallow.get(key, {}):
                raise PartitionError(
                    f"the plan splits {op.name} along {problem.specs[key].dims[d].name}, which "
                    f"PartitionOperators cannot lower: {lowering.disallow[key][d]}; make the "
                    "plan with PartitionOperators(...).plan_module (it restricts the "
                    "partitioner to what the pass lowers)")
    for t, tensor in zip(plan.tensors, graph.tensors, strict=True):
        if tuple(t.shape) != tuple(tensor.shape) or len(t.layout) != len(plan.mesh):
            raise PartitionError(f"plan tensor {t.name} has shape {t.shape}, the "
                                 f"function's {tensor.name} {list(tensor.shape)}: it is a plan "
                                 "of another model")


def _drop_unused_kernels(mod: tvm.IRModule) -> tvm.IRModule:
    used: set[str] = set()
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            used |= _called(func)
    out = mod.clone()
    for gv, func in mod.functions.items():
        if isinstance(func, tvm.tirx.PrimFunc) and gv.name_hint not in used:
            del out[gv]
    return out


def _called(func: relax.Function) -> set[str]:
    names: set[str] = set()
    tvm_ffi.structural_walk(func, [(tvm.ir.GlobalVar, lambda gv: names.add(gv.name_hint))])
    return names


class _Emitter:
    """Emits the per-worker function (steps 2-3 of the module docstring)."""

    def __init__(self, graph, bindings, constants, problem, plan: PartitionPlan, lowering,
                 bb: relax.BlockBuilder):
        self.g = graph
        self.bindings = bindings
        self.const_expr = {tid: c for c, tid in constants.items()}
        self.problem = problem
        self.plan = plan
        self.lowering = lowering
        self.bb = bb
        self.mesh = [int(p) for p in plan.mesh]
        self.levels = len(self.mesh)
        self.k = plan.num_devices
        self.layout = {t.id: [int(s) for s in t.layout] for t in plan.tensors}
        self.strategy = {o.id: [int(d) for d in o.strategy] for o in plan.ops}
        self.val: dict[int, relax.Expr] = {}
        self.worker = None  # the worker id as a symbolic int, once a kernel needs it
        # Vars of the original function that name one tensor (for packed-call arguments).
        self.var_tensor = {b.var: op.outputs[0] for op, b in zip(graph.ops, bindings,
                                                                 strict=True)
                           if len(op.outputs) == 1}

    # ------------------------------------------------------------------ the function
    def emit(self, func: relax.Function) -> relax.Function:
        g = self.g
        params = []
        args = sorted((t for t in g.tensors if t.arg_index is not None), key=lambda t: t.arg_index)
        for t, p in zip(args, func.params, strict=True):
            shape = local_shape(t.shape, self.mesh, self.layout[t.id])
            var = relax.Var(p.name, relax.TensorType(list(shape), t.dtype))
            params.append(var)
            self.val[t.id] = var
            self.var_tensor[p] = t.id
        attrs = dict(func.attrs) if func.attrs is not None else {}
        with self.bb.function("__partitioned_main", params, attrs=attrs, pure=True):
            with self.bb.dataflow():
                for op in g.ops:
                    self._op(op)
                outputs = [self.val[t] for t in g.outputs]
                ret = func.body.body
                result = relax.Tuple(outputs) if isinstance(ret, relax.Tuple) or \
                    len(outputs) != 1 else outputs[0]
                result = self.bb.emit_output(result)
            self.bb.emit_func_output(result)
        # Without the alias bindings the builder leaves between the last op and the outputs.
        mod = relax.transform.CanonicalizeBindings()(
            tvm.IRModule({"__partitioned_main": self.bb.get()["__partitioned_main"]}))
        return mod["__partitioned_main"]

    # ------------------------------------------------------------------ schemes
    def _required(self, spec, pos: int, strategy: list[int]) -> list[int]:
        out = []
        for d in strategy:
            cut = spec.dims[d].inputs[pos] if d >= 0 else None
            out.append(REP if cut is None else cut.axis)
        return out

    def _produced(self, spec, pos: int, strategy: list[int]) -> tuple[list[int], list[str]]:
        schemes, combiners = [], []
        for d in strategy:
            out = spec.dims[d].outputs[pos] if d >= 0 else None
            if out is None:
                schemes.append(REP)
                combiners.append("")
            elif isinstance(out, str):
                schemes.append(PARTIAL)
                combiners.append(out)
            else:
                schemes.append(int(out))
                combiners.append("")
        return schemes, combiners

    def _factors(self, strategy: list[int]) -> dict[int, int]:
        factors: dict[int, int] = {}
        for p, d in zip(self.mesh, strategy, strict=True):
            if d >= 0:
                factors[d] = factors.get(d, 1) * p
        return factors

    # ------------------------------------------------------------------ ops
    def _input(self, op, pos: int, tid: int, required: list[int]) -> relax.Expr:
        t = self.g.tensors[tid]
        if t.kind == "constant" and tid in self.const_expr:
            return self.convert(self.const_expr[tid], t, [REP] * self.levels, required)
        return self.convert(self.val[tid], t, self.layout[tid], required)

    def _op(self, op) -> None:
        strategy = self.strategy[op.id]
        spec = self.problem.spec(op.id)
        if op.kind == "kernel":
            self._kernel(op, spec, strategy)
        elif op.kind == "view":
            self._view(op, spec, strategy)
        else:
            self._builtin(op, strategy)

    def _kernel(self, op, spec, strategy) -> None:
        binding = self.bindings[op.id]
        value = binding.value
        if len(value.args) > 2:
            raise PartitionError(f"{op.name}: kernels with symbolic (tir_vars) arguments are not "
                                 "supported")
        unused = set(spec.unused_inputs)
        args, param_shapes = [], {}
        for pos, tid in enumerate(op.inputs):
            if pos in unused:
                t = self.g.tensors[tid]
                arg = self.const_expr[tid] if t.kind == "constant" and tid in self.const_expr \
                    else self.val[tid]
                shape = tuple(int(s) for s in arg.ty.shape.values)
                if shape != tuple(t.shape):
                    param_shapes[pos] = shape
                args.append(arg)
            else:
                args.append(self._input(op, pos, tid, self._required(spec, pos, strategy)))
        factors = self._factors(strategy)
        try:
            parts = self.lowering.local(self.bb, op.kernel, factors, param_shapes,
                                        self._strided_levels(strategy))
        except LoweringError as err:
            raise PartitionError(f"{op.name}: {err}") from err
        produced = [self._produced(spec, pos, strategy) for pos in range(len(op.outputs))]
        inner = self.lowering.inner_buffers(op.kernel, strategy) if len(parts) > 1 else {}
        values = {("in", i): a for i, a in enumerate(args)}
        for i, (gv, part) in enumerate(parts):
            params = [p for p in part.func.params if getattr(p, "shape", None) is not None]
            out_ty = [relax.TensorType([int(s) for s in p.shape], str(p.dtype))
                      for p in params[len(part.inputs):]]
            # Chunk indices of dims the kernel needs global indices of (after the inputs).
            chunks = [relax.prim_value(self._chunk(d, strategy))
                      for d in chunk_params(part.func)]
            call = relax.call_tir(gv, relax.Tuple([*(values[key] for key in part.inputs),
                                                   *chunks]),
                                  out_ty if len(out_ty) > 1 else out_ty[0])
            name = binding.var.name if i == len(parts) - 1 else f"{binding.var.name}_part{i}"
            result = self.bb.emit(call, name)
            for j, key in enumerate(part.outputs):
                out = result if len(out_ty) == 1 else self.bb.emit(relax.TupleGetItem(result, j))
                if key[0] == "tmp" and part.writers.get(key) in inner:
                    out = self._allreduce_levels(out, inner[part.writers[key]])
                values[key] = out
        for pos, tid in enumerate(op.outputs):
            schemes, combiners = produced[pos]
            self.val[tid] = self.convert(values[("out", pos)], self.g.tensors[tid], schemes,
                                         self.layout[tid], combiners)

    def _strided_levels(self, strategy: Sequence[int]) -> dict[int, tuple]:
        """Dim -> ((parts, splits the dim) per level down to the deepest splitting it), for the
        dims whose chunks are strided blocks (a level above a splitting one does not split)."""
        out = {}
        for d in {d for d in strategy if d >= 0}:
            deepest = max(lvl for lvl, s in enumerate(strategy) if s == d)
            levels = tuple((self.mesh[lvl], strategy[lvl] == d) for lvl in range(deepest + 1))
            if not all(split for _, split in levels):
                out[d] = levels
        return out

    def _chunk(self, dim: int, strategy: Sequence[int]):
        """The index of this worker's chunk of `dim`, from the worker id: its coordinates at
        the levels splitting the dim as one mixed-radix number, outermost first (the chunk a
        local kernel computing global indices takes, see `local_kernel`)."""
        levels = [lvl for lvl, d in enumerate(strategy) if d == dim]
        if self.worker is None:
            self.worker = tvm.tirx.Var("worker_id", "int64")
            wid = self.bb.emit(relax.op.call_pure_packed(
                "runtime.disco.worker_id", ty_args=[relax.ShapeType(None)]))
            self.bb.match_cast(wid, relax.ShapeType([self.worker]))
        if levels == list(range(len(levels))):  # the outermost levels: contiguous chunks
            return tvm.tirx.floordiv(self.worker, level_stride(self.mesh, levels[-1]))
        chunk = tvm.tirx.IntImm("int64", 0)
        for lvl in levels:
            coord = tvm.tirx.floormod(
                tvm.tirx.floordiv(self.worker, level_stride(self.mesh, lvl)), self.mesh[lvl])
            chunk = chunk * self.mesh[lvl] + coord
        return chunk

    def _allreduce_levels(self, value, levels: list[tuple[int, str]]) -> relax.Var:
        """Allreduce an intermediate of a split kernel over the levels its dim is split at."""
        combiners = {c for _, c in levels}
        if len(combiners) > 1:
            raise PartitionError(f"an intermediate reduced with {sorted(combiners)} at once")
        combiner = combiners.pop()
        if len(levels) == self.levels:
            return self._emit_ccl("allreduce", value, combiner)
        shape = [int(s) for s in value.ty.shape.values]
        for lvl, _ in sorted(levels, reverse=True):
            value = self._emit_mesh("mesh_allreduce", value,
                                    [level_stride(self.mesh, lvl), self.mesh[lvl],
                                     _REDUCE_KIND[combiner]], shape, str(value.ty.dtype))
        return value

    def _view(self, op, spec, strategy) -> None:
        binding = self.bindings[op.id]
        (src,), (dst,) = op.inputs, op.outputs
        if op.kernel != "relax.reshape" and any(d >= 0 for d in strategy):
            raise PartitionError(f"{op.name}: a split {op.kernel} view cannot be lowered")
        value = self._input(op, 0, src, self._required(spec, 0, strategy)
                            if any(d >= 0 for d in strategy) else [REP] * self.levels)
        schemes, combiners = (self._produced(spec, 0, strategy) if any(d >= 0 for d in strategy)
                              else ([REP] * self.levels, [""] * self.levels))
        t = self.g.tensors[dst]
        if op.kernel == "relax.reshape":
            shape = local_shape(t.shape, self.mesh, schemes)
            out = self.bb.emit(relax.op.reshape(value, relax.ShapeExpr(list(shape))),
                               binding.var.name)
        else:
            out = self.bb.emit(relax.Call(binding.value.op, [value, *binding.value.args[1:]],
                                          binding.value.attrs, binding.value.ty_args),
                               binding.var.name)
        self.val[dst] = self.convert(out, t, schemes, self.layout[dst], combiners)

    def _builtin(self, op, strategy) -> None:
        """Packed calls run replicated, on whole inputs."""
        binding = self.bindings[op.id]
        value = binding.value
        subst = {}
        for var in _vars_in(value.args):
            tid = self.var_tensor.get(var)
            if tid is None:
                raise PartitionError(f"{op.name}: argument {var.name} of a packed call is not "
                                     "a tensor this pass tracks")
            subst[var] = self._input(op, 0, tid, [REP] * self.levels)
        args = [_substitute(a, subst) for a in value.args]
        out = self.bb.emit(relax.Call(value.op, args, value.attrs, value.ty_args),
                           binding.var.name)
        if len(op.outputs) > 1:
            raise PartitionError(f"{op.name}: packed calls with several outputs are not "
                                 "supported")
        for tid in op.outputs:
            self.val[tid] = self.convert(out, self.g.tensors[tid], [REP] * self.levels,
                                         self.layout[tid])

    # ------------------------------------------------------------------ conversions
    def convert(self, value: relax.Expr, tensor, src: Sequence[int], dst: Sequence[int],
                combiners: Sequence[str] | None = None) -> relax.Expr:
        """Emit the collectives that turn `value` (held as `src`, one scheme per level) into
        `dst` (see the module docstring, step 3)."""
        combiners = list(combiners) if combiners else [""] * self.levels
        shape, dtype = tensor.shape, tensor.dtype
        for step in conversion_sequence(src, dst, combiners):
            cur, lvl, kind = step.before, step.level, step.kind
            out_shape = local_shape(shape, self.mesh, step.after)
            if lvl is None:  # every level at once: one collective over all devices
                if kind == "allreduce":
                    value = self._emit_ccl("allreduce", value, combiners[0])
                elif cur[0] == 0:
                    value = self._emit_ccl("allgather", value)
                else:
                    value = self._emit_mesh("mesh_allgather", value, [1, self.k, cur[0], 1],
                                            out_shape, dtype)
                continue
            group = [level_stride(self.mesh, lvl), self.mesh[lvl]]
            a, b = cur[lvl], step.after[lvl]
            if kind == "slice":
                args = [*group, b, self._outer(cur, lvl, b)]
            elif kind == "allgather":
                args = [*group, a, self._outer(cur, lvl, a)]
            elif kind == "allreduce":
                args = [*group, _REDUCE_KIND[combiners[lvl]]]
            elif kind == "reduce_scatter":
                args = [*group, _REDUCE_KIND[combiners[lvl]], b, self._outer(cur, lvl, b)]
            elif kind == "all_to_all":
                args = [*group, a, self._outer(cur, lvl, a), b, self._outer(cur, lvl, b)]
            else:
                raise PartitionError(f"no lowering for a {kind} conversion")
            value = self._emit_mesh("mesh_" + kind, value, args, out_shape, dtype)
        return value

    def _outer(self, cur: Sequence[int], level: int, axis: int) -> int:
        """A: the blocks of the levels above `level` that do not cut `axis` (ccl_mesh.h)."""
        outer = 1
        for m in range(level):
            if cur[m] != axis:
                outer *= self.mesh[m]
        return outer

    def _emit_mesh(self, name: str, value, args: list[int], out_shape, dtype) -> relax.Var:
        call = relax.op.call_dps_packed(
            "tvm_ext.ccl." + name, relax.Tuple([value, relax.ShapeExpr([int(a) for a in args])]),
            out_ty=relax.TensorType(list(out_shape), dtype))
        return self.bb.emit(call)

    def _emit_ccl(self, kind: str, value, combiner: str = "sum") -> relax.Var:
        if kind == "allreduce":
            call = relax.op.ccl.allreduce(value, combiner, in_group=False)
        else:
            call = relax.op.ccl.allgather(value, self.k, in_group=False)
        call = self.bb.normalize(call)
        legalize = tvm.ir.Op.get(call.op.name).get_attr("FLegalize")
        return self.bb.emit(legalize(self.bb, call))


def _vars_in(args) -> list:
    out = []
    for a in args:
        if isinstance(a, relax.Var):
            out.append(a)
        elif isinstance(a, relax.Tuple):
            out += _vars_in(a.fields)
    return out


def _substitute(expr, subst: dict):
    if isinstance(expr, relax.Var) and expr in subst:
        return subst[expr]
    if isinstance(expr, relax.Tuple):
        return relax.Tuple([_substitute(f, subst) for f in expr.fields])
    return expr
