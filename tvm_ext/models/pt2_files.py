"""Reading a torch `ExportedProgram` file (`torch.export.save`, `.pt2`) as users save them.

- A model exported without a wrapper returns the output container of its library (every
  `transformers` model returns a `ModelOutput` dataclass such as `CausalLMOutputWithPast`),
  which the file names in its pytree specs. torch loads the file only once that class is
  registered as a pytree node, which importing its module does. `load_program` imports the
  modules the specs name where they are installed; a class that is not installed is stood in
  for by a mapping of its fields, so the graph loads all the same.
- The outputs are the tensors of that container (`output_names`), the logits first where there
  are logits (a training step's loss is computed over the first output).
- A custom op the graph calls is registered first where its library is installed
  (`CUSTOM_OP_MODULES`: transformers' mixture-of-experts product); any other is named in the
  error.
- torch's deprecation warnings and the traceback it logs for a file it cannot read are kept
  out of the way; a file that does not parse raises `Pt2ParseError` with torch's reason.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import re
import warnings
import zipfile
from typing import TYPE_CHECKING

from ..errors import InputError

if TYPE_CHECKING:
    from torch.export import ExportedProgram


class Pt2ParseError(InputError):
    """torch cannot read the file as an exported program."""


# Modules that register the custom ops a library's exports call, by the op's namespace: torch
# resolves `torch.ops.transformers.grouped_mm_fallback` (transformers' mixture-of-experts
# layers) only once its module has run.
CUSTOM_OP_MODULES = {"transformers": ("transformers.integrations.moe",)}
_UNRESOLVED = re.compile(r"resolve torch\.ops\.(\w+)\.(\w+)")


def load_program(path: str) -> ExportedProgram:
    """The exported program in `path`, the containers its specs name registered first, and
    the custom ops it calls where `CUSTOM_OP_MODULES` knows who registers them."""
    register_spec_types(spec_type_names(path))
    tried: set[str] = set()
    while True:
        try:
            return _load(path)
        except Pt2ParseError as err:
            found = _UNRESOLVED.search(str(err))
            if found is None:
                raise
            namespace, name = found.groups()
            modules = [m for m in CUSTOM_OP_MODULES.get(namespace, ()) if m not in tried]
            if not modules:
                raise Pt2ParseError(
                    f"the model calls the custom op {namespace}::{name}, which nothing has "
                    f"registered: import the module that defines it before loading the file"
                    f"{_installed_hint(namespace)}") from err
            for module in modules:
                tried.add(module)
                with contextlib.suppress(ImportError):
                    importlib.import_module(module)


def _installed_hint(namespace: str) -> str:
    if namespace in CUSTOM_OP_MODULES and importlib.util.find_spec(namespace) is None:
        return f" ({namespace} is not installed)"
    return ""


def _load(path: str) -> ExportedProgram:
    import torch

    reasons: list[str] = []
    with quiet_torch(reasons):
        try:
            return torch.export.load(path)
        except Exception as err:
            reason = reasons[-1] if reasons else f"{type(err).__name__}: {err}"
            raise Pt2ParseError(reason) from err


@contextlib.contextmanager
def quiet_torch(reasons: list[str] | None = None):
    """torch's FutureWarnings (its own pytree deprecations) silenced, and the errors torch.export
    logs with their tracebacks collected in `reasons` (one line each) instead of printed."""
    logger = logging.getLogger("torch.export")

    class _Collect(logging.Filter):
        def filter(self, record):
            if record.exc_info and reasons is not None:
                err = record.exc_info[1]
                reasons.append(f"{type(err).__name__}: {err}")
            return False

    collect = _Collect()
    logger.addFilter(collect)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        logger.removeFilter(collect)


def spec_type_names(path: str) -> set[str]:
    """The container types the pytree specs of the file's programs name; empty where the file
    is not an archive torch wrote (torch then says why it does not parse)."""
    names: set[str] = set()
    try:
        with zipfile.ZipFile(path) as archive:
            for member in archive.namelist():
                if "/models/" in member and member.endswith(".json"):
                    _collect_spec_types(json.loads(archive.read(member)), names)
    except (zipfile.BadZipFile, OSError, ValueError, KeyError):
        return set()
    return names


def _collect_spec_types(program: dict, names: set[str]) -> None:
    graph = program.get("graph_module", {}) if isinstance(program, dict) else {}
    for entry in graph.get("module_call_graph", []) or []:
        signature = (entry or {}).get("signature") or {}
        for key in ("in_spec", "out_spec"):
            text = signature.get(key)
            if isinstance(text, str):
                _types_in(json.loads(text), names)


def _types_in(schema, names: set[str]) -> None:
    if isinstance(schema, list):
        for item in schema:
            _types_in(item, names)
    elif isinstance(schema, dict):
        if isinstance(schema.get("type"), str):
            names.add(schema["type"])
        for child in schema.get("children_spec", []):
            _types_in(child, names)


def register_spec_types(names: set[str]) -> None:
    """Make each pytree type in `names` known to torch: import its module where it is installed
    (which registers it), else register a stand-in holding its fields by name."""
    from torch.utils import _pytree

    for name in sorted(names):
        if name in _pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
            continue
        module = name.rpartition(".")[0]
        if module and _installed(module):
            with contextlib.suppress(Exception), quiet_torch():
                importlib.import_module(module)
        if name not in _pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
            _register_stand_in(name)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


class OutputFields(dict):
    """A stand-in for an output container whose class is not installed: its fields by name."""


def _register_stand_in(name: str) -> None:
    from torch.utils import _pytree

    cls = type(name.rpartition(".")[2], (OutputFields,), {"__module__": __name__})

    def flatten(fields):
        return list(fields.values()), list(fields)

    def unflatten(values, context):
        return cls(zip(_field_names(context, len(values)), values, strict=True))

    def flatten_with_keys(fields):
        return [(_pytree.MappingKey(k), v) for k, v in fields.items()], list(fields)

    _pytree.register_pytree_node(cls, flatten, unflatten, serialized_type_name=name,
                                 flatten_with_keys_fn=flatten_with_keys)


def _field_names(context, count: int) -> list:
    """The names of a container's `count` children in its spec's context: a list of names
    (`transformers` outputs, dicts) or that list first (registered dataclasses); else their
    positions."""
    for names in (context, context[0] if isinstance(context, list) and context else None):
        if isinstance(names, list) and len(names) == count and \
                all(isinstance(k, str) for k in names):
            return names
    return list(range(count))


def output_names(program: ExportedProgram) -> tuple[str | None, list[str]]:
    """(the container's class name or None for plain tensors and tuples, the name of each
    output in the graph's order: "logits", "hidden_states[1]", "output[0]")."""
    spec = program.call_spec.out_spec
    if spec is None:
        return None, []
    container = None
    if not spec.is_leaf() and spec.type not in (tuple, list):
        container = getattr(spec.type, "__name__", str(spec.type))
    return container, _leaf_names(spec, "")


def _leaf_names(spec, prefix: str) -> list[str]:
    if spec.is_leaf():
        return [prefix or "output"]
    children = list(spec.children())
    keys = [f"{prefix}.{k}" if prefix and isinstance(k, str) else k if isinstance(k, str)
            else f"{prefix or 'output'}[{k}]"
            for k in _field_names(spec.context, len(children))]
    return [name for key, child in zip(keys, children, strict=True)
            for name in _leaf_names(child, key)]


def logits_first(names: list[str]) -> list[int]:
    """The order of the outputs with the logits first, the others as they come."""
    first = [i for i, n in enumerate(names) if n == "logits"][:1]
    return first + [i for i in range(len(names)) if i not in first]


def tied_aliases(program: ExportedProgram) -> dict[str, str]:
    """{placeholder: the earlier placeholder of the same tensor} for each parameter of the
    export whose tensor is an earlier parameter's: weights tied in the module (a language
    model's head and embedding), one parameter to torch and to its optimizer, which
    torch.export keeps as two placeholders (every use routed to one of them)."""
    from torch.export.graph_signature import InputKind

    specs = [s for s in program.graph_signature.input_specs if s.kind == InputKind.PARAMETER]
    state = program.state_dict
    first: dict = {}
    aliases = {}
    for spec in specs:
        t = state.get(spec.target)
        if t is None or t.numel() == 0:
            continue
        view = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                tuple(t.stride()), t.dtype)
        if view in first:
            aliases[spec.arg.name] = first[view]
        else:
            first[view] = spec.arg.name
    return aliases
