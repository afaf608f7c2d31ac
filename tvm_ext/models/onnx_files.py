"""Reading an ONNX model (.onnx) as exporters write it, before TVM's frontend imports it.

- Value and weight names become C identifiers. torch's TorchScript exporter names values
  after their module path (`/inner/model/Reshape_1_output_0`, `inner.model.shared.weight`);
  TVM names a kernel's buffers after the Relax variables it reads, which the frontend names
  after the weights (and after the values onnxsim folds into weights), and the CUDA code of
  the kernels TVM writes by hand (its GPU scatter, sort and scan) takes those names verbatim,
  which nvcc rejects. Graph inputs (the frontend renames them) and outputs keep their names;
  `with_identifier_names` returns the new names of the weights, so that ONNX Runtime can be
  fed the file's.
- `with_perms_in_range`: a `Transpose` whose `perm` counts dims from the end (torch's
  TorchScript exporter writes `permute(0, -2, -1, 1)` as given: Zamba2) has it counted from
  the start: ONNX Runtime refuses the file as written and ONNX's shape inference stops at it.
- `simplified`: constant subgraphs folded by onnxsim, for a file TVM's frontend cannot import
  as written (see `loaders._load_onnx`).
- `torch_non_parameters`: the weights torch's dynamo exporter (`torch.onnx.export(...,
  dynamo=True)`) marks as not a module's parameters: buffers, and the computation's own
  constants (a `Pow` exponent, an `eps`), which it writes as weights too. A training step
  would otherwise train them (a `Pow` exponent's gradient at a negative base is NaN: Wan).
  Values its optimizer folded from a parameter (a transposed projection) stay weights.
"""

from __future__ import annotations

import ast
import re

_NOT_IDENTIFIER = re.compile(r"\W")


def with_identifier_names(proto) -> tuple[object, dict[str, str]]:
    """`proto` (modified in place) with every value and initializer name a C identifier,
    unique, and {new name: name in the file} of the renamed initializers."""
    graph = proto.graph
    if any(attr.type in (attr.GRAPH, attr.GRAPHS) for n in graph.node for attr in n.attribute):
        return proto, {}  # control flow: its bodies read outer names; left as written
    kept = {v.name for v in graph.input} | {v.name for v in graph.output}
    names = [i.name for i in graph.initializer] + [o for n in graph.node for o in n.output]
    taken = set(kept) | set(names)
    renamed: dict[str, str] = {}
    for name in names:
        if not name or name in kept or name in renamed or _is_identifier(name):
            continue
        base = _NOT_IDENTIFIER.sub("_", name).strip("_") or "v"
        base = base if base[0].isalpha() else f"v_{base}"
        new, count = base, 1
        while new in taken:
            new, count = f"{base}_{count}", count + 1
        taken.add(new)
        renamed[name] = new
    if not renamed:
        return proto, {}
    for init in graph.initializer:
        init.name = renamed.get(init.name, init.name)
    for node in graph.node:
        node.input[:] = [renamed.get(n, n) for n in node.input]
        node.output[:] = [renamed.get(n, n) for n in node.output]
    for info in graph.value_info:
        info.name = renamed.get(info.name, info.name)
    initializers = {i.name for i in graph.initializer}
    return proto, {new: old for old, new in renamed.items() if new in initializers}


# What torch's dynamo exporter records on a weight's value_info: what torch.export called
# it, and for a value its optimizer folded into a weight, the values it was computed from.
_INPUT_KIND = "pkg.torch.export.graph_signature.InputSpec.kind"
_FOLDED_FROM = "pkg.onnxscript.optimizer.folded_from"
# The exporter's names of the values it makes itself (a literal of the computation).
_EXPORTER_VALUE = re.compile(r"val_\d+")


def torch_non_parameters(proto) -> set[str]:
    """The names of the weights of `proto` that torch's dynamo exporter marks as not a
    module's parameters: buffers, and its own constants (unmarked, folded from nothing or
    from its own values alone). A value folded from a module's state (a transposed
    parameter) stays a weight: the parameter it was folded from is gone. Empty for a file
    no weight of which carries the marks (another exporter's: nothing tells its parameters
    from its constants)."""
    meta = {info.name: {e.key: e.value for e in info.metadata_props}
            for info in proto.graph.value_info}
    if not any(_INPUT_KIND in m for m in meta.values()):
        return set()
    return {i.name for i in proto.graph.initializer if _not_a_parameter(meta.get(i.name, {}))}


def _not_a_parameter(marks: dict) -> bool:
    kind = marks.get(_INPUT_KIND)
    if kind is not None:
        return kind != "PARAMETER"
    sources = _names_listed(marks.get(_FOLDED_FROM, "[]"))
    return sources is not None and all(_EXPORTER_VALUE.fullmatch(n) for n in sources)


def _names_listed(text: str) -> list[str] | None:
    """The names of a printed Python list of strings, or None when it is not one."""
    try:
        names = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        return None
    return list(names)


def with_perms_in_range(proto) -> tuple[object, int]:
    """`proto` (modified in place) with every `Transpose` perm in [0, rank) (a negative entry
    p read as rank + p, as torch's permute reads it), and how many perms were changed."""
    changed = 0
    for node in _nodes(proto.graph):
        if node.op_type != "Transpose":
            continue
        for attr in node.attribute:
            if attr.name == "perm" and any(p < 0 for p in attr.ints):
                attr.ints[:] = [p % len(attr.ints) for p in attr.ints]
                changed += 1
    return proto, changed


def _nodes(graph):
    """Every node of `graph` and of the graphs in its nodes' attributes (control flow)."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == attr.GRAPH else list(attr.graphs):
                yield from _nodes(sub)


def _is_identifier(name: str) -> bool:
    return name.isidentifier() and name.isascii()


def simplified(proto):
    """`proto` with its constant subgraphs folded by onnxsim, batch norms kept as they are
    (their parameters stay the model's); None where onnxsim is not installed or fails."""
    try:
        import onnxsim
    except ImportError:
        return None
    try:
        folded, valid = onnxsim.simplify(proto, skip_fuse_bn=True)
    except Exception:
        return None
    return folded if valid else None
