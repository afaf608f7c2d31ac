"""Read a legalized, fused Relax function into a `DataflowGraph` (see `tvm_ext.ir.graph`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax, tirx

from ..graph import DataflowGraph, GraphBuildError, Op, Tensor
from .kernel_cost import KernelCost, analyze_kernel, buffer_bytes, has_symbolic_buffers
from .pass_records import STATE_ATTR, argument_updates
from .relax_exprs import VIEW_OPS  # ops whose result shares its input's bytes

_CALL_TIR = ("relax.call_tir", "relax.call_tir_inplace")
_PACKED = ("relax.call_dps_packed", "relax.call_packed", "relax.call_pure_packed",
           "relax.call_builtin_with_ctx")
_HINT = "run LegalizeOps, StaticKernelCalls, AnnotateTIROpPattern, FuseOps and FuseTIR " \
        "first (tvm_ext.pipeline.legalize_passes)"


def _static_shape(ty, what: str) -> tuple[int, ...]:
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        raise GraphBuildError(f"{what} is not a tensor of known shape ({ty})")
    try:
        return tuple(int(d) for d in ty.shape.values)
    except (TypeError, AttributeError) as err:
        raise GraphBuildError(f"{what} has a symbolic shape {ty.shape}: tvm_ext plans "
                              "static shapes only") from err


class _Builder:
    def __init__(self, mod: tvm.IRModule, function: str):
        self.mod = mod
        self.func = mod[function]
        self.function = function
        self.ops: list[Op] = []
        self.tensors: list[Tensor] = []
        self.values: dict[relax.Var, object] = {}  # var -> tensor id or list (tuple)
        self.constants: dict[tvm.ir.Constant, int] = {}
        self.kernel_costs: dict[str, KernelCost] = {}
        self.op_bindings: list = []  # the IR binding of each op, by op id

    # ---------------------------------------------------------------- tensors
    def new_tensor(self, name, ty, kind, producer=None, alias_of=None, arg_index=None) -> int:
        shape = _static_shape(ty, name)
        dtype = str(ty.dtype)
        nbytes = 0 if alias_of is not None else buffer_bytes(shape, dtype)
        tid = len(self.tensors)
        self.tensors.append(Tensor(tid, name, shape, dtype, nbytes, kind, producer,
                                   alias_of=alias_of, arg_index=arg_index))
        return tid

    def new_values(self, name, ty, producer) -> object:
        """Tensors for a call result: one id, or a (nested) list for a tuple type."""
        if isinstance(ty, relax.TupleType):
            return [self.new_values(f"{name}.{i}", f, producer) for i, f in enumerate(ty.fields)]
        return self.new_tensor(name, ty, "activation", producer)

    def lookup(self, expr) -> object:
        if isinstance(getattr(expr, "ty", None), tvm.ir.PrimType):
            return []  # scalars (a kernel's chunk index, a symbolic shape variable)
        if isinstance(expr, relax.Var):
            if expr not in self.values:
                raise GraphBuildError(f"variable {expr.name} used before it is bound")
            return self.values[expr]
        if isinstance(expr, tvm.ir.Constant):
            if not isinstance(expr.ty, relax.TensorType):
                return []  # prim values, strings, dtypes: not tensors
            if expr not in self.constants:
                self.constants[expr] = self.new_tensor(
                    f"const{len(self.constants)}", expr.ty, "constant")
            return self.constants[expr]
        if isinstance(expr, relax.Tuple):
            return [self.lookup(f) for f in expr.fields]
        if isinstance(expr, relax.TupleGetItem):
            return self.lookup(expr.tuple_value)[expr.index]
        if isinstance(expr, (relax.ShapeExpr, relax.ExternFunc, tvm.ir.GlobalVar)):
            return []
        raise GraphBuildError(f"unsupported argument {type(expr).__name__}: {expr}")

    @staticmethod
    def flatten(value) -> list[int]:
        if isinstance(value, int):
            return [value]
        out = []
        for v in value:
            out += _Builder.flatten(v)
        return out

    # ---------------------------------------------------------------- ops
    def add_op(self, var, kernel, kind, inputs, cost: KernelCost | None) -> Op:
        op = Op(len(self.ops), var.name, kernel, kind, inputs, [])
        if cost is not None:
            op.flops, op.bytes_moved, op.library = cost.flops, cost.bytes_moved, cost.library
            op.low_precision = cost.low_precision
            op.reduces = cost.reduces
        self.ops.append(op)
        for tid in dict.fromkeys(inputs):
            self.tensors[tid].consumers.append(op.id)
        if cost is not None and cost.scratch_bytes > 0:
            ws = len(self.tensors)
            self.tensors.append(Tensor(ws, f"{var.name}.scratch", (cost.scratch_bytes,),
                                       "uint8", cost.scratch_bytes, "workspace", op.id, [op.id]))
            op.workspace = ws
        return op

    def kernel_cost(self, gv: tvm.ir.GlobalVar) -> KernelCost:
        name = gv.name_hint
        if name not in self.kernel_costs:
            func = self.mod[gv]
            if not isinstance(func, tirx.PrimFunc):
                raise GraphBuildError(f"call_tir target {name} is not a PrimFunc")
            if has_symbolic_buffers(func):
                raise GraphBuildError(f"kernel {name} has symbolic buffer extents: {_HINT}")
            self.kernel_costs[name] = analyze_kernel(func)
        return self.kernel_costs[name]

    def visit_binding(self, binding) -> None:
        var, value = binding.var, binding.value
        if isinstance(binding, relax.MatchCast) or isinstance(
            value, (relax.Var, relax.Tuple, relax.TupleGetItem, tvm.ir.Constant)
        ):
            self.values[var] = self.lookup(value)
            return
        if not isinstance(value, relax.Call):
            raise GraphBuildError(f"{var.name}: unsupported binding {type(value).__name__}")
        callee = value.op
        name = callee.name if isinstance(callee, tvm.ir.Op) else None
        if name in _CALL_TIR:
            gv = value.args[0]
            inputs = self.flatten(self.lookup(value.args[1]))
            op = self.add_op(var, gv.name_hint, "kernel", inputs, self.kernel_cost(gv))
            result = self.new_values(var.name, var.ty, op.id)
        elif name in VIEW_OPS:
            base = self.lookup(value.args[0])
            if not isinstance(base, int):
                raise GraphBuildError(f"{var.name}: view of a tuple")
            op = self.add_op(var, name, "view", [base], None)
            result = self.new_tensor(var.name, var.ty, self.tensors[base].kind
                                     if self.tensors[base].kind in ("activation", "gradient")
                                     else "activation", op.id, alias_of=base)
        elif name in _PACKED or isinstance(callee, relax.ExternFunc):
            args = value.args[1:] if name == "relax.call_dps_packed" else value.args
            if name == "relax.call_dps_packed":
                args = [value.args[1]]
            inputs = []
            for a in args:
                if isinstance(a, (relax.Var, relax.Tuple, tvm.ir.Constant, relax.TupleGetItem)):
                    inputs += self.flatten(self.lookup(a))
            kernel = value.args[0].global_symbol if name and value.args and isinstance(
                value.args[0], relax.ExternFunc) else str(callee)
            op = self.add_op(var, kernel, "builtin", inputs, None)
            op.bytes_moved = sum(self.tensors[t].nbytes for t in inputs)
            result = self.new_values(var.name, var.ty, op.id) if _is_tensorish(var.ty) else []
        else:
            what = name or type(callee).__name__
            raise GraphBuildError(f"{var.name}: operator {what} is not lowered to a kernel; "
                                  f"{_HINT}")
        op.outputs = self.flatten(result)
        self.values[var] = result
        self.op_bindings.append(binding)

    # ---------------------------------------------------------------- whole function
    def build(self) -> DataflowGraph:
        func = self.func
        if not isinstance(func, relax.Function):
            raise GraphBuildError(f"{self.function} is not a Relax function")
        attrs = func.attrs or {}
        num_input = int(attrs["num_input"]) if "num_input" in attrs else len(func.params)
        first_state = len(func.params) - int(attrs.get(STATE_ATTR, 0))
        for i, p in enumerate(func.params):
            kind = "input" if i < num_input else "parameter" if i < first_state else "state"
            self.values[p] = self.new_tensor(p.name, p.ty, kind, arg_index=i)
        body = func.body
        if not isinstance(body, relax.SeqExpr):
            raise GraphBuildError("function body is not a sequence of bindings")
        for block in body.blocks:
            for binding in block.bindings:
                self.visit_binding(binding)
        outputs = self.flatten(self.lookup(body.body))
        for tid in outputs:
            self.tensors[tid].is_output = True
        graph = DataflowGraph(self.ops, self.tensors, outputs, self.function, num_input)
        _mark_phases(graph)
        _mark_updates(graph, argument_updates(func))
        _check_update_order(graph)
        return graph


def _is_tensorish(ty) -> bool:
    if isinstance(ty, relax.TensorType):
        return True
    return isinstance(ty, relax.TupleType) and all(_is_tensorish(f) for f in ty.fields)


def _mark_phases(graph: DataflowGraph) -> None:
    """A training step returns (scalar loss, gradients...): ops the loss depends on are the
    forward pass, the others the backward pass, and their results are gradients."""
    outs = graph.outputs
    if len(outs) < 2:
        return
    loss = graph.tensors[graph.base(outs[0])]
    if loss.shape != () or loss.producer is None:
        return
    forward = np.zeros(len(graph.ops), dtype=bool)
    stack = [loss.producer]
    while stack:
        op_id = stack.pop()
        if forward[op_id]:
            continue
        forward[op_id] = True
        for tid in graph.ops[op_id].inputs:
            producer = graph.tensors[tid].producer
            if producer is not None and not forward[producer]:
                stack.append(producer)
    for op in graph.ops:
        if not forward[op.id]:
            op.phase = "backward"
            for tid in op.outputs:
                graph.tensors[tid].kind = "gradient"


def _mark_updates(graph: DataflowGraph, updates: dict[int, int]) -> None:
    """Outputs that overwrite an argument (`tvm_ext.ir.pass_records.UPDATES_ATTR`) become
    in-place versions of it: no bytes of their own, made by an op of phase "update" that read
    the argument (or a version of it) or writes a buffer it does not read."""
    args = {t.arg_index: t.id for t in graph.tensors if t.arg_index is not None}
    for position, arg in updates.items():
        if position >= len(graph.outputs) or arg not in args:
            raise GraphBuildError(f"update attribute names output {position} and argument "
                                  f"{arg}, which the function does not have")
        tid = graph.outputs[position]
        t = graph.tensors[tid]
        base = graph.tensors[args[arg]]
        if t.producer is None or t.alias_of is not None or \
                graph.ops[t.producer].kind == "view":
            raise GraphBuildError(f"output {position} ({t.name}), the update of argument "
                                  f"{base.name}, is not the result of a kernel")
        if (t.shape, t.dtype) != (base.shape, base.dtype):
            raise GraphBuildError(f"output {position} ({t.name}) {t.shape} {t.dtype} cannot "
                                  f"overwrite argument {base.name} {base.shape} {base.dtype}")
        op = graph.ops[t.producer]
        # The version the op reads: the argument, or the last in-place update of it before.
        versions = [i for i in op.inputs if graph.base(i) == base.id]
        t.overwrites = versions[0] if versions else base.id
        t.alias_of, t.nbytes, t.kind = base.id, 0, base.kind
        op.phase = "update"


def _check_update_order(graph: DataflowGraph, order: list[int] | None = None) -> None:
    """Every in-place update after the other readers of what it overwrites, in the IR's
    order (or `order`). TVM's FuseOps knows nothing of in place: it may place a fused kernel
    that reads a parameter (at its group's last op) after that parameter's update, which
    would then read the new values."""
    position = {op: i for i, op in enumerate(graph.order if order is None else order)}
    for op in graph.ops:
        late = [graph.ops[r] for r in graph.must_follow(op.id) if position[r] > position[op.id]]
        if late:
            read = {graph.base(t) for t in late[0].inputs} & set(graph.overwritten(op.id))
            raise GraphBuildError(
                f"kernel {late[0].name} reads {', '.join(graph.tensors[t].name for t in read)} "
                f"after its in-place update {op.name}: TVM's operator fusion placed it there, "
                "and the step cannot update in place (a training step without --optimizer "
                "builds)")


def build_graph(mod: tvm.IRModule, function: str = "main") -> DataflowGraph:
    """The DataflowGraph of `mod[function]`; the function must be legalized and fused."""
    return build_graph_with_ir(mod, function)[0]


def build_graph_with_ir(mod: tvm.IRModule, function: str = "main"):
    """The graph, the IR binding of each op (by op id) and the tensor id of each module
    constant: what a pass needs to rewrite the function the graph describes."""
    if function not in [gv.name_hint for gv in mod.functions]:
        raise GraphBuildError(f"module has no function {function!r}")
    builder = _Builder(mod, function)
    graph = builder.build()
    return graph, builder.op_bindings, dict(builder.constants)


def read_pass_input(mod: tvm.IRModule, function: str, pass_name: str,
                    error: type[Exception], check_form: Callable[[relax.Function], None]):
    """The prologue of a pass that rewrites a fused function by its graph: the function must
    exist and be a Relax function in the pass's form (`check_form` raises `error` otherwise);
    dataflow reshapes become views, so the graph a plan was made for (`pipeline.fuse`) and the
    graph rewritten are the same. Returns the module and `build_graph_with_ir`'s results."""
    if function not in [gv.name_hint for gv in mod.functions]:
        raise error(f"the module has no function {function!r}")
    if not isinstance(mod[function], relax.Function):
        raise error(f"{pass_name} rewrites Relax functions only")
    check_form(mod[function])
    mod = relax.transform.RewriteDataflowReshape()(mod)
    try:
        graph, bindings, constants = build_graph_with_ir(mod, function)
    except GraphBuildError as err:
        raise error(f"{pass_name} needs a legalized, fused module: {err}") from err
    return mod, graph, bindings, constants
