"""The value of a Relax expression computed from constants alone, evaluated at compile time.

The frontends compute a causal mask from `arange`s and comparisons; FoldConstant folds it
only once it is legalized, which is after the passes that want to read the mask. Here the
bindings the expression depends on are gathered into a function of no parameters, legalized,
built for the CPU and run once. An expression that reads a parameter, a binding outside the
dataflow blocks or anything but a Relax operator has no compile-time value (None); nor has one
whose result holds more than `max_elements` elements, or one TVM cannot legalize or build.
"""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

MAX_ELEMENTS = 1 << 26


def _reads(expr) -> list:
    found: list = []
    tvm_ffi.structural_walk(expr, [(relax.Var, found.append)])
    return found


def _operators_only(value) -> bool:
    """Whether `value` calls nothing but Relax operators (no kernel, packed or impure call)."""
    calls: list = []
    tvm_ffi.structural_walk(value, [(relax.Call, calls.append)])
    return all(isinstance(c.op, tvm.ir.Op) and not c.op.name.startswith("relax.call_")
               for c in calls)


def _needed(expr, bindings: dict) -> list | None:
    """The vars `expr` reads, directly or not, each after the vars its value reads; None where
    one is not in `bindings` or its value calls something other than an operator."""
    order, visited = [], set()
    stack = [(v, False) for v in _reads(expr)]
    while stack:
        var, expanded = stack.pop()
        if expanded:
            order.append(var)
            continue
        if var in visited:
            continue
        if var not in bindings or not _operators_only(bindings[var]):
            return None
        visited.add(var)
        stack.append((var, True))
        stack.extend((r, False) for r in _reads(bindings[var]) if r not in visited)
    return order


class ConstantEvaluator:
    """Evaluates expressions of one function's dataflow `bindings` (var -> value) that depend
    on constants alone; equal computations (one mask per layer) are built and run once."""

    def __init__(self, bindings: dict, max_elements: int = MAX_ELEMENTS):
        self.bindings, self.max_elements = bindings, max_elements
        self._cache: dict = {}
        self.builds = 0  # functions built and run

    def value(self, expr) -> np.ndarray | None:
        if isinstance(expr, tvm.ir.Constant):
            return expr.value.numpy()
        ty = getattr(expr, "ty", None)
        if not isinstance(ty, relax.TensorType) or ty.shape is None or \
                not all(isinstance(d, tvm.tirx.IntImm) for d in ty.shape) or \
                np.prod([int(d) for d in ty.shape]) > self.max_elements:
            return None
        order = _needed(expr, self.bindings)
        if order is None:
            return None
        func = self._function(order, expr)
        key = tvm_ffi.structural_hash(func)
        for known, value in self._cache.get(key, []):
            if tvm_ffi.structural_equal(known, func):
                return value
        try:
            value = self._run(func)
        except (RuntimeError, ValueError, TypeError):  # TVM's errors are RuntimeErrors
            value = None  # an operator this TVM cannot legalize or build: no value, no fact
        self.builds += 1
        self._cache.setdefault(key, []).append((func, value))
        return value

    def _function(self, order: list, expr) -> relax.Function:
        bindings = [relax.VarBinding(var, self.bindings[var]) for var in order]
        out = relax.Var("out", expr.ty)
        block = relax.DataflowBlock([*bindings, relax.VarBinding(out, expr)])
        return relax.Function([], relax.SeqExpr([block], out), expr.ty)

    @staticmethod
    def _run(func: relax.Function) -> np.ndarray:
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        mod = relax.transform.LegalizeOps()(mod)
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
        return vm["main"]().numpy()
