"""Which bindings of a Relax function read each of its variables."""

from __future__ import annotations

from tvm import relax


def readers(func: relax.Function) -> dict:
    """var -> the vars of the bindings that read it, once per read (a binding reading it twice
    is listed twice), None standing for the function's output."""
    found: dict = {}

    def reads(expr, reader) -> None:
        def visit(node):
            if isinstance(node, relax.Var):
                found.setdefault(node, []).append(reader)
        relax.analysis.post_order_visit(expr, visit)

    body = func.body
    if not isinstance(body, relax.SeqExpr):
        reads(body, None)
        return found
    for block in body.blocks:
        for binding in block.bindings:
            reads(binding.value, binding.var)
    reads(body.body, None)
    return found
