"""What the rewriting passes record on the function they rewrite (function attributes), and
reading it back: a rewritten function is recognised by its record, so each pass is idempotent
and PartitionOperators refuses a function SwapOffload already rewrote."""

from __future__ import annotations

import json

import tvm
from tvm import relax

from ..errors import InputError, InternalError

PARTITION_ATTR = "tvm_ext.partition"  # JSON: layouts, plan summary, fallbacks
SWAP_PLAN_ATTR = "tvm_ext.swap_plan"  # JSON: the swap plan's summary
SWAP_ARGS_ATTR = "tvm_ext.swap_arguments"  # per argument "device" or "host"
# On an optimizer step (tvm_ext.models.optimizer): per output after the loss, the argument it
# overwrites in place; and how many of the last arguments are optimizer state.
UPDATES_ATTR = "tvm_ext.updates"
STATE_ATTR = "tvm_ext.optimizer_state"
# On a kernel: the runtime library functions it calls (DispatchLibraryKernels).
LIBRARY_ATTR = "tvm_ext.library"
# Name prefix of the blocks that call the library inside such a kernel.
LIBRARY_BLOCK_PREFIX = "tvm_ext_library"


def has_record(func, attr: str) -> bool:
    """Whether `func` carries the record `attr` (a pass already rewrote it)."""
    return func.attrs is not None and attr in func.attrs


def argument_updates(func) -> dict[int, int]:
    """Output position -> the argument it overwrites, of a function that updates arguments in
    place (an optimizer step); {} for any other."""
    if not has_record(func, UPDATES_ATTR):
        return {}
    return {k + 1: int(a) for k, a in enumerate(func.attrs[UPDATES_ATTR])}


def argument_writers(func, values: dict) -> dict[relax.Var, dict[int, int]]:
    """Of a function that updates arguments in place (`argument_updates`; `values`: its
    bindings, var -> value): the binding var that makes each new value -> {its output index
    (the field of a tuple result, else 0): the argument index it overwrites}. A returned
    argument itself has no binding and is left out."""
    updates = argument_updates(func)
    if not updates:
        return {}
    ret = func.body.body
    if isinstance(ret, relax.Var) and isinstance(values.get(ret), relax.Tuple):
        ret = values[ret]
    if not isinstance(ret, relax.Tuple):
        raise InternalError("an optimizer step returns a tuple (loss, new values...)")
    writers: dict = {}
    for position, arg in updates.items():
        var, index = ret.fields[position], 0
        if isinstance(values.get(var), relax.TupleGetItem):
            var, index = values[var].tuple_value, values[var].index
        if var in values:
            writers.setdefault(var, {})[index] = arg
    return writers


def partition_record(mod: tvm.IRModule, function: str = "main") -> dict:
    """The record of a function PartitionOperators rewrote: `mesh`, and per argument and output
    `name`, `shape` (whole), `dtype` and `layout`, the plan summary and the fallbacks."""
    if not has_record(mod[function], PARTITION_ATTR):
        raise InputError(f"{function} is not partitioned (no {PARTITION_ATTR} attribute)")
    return json.loads(str(mod[function].attrs[PARTITION_ATTR]))
