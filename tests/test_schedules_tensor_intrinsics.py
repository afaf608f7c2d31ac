"""The cheap `inspect.stack` used while TVM's tensor intrinsics are imported: TVMScript parses
the same functions under it (it reads the frames, their locals and the code context of the
frames nearest its caller)."""

import inspect

import tvm
from tvm.script import ir as I
from tvm.script import tirx as T

from tvm_ext.schedules import tensor_intrinsics
from tvm_ext.schedules.tensor_intrinsics import _cheap_stack


def _parse():
    n = 16  # a closure variable: TVMScript finds it in the caller's frame

    @I.ir_module
    class Module:
        @T.prim_func
        def main(a: T.Buffer((n,), "float32"), b: T.Buffer((n,), "float32")):
            for i in range(n):
                b[i] = a[i] * T.float32(2)

    @T.prim_func
    def alone(a: T.Buffer((n,), "float32")):
        for i in range(n):
            a[i] = T.float32(0)

    return Module, alone


def test_tvmscript_parses_the_same_under_the_cheap_stack():
    plain = _parse()
    with _cheap_stack():
        assert inspect.stack is tensor_intrinsics._stack
        cheap = _parse()
    assert inspect.stack is not tensor_intrinsics._stack
    for a, b in zip(plain, cheap, strict=True):
        tvm.ir.assert_structural_equal(a, b)


def test_frames_are_the_same_and_the_nearest_have_their_context():
    full, cheap = inspect.stack(), tensor_intrinsics._stack()
    assert [r.frame for r in cheap[1:]] == [r.frame for r in full[1:]]
    near = tensor_intrinsics._FULL_FRAMES
    for a, b in zip(full[1:near], cheap[1:near], strict=True):
        assert (a.filename, a.lineno, a.function) == (b.filename, b.lineno, b.function)
        assert a.code_context == b.code_context
    assert all(r.code_context is None for r in cheap[near:])
