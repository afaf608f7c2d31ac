"""Import a torch `ExportedProgram` into Relax around the gaps of TVM's frontend.

- `aten.view` becomes `aten.reshape` before the decompositions run. Decomposing some ops (e.g.
  scaled dot-product attention) gives their results other strides than eager mode does, and a
  later `view` of such a result then fails although PyTorch runs the program; a reshape is the
  same value and decomposes to a view or a copy as the strides allow.
- The frontend computes matmuls, linear layers and convolutions with a float32 result whatever
  the input dtype, so the bias add of a float16 / bfloat16 layer mixes dtypes. Those ops (and
  the norms and softmaxes) run in float32 here, as PyTorch accumulates them on CPU, with their
  result cast back. Sums and cumulative sums of bool or small integers accumulate in the dtype
  torch gives their result (the frontend would add bools as bools).
- `aten.cat` drops the 1-d empty inputs that torch skips (and the frontend rejects).
- `aten.embedding` with a `padding_idx` keeps its value but passes no gradient from the
  positions that hold the padding index, as PyTorch's embedding backward does
  (`relax.grad.no_grad` stops it; tvm_ext registers its gradient as none).
- The mode the module was exported in (train or eval), read from the ops whose behaviour
  depends on it, for the training step to follow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import tvm
from tvm import relax

if TYPE_CHECKING:
    from torch.export import ExportedProgram

# Ops run in float32 for float16 / bfloat16 inputs: the frontend fixes a float32 result for
# matmuls and convolutions; TVM lowers no bfloat16 layer norm or power; and PyTorch accumulates
# these in float32 on CPU anyway.
_FLOAT32_OPS = (
    "_log_softmax.default",
    "_softmax.default",
    "addmm.default",
    "baddbmm.default",
    "bmm.default",
    "conv1d.default",
    "conv2d.default",
    "conv3d.default",
    "conv_transpose1d.default",
    "conv_transpose2d.input",
    "convolution.default",
    "group_norm.default",
    "layer_norm.default",
    "linear.default",
    "matmul.default",
    "mm.default",
    "native_group_norm.default",
    "native_layer_norm.default",
    "pow.Scalar",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
)
_REDUCED_FLOATS = ("float16", "bfloat16")
# Frontend ops that accumulate in their input dtype where torch promotes (a cumsum of bool
# counts in int64); they run in their result dtype here.
_ACCUMULATING_OPS = ("cumprod.default", "cumsum.default", "prod.default", "prod.dim_int",
                     "sum.default", "sum.dim_IntList")


def import_exported_program(program: ExportedProgram) -> tuple[tvm.IRModule, str | None]:
    """`main(inputs..., params...)` of `program` (weights in the `params` attribute) and the
    mode the module was exported in: "train", "eval", "mixed", or None when no op depends on it.

    Errors raised here mean the TVM frontend cannot import the program.
    """
    mode = export_mode(program)
    _views_to_reshapes(program)
    # As TVM's own entry point does: sparse tensors do not go through the decompositions.
    if not _has_sparse_tensors(program):
        program = program.run_decompositions()
    _drop_empty_cat_inputs(program)
    importer = _importer_class()()
    mod = importer.from_exported_program(program, True, True, False, None)
    return mod, mode


def export_mode(program: ExportedProgram) -> str | None:
    """"train", "eval", "mixed" or None, from batch norms and dropouts in `program`."""
    import torch

    aten = torch.ops.aten
    modes = set()
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        target, args = node.target, node.args
        if target in (aten.dropout.default, aten.dropout_.default, aten.feature_dropout.default,
                      aten.alpha_dropout.default):
            p = _arg(node, 1, "p", 0.5)
            if p:
                modes.add("train" if _arg(node, 2, "train", True) else "eval")
        elif target is aten.native_dropout.default:
            train = _arg(node, 2, "train", True)
            if _arg(node, 1, "p", 0.5) and train is not False:
                modes.add("train")
        elif target in (aten.batch_norm.default, aten.native_batch_norm.default):
            # Without running statistics a batch norm always uses batch statistics.
            if args[3] is not None:
                modes.add("train" if _arg(node, 5, "training", False) else "eval")
        elif target is aten._native_batch_norm_legit_no_training.default:
            modes.add("eval")
        elif target in (aten._native_batch_norm_legit_functional.default,
                        aten._native_batch_norm_legit.default):
            modes.add("train")
    if not modes:
        return None
    return modes.pop() if len(modes) == 1 else "mixed"


def _has_sparse_tensors(program) -> bool:
    import torch

    tensors = [*program.state_dict.values(), *program.constants.values()]
    return any(isinstance(t, torch.Tensor) and t.layout != torch.strided for t in tensors)


def _arg(node, index: int, name: str, default):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _views_to_reshapes(program) -> None:
    """Turn `aten.view` into `aten.reshape` wherever nothing aliasing it (the tensor it views,
    other views of that tensor) is written in place: a reshape may copy."""
    import torch

    aten = torch.ops.aten
    graph = program.graph_module.graph
    root = _alias_roots(graph)
    written = {root(n) for n in _written_nodes(graph)}
    changed = False
    for node in graph.nodes:
        if node.op == "call_function" and node.target is aten.view.default:
            if root(node) not in written:
                node.target = aten.reshape.default
                changed = True
    if changed:
        program.graph_module.recompile()


def _alias_roots(graph) -> Callable:
    """node -> a representative of the nodes sharing its storage, through ops whose result
    aliases an argument (views, in-place ops)."""
    import torch

    parent: dict = {}

    def find(node):
        while parent.get(node, node) is not node:
            node = parent[node]
        return node

    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        returns = target._schema.returns
        if not returns or returns[0].alias_info is None:
            continue
        sets = set(returns[0].alias_info.before_set)
        for i, arg in enumerate(target._schema.arguments):
            info = arg.alias_info
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if info is not None and sets & set(info.before_set) and \
                    isinstance(value, torch.fx.Node):
                parent[find(node)] = find(value)
    return find


def _written_nodes(graph) -> set:
    """Nodes an in-place op writes to."""
    import torch

    written = set()
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        schema = target._schema
        if not schema.is_mutable:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            values = value if isinstance(value, (list, tuple)) else [value]
            written.update(v for v in values if isinstance(v, torch.fx.Node))
    return written


def _drop_empty_cat_inputs(program) -> None:
    """torch.cat skips 1-d empty tensors next to tensors of other ranks (an empty key/value
    cache of transformers models is one); the frontend rejects the mixed ranks."""
    import torch

    for node in list(program.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.cat.default:
            continue
        tensors = node.args[0]
        shapes = [getattr(t.meta.get("val"), "shape", None) for t in tensors]
        if any(s is None for s in shapes):
            continue
        kept = [t for t, s in zip(tensors, shapes, strict=True) if tuple(s) != (0,)]
        if not kept or len(kept) == len(tensors) or all(len(s) == 1 for s in shapes):
            continue
        if len(kept) == 1:
            # A one-tensor concat is the tensor (and has no gradient in Relax).
            node.replace_all_uses_with(kept[0])
            program.graph.erase_node(node)
        else:
            node.args = (kept, *node.args[1:])
    program.graph_module.recompile()


_IMPORTER = None


def _importer_class():
    """TVM's importer with the dtype fixes above."""
    global _IMPORTER
    if _IMPORTER is not None:
        return _IMPORTER
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    class Importer(ExportedProgramImporter):
        def create_convert_map(self):
            table = super().create_convert_map()
            rules = ((_FLOAT32_OPS, _float32_for_reduced, _REDUCED_FLOATS.__contains__),
                     (_ACCUMULATING_OPS, _result_dtype, lambda dtype: True))
            for names, pick, cast in rules:
                for name in names:
                    if name in table:
                        table[name] = self._computed_in(table[name], pick, cast)
            table["embedding.default"] = self._embedding
            return table

        def _embedding(self, node):
            """The frontend's lookup, with the positions holding `padding_idx` cut off from the
            gradient (PyTorch gives the padding row none from them): `where(is_pad,
            no_grad(e), e)` is `e` in value, and its gradient reaches `e` only elsewhere."""
            bb, op = self.block_builder, relax.op
            ids = self.env[node.args[1]]
            out = self._embedding_impl(ids, self.env[node.args[0]])
            pad = _arg(node, 2, "padding_idx", -1)
            if pad is None or pad < 0:  # aten's -1: no padding row
                return out
            is_pad = bb.emit(op.equal(ids, relax.const(pad, str(ids.ty.dtype))))
            is_pad = bb.emit(op.expand_dims(is_pad, -1))
            return bb.emit(op.where(is_pad, bb.emit(op.grad.no_grad(out)), out))

        def _computed_in(self, convert: Callable, pick: Callable, cast: Callable) -> Callable:
            """`convert` with its tensor arguments whose dtype satisfies `cast` cast to
            `pick(node)` (None: unchanged), and its result cast back to the node's dtype."""

            def wrapped(node):
                dtype, compute = _result_dtype(node), pick(node)
                if compute is None:
                    return convert(node)
                saved = {}
                for arg in node.all_input_nodes:
                    var = self.env.get(arg)
                    ty = getattr(var, "ty", None)
                    if (isinstance(ty, relax.TensorType) and str(ty.dtype) != compute
                            and cast(str(ty.dtype))):
                        saved[arg] = var
                        self.env[arg] = self.block_builder.emit(relax.op.astype(var, compute))
                if not saved:
                    return convert(node)
                try:
                    out = convert(node)
                finally:
                    self.env.update(saved)
                if isinstance(out.ty, relax.TensorType) and str(out.ty.dtype) != dtype:
                    out = self.block_builder.emit(relax.op.astype(out, dtype))
                return out

            return wrapped

    _IMPORTER = Importer
    return Importer


def _float32_for_reduced(node) -> str | None:
    return "float32" if _result_dtype(node) in _REDUCED_FLOATS else None


def _result_dtype(node) -> str | None:
    """The dtype of the node's (first) result."""
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)) and val:
        val = val[0]
    dtype = getattr(val, "dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")
