"""Import a torch `ExportedProgram` into Relax around the gaps of TVM's frontend.

- `aten.view` becomes `aten.reshape` before the decompositions run. Decomposing some ops (e.g.
  scaled dot-product attention) gives their results other strides than eager mode does, and a
  later `view` of such a result then fails although PyTorch runs the program; a reshape is the
  same value and decomposes to a view or a copy as the strides allow.
- Ops the frontend converts with other semantics than PyTorch's (dtypes, negative indices,
  `alpha`, embedding gradients) go through the converters of `torch_converters`.
- `aten.cat` drops the 1-d empty inputs that torch skips (and the frontend rejects).
- The mode the module was exported in (train or eval), read from the ops whose behaviour
  depends on it, for the training step to follow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import tvm
from tvm import relax

from . import dropout, moe_converters, torch_converters
from .torch_converters import node_arg

if TYPE_CHECKING:
    from torch.export import ExportedProgram

def import_exported_program(program: ExportedProgram) -> tuple[tvm.IRModule, str | None]:
    """`main(inputs..., params...)` of `program` (weights in the `params` attribute) and the
    mode the module was exported in: "train", "eval", "mixed", or None when no op depends on it.

    Errors raised here mean the TVM frontend cannot import the program.
    """
    mode = export_mode(program)
    _refuse_unseeded_dropouts(program)
    _views_to_reshapes(program)
    # As TVM's own entry point does: sparse tensors do not go through the decompositions.
    if not _has_sparse_tensors(program):
        program = program.run_decompositions(import_decompositions())
    _drop_empty_cat_inputs(program)
    importer = _importer_class()()
    mod = importer.from_exported_program(program, True, True, False, None)
    seed = getattr(importer, "dropout_seed", None)
    if seed is not None:  # the last input: after the program's own
        func = mod["main"]
        n = int(func.attrs["num_input"])
        params = [*func.params[:n], seed, *func.params[n:]]
        mod = mod.clone()
        mod["main"] = relax.Function(params, func.body, func.ret_ty, True,
                                     func.attrs).with_attr("num_input", n + 1)
    return mod, mode


def reorder_outputs(mod: tvm.IRModule, order: list[int]) -> tvm.IRModule:
    """`mod` with `main` returning its outputs in `order` (indices into the tuple it returns);
    unchanged where that is the order it has."""
    if order == sorted(order):
        return mod
    func = mod["main"]
    body = func.body
    fields = relax.Tuple([relax.TupleGetItem(body.body, i) for i in order])
    ret = relax.TupleType([body.body.ty.fields[i] for i in order])
    out = relax.Function(func.params, relax.SeqExpr(body.blocks, fields), ret, True,
                         func.attrs)
    mod = mod.clone()
    mod["main"] = out
    return relax.transform.CanonicalizeBindings()(relax.transform.Normalize()(mod))


def import_decompositions():
    """torch.export's default decompositions but `detach`'s, which would become an `alias`
    and take the cut from the gradient with it (`torch_converters._detach` keeps it)."""
    import torch

    table = torch.export.default_decompositions()
    table.pop(torch.ops.aten.detach.default, None)
    return table


def decomposed_ops(program: ExportedProgram) -> set[str]:
    """The aten ops the import converts for `program` ("add.Tensor", ...): those left after
    the decompositions it runs."""
    import torch

    _views_to_reshapes(program)
    if not _has_sparse_tensors(program):
        program = program.run_decompositions(import_decompositions())
    return {str(node.target).removeprefix("aten.") for node in program.graph.nodes
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and node.target.namespace == "aten"}


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
            p = node_arg(node, 1, "p", 0.5)
            if p:
                modes.add("train" if node_arg(node, 2, "train", True) else "eval")
        elif target is aten.native_dropout.default:
            train = node_arg(node, 2, "train", True)
            if node_arg(node, 1, "p", 0.5) and train is not False:
                modes.add("train")
        elif target in (aten.batch_norm.default, aten.native_batch_norm.default):
            # Without running statistics a batch norm always uses batch statistics.
            if args[3] is not None:
                modes.add("train" if node_arg(node, 5, "training", False) else "eval")
        elif target is aten._native_batch_norm_legit_no_training.default:
            modes.add("eval")
        elif target in (aten._native_batch_norm_legit_functional.default,
                        aten._native_batch_norm_legit.default):
            modes.add("train")
    if not modes:
        return None
    return modes.pop() if len(modes) == 1 else "mixed"


# Train-mode dropouts whose masks are not `dropout.py`'s (whole channels, alpha dropout's
# affine correction): the frontend turns their Bernoulli draw into its input, uninitialized.
_UNSEEDED_DROPOUTS = ("feature_dropout", "feature_dropout_", "alpha_dropout", "alpha_dropout_",
                      "feature_alpha_dropout", "feature_alpha_dropout_")


def _refuse_unseeded_dropouts(program) -> None:
    """Raise ValueError naming a train-mode dropout the import cannot apply."""
    for node in program.graph.nodes:
        name = getattr(node.target, "__name__", "").split(".")[0]
        if node.op == "call_function" and name in _UNSEEDED_DROPOUTS:
            p = dropout.active(node)
            if p is not None:
                raise ValueError(f"{name} in train mode (p={p:g}): tvm_ext applies the mask of "
                                 "nn.Dropout only, not one of whole channels (Dropout2d/3d) "
                                 "or AlphaDropout's; export the module in eval mode, or with "
                                 "nn.Dropout")


def _has_sparse_tensors(program) -> bool:
    import torch

    tensors = [*program.state_dict.values(), *program.constants.values()]
    return any(isinstance(t, torch.Tensor) and t.layout != torch.strided for t in tensors)


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
    """TVM's importer with the converters of `torch_converters`."""
    global _IMPORTER
    if _IMPORTER is not None:
        return _IMPORTER
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    class Importer(ExportedProgramImporter):
        def create_convert_map(self):
            table = torch_converters.with_torch_semantics(self, super().create_convert_map())
            return moe_converters.add_moe_converters(self, table)

    _IMPORTER = Importer
    return Importer
