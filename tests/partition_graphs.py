"""Small partition problems written by hand, without IR: for the search tests.

`GraphMaker` adds tensors and operators to a `DataflowGraph` and the matching `KernelSpec`s;
`random_problem` draws layered graphs of matmuls, element-wise ops and reductions.
"""

from __future__ import annotations

import numpy as np

from tvm_ext.graph import DataflowGraph, Op, Tensor
from tvm_ext.partition import AxisCut, DimSpec, KernelSpec, PartitionProblem


class GraphMaker:
    def __init__(self):
        self.ops: list[Op] = []
        self.tensors: list[Tensor] = []
        self.specs: dict[str, KernelSpec] = {}
        self.op_spec: list[str] = []

    def tensor(self, name: str, shape, kind: str = "activation", producer=None) -> int:
        tid = len(self.tensors)
        nbytes = int(np.prod(shape, dtype=np.int64)) * 4
        self.tensors.append(Tensor(tid, name, tuple(shape), "float32", nbytes, kind, producer,
                                   arg_index=None if producer is not None else tid))
        return tid

    def op(self, spec: KernelSpec, inputs: list[int], out_shapes: list[tuple], flops: float,
           name: str | None = None) -> list[int]:
        oid = len(self.ops)
        name = name or f"op{oid}"
        self.specs.setdefault(spec.kernel, spec)
        op = Op(oid, name, spec.kernel, "kernel", list(inputs), [], float(flops),
                int(sum(self.tensors[t].nbytes for t in inputs)))
        self.ops.append(op)
        for t in dict.fromkeys(inputs):
            self.tensors[t].consumers.append(oid)
        op.outputs = [self.tensor(f"{name}.out{i}", s, producer=oid)
                      for i, s in enumerate(out_shapes)]
        self.op_spec.append(spec.kernel)
        return op.outputs

    def problem(self, outputs: list[int]) -> PartitionProblem:
        for t in outputs:
            self.tensors[t].is_output = True
        graph = DataflowGraph(self.ops, self.tensors, outputs, "main",
                              sum(t.kind == "input" for t in self.tensors))
        return PartitionProblem(graph, self.specs, self.op_spec)


def matmul_spec(m: int, k: int, n: int) -> KernelSpec:
    """C[m, n] = sum_k A[m, k] B[k, n]."""
    return KernelSpec(f"matmul_{m}_{k}_{n}", 2, 1, [
        DimSpec("i", m, [AxisCut(0), None], [0]),
        DimSpec("j", n, [None, AxisCut(1)], [1]),
        DimSpec("k", k, [AxisCut(1), AxisCut(0)], ["sum"]),
    ])


def elementwise_spec(shape, arity: int = 1) -> KernelSpec:
    dims = [DimSpec(f"ax{a}", n, [AxisCut(a)] * arity, [a]) for a, n in enumerate(shape)]
    return KernelSpec(f"ew{arity}_{'x'.join(map(str, shape))}", arity, 1, dims)


def reduce_rows_spec(m: int, n: int) -> KernelSpec:
    """y[n] = sum_m x[m, n]."""
    return KernelSpec(f"colsum_{m}_{n}", 1, 1, [
        DimSpec("j", n, [AxisCut(1)], [0]),
        DimSpec("i", m, [AxisCut(0)], ["sum"]),
    ])


def random_problem(seed: int, num_ops: int = 4) -> PartitionProblem:
    """A random layered graph: an input batch flows through matmuls with parameters,
    element-wise ops and column sums."""
    rng = np.random.default_rng(seed)
    sizes = [2, 4, 6, 8, 12]
    g = GraphMaker()
    batch = int(rng.choice(sizes))
    width = int(rng.choice(sizes))
    x = g.tensor("x", (batch, width), kind="input")
    frontier = [x]
    outputs = []
    for i in range(num_ops):
        t = frontier[int(rng.integers(len(frontier)))]
        shape = g.tensors[t].shape
        kind = rng.choice(["matmul", "matmul", "ew", "add", "colsum"])
        if kind == "matmul" and len(shape) == 2:
            n = int(rng.choice(sizes))
            w = g.tensor(f"w{i}", (shape[1], n), kind="parameter")
            (y,) = g.op(matmul_spec(shape[0], shape[1], n), [t, w], [(shape[0], n)],
                        2 * shape[0] * shape[1] * n)
        elif kind == "add":
            same = [u for u in frontier if g.tensors[u].shape == shape and u != t]
            other = same[0] if same else t
            (y,) = g.op(elementwise_spec(shape, 2), [t, other], [shape], np.prod(shape))
        elif kind == "colsum" and len(shape) == 2:
            (y,) = g.op(reduce_rows_spec(*shape), [t], [(shape[1],)], np.prod(shape))
        else:
            (y,) = g.op(elementwise_spec(shape), [t], [shape], np.prod(shape))
        frontier.append(y)
    for t in frontier[1:]:
        if not g.tensors[t].consumers:
            outputs.append(t)
    return g.problem(outputs or [frontier[-1]])
