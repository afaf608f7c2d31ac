"""Which of a program's selections (topk, sort, argmax ...) chose among tied values when
PyTorch ran it. Where values tie, PyTorch and TVM break the tie differently (PyTorch's order
comes from its partial sort), so a model that selects among ties (Doge at its
initialisation: every key's dynamic-mask score is exp(0)) gives other outputs in each
without a fault in either. Found by running the program with each selection watched."""

from __future__ import annotations

# aten overload -> (the op as said, how its selection is read: "k" topk, "one" arg-extremes,
# "all" a sort).
SELECTIONS = {
    "aten.topk.default": ("topk", "k"),
    "aten.argmax.default": ("argmax", "one"),
    "aten.argmin.default": ("argmin", "one"),
    "aten.max.dim": ("max", "one"),
    "aten.min.dim": ("min", "one"),
    "aten.sort.default": ("sort", "all"),
    "aten.sort.stable": ("sort", "all"),
    "aten.argsort.default": ("argsort", "all"),
    "aten.argsort.stable": ("argsort", "all"),
}


class TieWatch:
    """A selection node run as itself, recording in `found[node]` (op, tied rows, rows) when
    some row's deciding values tie."""

    def __init__(self, target, node: str, found: dict):
        self.target, self.node, self.found = target, node, found
        self.op, self.kind = SELECTIONS[str(target)]
        self.__name__ = f"watched_{self.op}"

    def __call__(self, *args, **kwargs):
        out = self.target(*args, **kwargs)
        tied, rows = tied_rows(self.op, self.kind, args, kwargs)
        if tied:
            self.found[self.node] = (self.op, tied, rows)
        return out


def watch(module, found: dict) -> None:
    """Replace each selection node of the graph module with a `TieWatch` writing to `found`."""
    for node in module.graph.nodes:
        if node.op == "call_function" and str(node.target) in SELECTIONS:
            node.target = TieWatch(node.target, node.name, found)
    module.recompile()


def tied_rows(op: str, kind: str, args: tuple, kwargs: dict) -> tuple[int, int]:
    """(rows whose selection is decided among equal values, rows) of one call."""
    x = args[0].detach()
    if kind == "k":
        k = args[1]
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
        keep = k + 1  # the k chosen and the first one left out
    elif kind == "one":
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        largest, keep = op in ("argmax", "max"), 2
    else:
        dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
        largest, keep = False, None
    if dim is None:
        x, dim = x.reshape(-1), 0
    if x.dim() == 0 or x.shape[dim] < 2:
        return 0, 0
    ordered = x.movedim(dim, -1).sort(dim=-1, descending=largest).values[..., :keep]
    ties = (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1)
    return int(ties.sum()), ties.numel()


def describe(found: dict) -> str:
    """'topk (node topk): 512 of 512 rows; ...'."""
    return "; ".join(f"{op} (node {node}): {tied} of {rows} rows"
                     for node, (op, tied, rows) in found.items())
