"""DataflowGraph: the one input of every tvm_ext planner.

Built from a Relax function after legalization and fusion (`LegalizeOps`, `FuseOps`,
`FuseTIR`; optionally `RewriteDataflowReshape` and the lowering up to `CallTIRRewrite`), it
holds plain data only:

* ops, one per kernel call (`call_tir`), view (`reshape`, `memory.view`) or builtin
  (`call_packed`, `call_dps_packed`), in the order of the IR, with FLOPs, bytes moved and
  scratch bytes read from the kernel's TIR, and the phase (forward / backward);
* tensors, one per value: shape, dtype, bytes, producer, consumers, and a kind:
  `parameter`, `state` (an optimizer's state) and `input` (function arguments), `constant`
  (embedded in the module), `activation` (made by a forward op), `gradient` (made by a
  backward op), `workspace` (a kernel's scratch, live during that op only). A view has
  `alias_of` set: it takes no bytes and keeps its base alive.
* in-place updates: an optimizer step (`tvm_ext.models.optimizer`) returns new values of
  arguments that the compiled code writes into the argument's own buffer. Such a value has
  `alias_of` (the argument it overwrites) and `overwrites` (the version of it the op read)
  set, takes no bytes, and its producer (an op of phase `update`) must follow every other
  reader of the old version (`must_follow`, part of `is_topological`).

`peak_memory(order)` is the peak of live bytes under an order, without swapping: arguments and
constants are resident throughout, a tensor is live from its producer to its last consumer
(outputs to the end), a view extends its base. Op ids are positions in the IR, so a pass that
rebuilds the graph of the same function gets the same ids.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence

import numpy as np

from .errors import InputError

OP_KINDS = ("kernel", "view", "builtin")
TENSOR_KINDS = ("parameter", "state", "input", "constant", "activation", "gradient",
                "workspace")
_ARG_KINDS = ("parameter", "state", "input", "constant")


class GraphBuildError(InputError):
    """The function is not in the form the graph builder reads."""


@dataclasses.dataclass
class Op:
    id: int
    name: str  # the bound variable in the IR
    kernel: str  # callee: PrimFunc name, view op or packed function
    kind: str  # one of OP_KINDS
    inputs: list[int]
    outputs: list[int]
    flops: float = 0.0
    bytes_moved: int = 0
    workspace: int | None = None  # tensor id of the kernel's scratch, if any
    phase: str = "forward"  # "forward", "backward" or "update" (writes arguments in place)
    library: bool = False  # its GEMM/convolution runs in a vendor library (by default)
    low_precision: bool = False  # ... with float16/bfloat16 operands (tensor-core rates)
    reduces: bool = False  # its kernel reduces (a GEMM, a row sum, a norm's statistics)
    # Dims it may run along in chunks (`tvm_ext.ir.time_splits`); None: not analysed.
    time_splits: list | None = None


@dataclasses.dataclass
class Tensor:
    id: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    kind: str  # one of TENSOR_KINDS
    producer: int | None = None
    consumers: list[int] = dataclasses.field(default_factory=list)
    alias_of: int | None = None  # base tensor of a view
    is_output: bool = False
    arg_index: int | None = None  # position among the function parameters
    overwrites: int | None = None  # in-place update: the tensor whose buffer it overwrites


@dataclasses.dataclass
class DataflowGraph:
    """Ops in IR order and the tensors between them; see the module docstring."""

    ops: list[Op]
    tensors: list[Tensor]
    outputs: list[int]
    function: str = "main"
    num_input: int = 0

    # ---------------------------------------------------------------- queries
    @property
    def order(self) -> list[int]:
        """The order of the IR."""
        return [op.id for op in self.ops]

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    def base(self, tid: int) -> int:
        """The tensor that owns the bytes of `tid` (itself unless it is a view)."""
        while self.tensors[tid].alias_of is not None:
            tid = self.tensors[tid].alias_of
        return tid

    def tensors_of_kind(self, *kinds: str) -> list[Tensor]:
        return [t for t in self.tensors if t.kind in kinds]

    def bytes_of_kind(self, *kinds: str) -> int:
        return sum(t.nbytes for t in self.tensors if t.kind in kinds and t.alias_of is None)

    @property
    def total_flops(self) -> float:
        return float(sum(op.flops for op in self.ops))

    def is_topological(self, order: Sequence[int]) -> bool:
        """Every op after the producers of its inputs, and an in-place update after every
        other reader of what it overwrites."""
        if sorted(order) != list(range(len(self.ops))):
            return False
        position = {op: i for i, op in enumerate(order)}
        for op in self.ops:
            for tid in op.inputs:
                producer = self.tensors[tid].producer
                if producer is not None and position[producer] >= position[op.id]:
                    return False
            if any(position[r] >= position[op.id] for r in self.must_follow(op.id)):
                return False
        return True

    def must_follow(self, op_id: int) -> list[int]:
        """The ops an in-place update must follow besides its producers: every other reader of
        a tensor it overwrites, or of a view of it (they read the old values)."""
        out: dict[int, None] = {}
        for tid in self.ops[op_id].outputs:
            old = self.tensors[tid].overwrites
            if old is None:
                continue
            stack = [old]
            while stack:
                t = self.tensors[stack.pop()]
                for c in t.consumers:
                    if c == op_id:
                        continue
                    out.setdefault(c, None)
                    if self.ops[c].kind == "view":
                        stack += [v for v in self.ops[c].outputs
                                  if self.tensors[v].alias_of is not None]
        return list(out)

    def overwritten(self, op_id: int) -> list[int]:
        """The base tensors an op writes in place."""
        return list(dict.fromkeys(self.base(t) for t in self.ops[op_id].outputs
                                  if self.tensors[t].overwrites is not None))

    def op_working_set(self, op_id: int) -> int:
        """Bytes that must be on the device while one op runs: its distinct input and output
        bases and its scratch. No budget below the largest of these can run the graph."""
        op = self.ops[op_id]
        bases = {self.base(t) for t in (*op.inputs, *op.outputs)}
        if op.workspace is not None:
            bases.add(op.workspace)
        return sum(self.tensors[b].nbytes for b in bases)

    # ---------------------------------------------------------------- memory
    def lifetimes(self, order: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """First and last step (position in `order`) each base tensor is live; -1 / n for
        tensors resident before the first / after the last step. Views get (-2, -2)."""
        order = self.order if order is None else list(order)
        if not self.is_topological(order):
            raise ValueError("order is not a topological order of the graph's ops")
        n = len(order)
        position = np.empty(len(self.ops), dtype=np.int64)
        position[np.asarray(order, dtype=np.int64)] = np.arange(n)
        start = np.full(len(self.tensors), -2, dtype=np.int64)
        end = np.full(len(self.tensors), -2, dtype=np.int64)
        for t in self.tensors:
            if t.alias_of is not None:
                continue
            if t.kind in _ARG_KINDS:
                start[t.id], end[t.id] = -1, n
            else:
                start[t.id] = position[t.producer]
                end[t.id] = start[t.id]
        for t in self.tensors:
            b = self.base(t.id)
            if t.kind in _ARG_KINDS:
                continue
            for c in t.consumers:
                end[b] = max(end[b], position[c])
            if t.is_output:
                end[b] = n
        return start, end

    def memory_timeline(
        self, order: Sequence[int] | None = None, kinds: Iterable[str] = TENSOR_KINDS
    ) -> np.ndarray:
        """Live bytes at each step of `order` (tensors of the given kinds only)."""
        order = self.order if order is None else list(order)
        start, end = self.lifetimes(order)
        n = len(order)
        delta = np.zeros(n + 2, dtype=np.int64)
        kinds = set(kinds)
        for t in self.tensors:
            if t.alias_of is not None or t.kind not in kinds:
                continue
            s, e = max(start[t.id], 0), min(end[t.id], n - 1)
            delta[s] += t.nbytes
            delta[e + 1] -= t.nbytes
        return np.cumsum(delta)[:n]

    def peak_memory(
        self, order: Sequence[int] | None = None, kinds: Iterable[str] = TENSOR_KINDS
    ) -> int:
        """Peak live bytes under `order` (default: the IR's), without swapping."""
        if not self.ops:
            return self.bytes_of_kind(*kinds)
        return int(self.memory_timeline(order, kinds).max())

    # ---------------------------------------------------------------- serialization
    def to_dict(self) -> dict:
        return {
            "function": self.function,
            "num_input": self.num_input,
            "outputs": list(self.outputs),
            "ops": [dataclasses.asdict(op) for op in self.ops],
            "tensors": [dataclasses.asdict(t) for t in self.tensors],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict) -> DataflowGraph:
        ops = [Op(**op) for op in data["ops"]]
        tensors = []
        for t in data["tensors"]:
            t = dict(t)
            t["shape"] = tuple(t["shape"])
            tensors.append(Tensor(**t))
        return cls(ops, tensors, list(data["outputs"]), data["function"], data["num_input"])

    @classmethod
    def from_json(cls, text: str) -> DataflowGraph:
        return cls.from_dict(json.loads(text))

    def summary(self) -> dict:
        kinds = {k: self.bytes_of_kind(k) for k in TENSOR_KINDS}
        return {
            "ops": len(self.ops),
            "kernels": sum(op.kind == "kernel" for op in self.ops),
            "tensors": len(self.tensors),
            "gflops": self.total_flops / 1e9,
            "bytes_by_kind": kinds,
            "peak_bytes": self.peak_memory(),
            "backward_ops": sum(op.phase == "backward" for op in self.ops),
        }
