"""StaticKernelCalls: every kernel a function calls has static shapes, every view is a view.

TVM's GPU scan and sort (`relax.backend.DispatchSortScan`, which turns a `cumsum` into
`gpu_2d_continuous_cumsum`) emit generic kernels, whose buffer extents are symbolic and bound
by each call, between `vm.builtin.reshape` packed calls. The planners read kernels of static
shape (their FLOPs, bytes and splittable dims) and views as `relax.reshape`. So each
`R.call_tir` of a generic kernel gets a copy specialized to that call's shapes (one copy per
distinct shape; a copy is named after the kernel and its shapes), and each
`vm.builtin.reshape` becomes the `R.reshape` it lowers from. `relax.transform.
SpecializePrimFuncBasedOnCallSite` does not serve: it binds a kernel called at two shapes to
one of them. Results are bit for bit those of the unmodified module.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, tirx

from tvm_ext.ir.kernel_calls import call_tir_args, call_tir_kernel
from tvm_ext.ir.kernel_cost import has_symbolic_buffers
from tvm_ext.ir.relax_exprs import static_shape, type_shape

_RESHAPE = "vm.builtin.reshape"


def _shape(param):
    return getattr(param, "shape", None)


def specialize(func: tirx.PrimFunc, shapes: list[tuple[int, ...]]) -> tirx.PrimFunc:
    """`func` with its buffer parameters' extents bound to `shapes`, in parameter order."""
    buffers = [p for p in func.params if _shape(p) is not None]
    if len(buffers) != len(shapes):
        raise ValueError(f"the kernel takes {len(buffers)} buffers, the call passes "
                         f"{len(shapes)}")
    binding = {}
    for param, shape in zip(buffers, shapes, strict=True):
        extents = [tirx.IntImm(_dtype(d), v) for d, v in zip(param.shape, shape, strict=True)]
        binding[param] = tirx.decl_buffer(extents, param.dtype, param.name,
                                          elem_offset=param.elem_offset)
    return func.specialize(binding)


def _dtype(extent) -> str:
    """The integer dtype of a buffer extent (a symbolic Var keeps it in its type)."""
    return str(extent.dtype) if isinstance(extent, tirx.IntImm) else str(extent.ty.dtype)


def _out_types(call: relax.Call) -> list:
    ty = call.ty_args[0]
    return list(ty.fields) if isinstance(ty, relax.TupleType) else [ty]


@tvm.transform.module_pass(opt_level=0, name="StaticKernelCalls")
class StaticKernelCalls:
    """Specialize generic kernels per call and read builtin reshapes as views (see the module
    docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        generic = {gv.name_hint for gv, f in mod.functions_items() if has_symbolic_buffers(f)}
        if not generic and not _has_builtin_reshape(mod):
            return mod
        rewriter = _Rewriter(mod, generic)
        for gv, func in list(mod.functions_items()):
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        out = rewriter.builder_.get()
        for name in generic:
            # Dropped once no call is left to it (a copy now serves each call).
            if not _named(out, name):
                del out[name]
        return out


def _has_builtin_reshape(mod: tvm.IRModule) -> bool:
    found: list = []
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            tvm_ffi.structural_walk(func, [(relax.Call, lambda c: found.append(
                _is_builtin_reshape(c)))])
    return any(found)


def _named(mod: tvm.IRModule, name: str) -> bool:
    """Whether some Relax function of `mod` names the function `name`."""
    found: list = []
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            tvm_ffi.structural_walk(func, [(tvm.ir.GlobalVar, lambda g: found.append(
                g.name_hint == name))])
    return any(found)


@relax.expr_functor.mutator
class _Rewriter(relax.expr_functor.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, generic: set[str]):
        super().__init__(mod)
        self.mod_ = mod
        self.generic = generic
        self.copies: dict[tuple, tvm.ir.GlobalVar] = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if _is_builtin_reshape(call):
            return relax.op.reshape(call.args[1], call.args[2])
        name = call_tir_kernel(call)
        if name not in self.generic:
            return call
        shapes = [static_shape(a) for a in call_tir_args(call)]
        shapes += [type_shape(t) for t in _out_types(call)]
        if any(s is None for s in shapes):
            return call  # a call of symbolic shape: the planners refuse it by name
        key = (name, tuple(shapes))
        if key not in self.copies:
            func = specialize(self.mod_[name], shapes)
            label = "_".join("x".join(map(str, s)) or "s" for s in shapes)
            self.copies[key] = self.builder_.add_func(func, f"{name}_{label}")
        return relax.Call(call.op, [self.copies[key], *call.args[1:]], call.attrs,
                          call.ty_args)


def _is_builtin_reshape(call: relax.Call) -> bool:
    return isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.call_pure_packed" and \
        isinstance(call.args[0], relax.ExternFunc) and call.args[0].global_symbol == _RESHAPE
