"""What splitting one iteration dimension of an operator does to its tensors (plain data).

`tvm_ext.ir.kernel_dims` derives these from each kernel's TIR; everything else in
`tvm_ext.partition` reads only these dataclasses, never IR.

An operator (one kernel call or view) iterates over *dims*: classes of block iteration variables
that index the same tensor axes, chained through the kernel's intermediate buffers. Splitting a
dim into p contiguous chunks (Tofu's "partition-n-reduce"):

* each input gets an `AxisCut` (the axis that dim indexes, plus the halo rows a window reads
  beyond its chunk) or `None`: the input is needed whole;
* each output is cut on an axis, or is a partial result to combine (`"sum"`, `"max"`, ...) when
  the dim is reduced into it, or `None`: replicated (computed the same on every device);
* intermediate buffers the kernel reduces over the dim and reads again (softmax's max and sum,
  layer norm's mean, a matmul followed by a bias add) need an `InnerReduce`: an allreduce in the
  middle of the kernel.
"""

from __future__ import annotations

import dataclasses

COMBINERS = ("sum", "max", "min", "prod")


@dataclasses.dataclass(frozen=True)
class AxisCut:
    """An input axis split like the dim, reading `halo_lo` / `halo_hi` extra rows around its
    chunk (a convolution or pooling window)."""

    axis: int
    halo_lo: int = 0
    halo_hi: int = 0

    @property
    def halo(self) -> bool:
        return self.halo_lo > 0 or self.halo_hi > 0


@dataclasses.dataclass(frozen=True)
class InnerReduce:
    """An intermediate buffer reduced over the dim and read again inside the kernel: after the
    block that writes it, the partial results must be combined across the devices."""

    buffer: str  # the buffer's name in the kernel
    combiner: str  # one of COMBINERS
    nbytes: int  # full size of the buffer
    dims: tuple[int, ...]  # for each of its axes, the op dim it belongs to (-1: none)


@dataclasses.dataclass
class DimSpec:
    """One iteration dimension of an operator and what splitting it implies."""

    name: str  # block and iteration variable it came from, e.g. "matmul.v_k"
    extent: int
    inputs: list[AxisCut | None]  # per operator input
    outputs: list[int | str | None]  # per output: cut axis, partial combiner, or None
    inner: list[InnerReduce] = dataclasses.field(default_factory=list)
    # The kernel uses the iteration index as a value (padding tests, one-hot, argmax): a split
    # kernel must be given its global index, and only contiguous chunks are allowed.
    global_index: bool = False
    reason: str | None = None  # why this dim must not be split (None: it may)
    # Chunk counts must divide this (the extents of every variable and axis the dim indexes
    # in chunks); 0 means the extent.
    divisor: int = 0

    def splits(self, parts: int) -> bool:
        """Whether the dim can be cut into `parts` equal chunks."""
        return self.valid and (self.divisor or self.extent) % parts == 0

    @property
    def valid(self) -> bool:
        return self.reason is None

    @property
    def contiguous(self) -> bool:
        """Cut only into contiguous chunks (halo windows, global indices)."""
        return self.global_index or any(c is not None and c.halo for c in self.inputs)

    @property
    def reduction(self) -> bool:
        """The dim is summed (or max-ed) away: some output is a partial result."""
        return any(isinstance(o, str) for o in self.outputs)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "extent": self.extent,
            "inputs": [None if c is None else dataclasses.asdict(c) for c in self.inputs],
            "outputs": list(self.outputs),
            "inner": [dataclasses.asdict(r) for r in self.inner],
            "global_index": self.global_index,
            "reason": self.reason,
            "divisor": self.divisor,
        }

    @classmethod
    def from_dict(cls, data: dict) -> DimSpec:
        return cls(
            data["name"],
            int(data["extent"]),
            [None if c is None else AxisCut(**c) for c in data["inputs"]],
            list(data["outputs"]),
            [InnerReduce(r["buffer"], r["combiner"], r["nbytes"], tuple(r["dims"]))
             for r in data["inner"]],
            bool(data.get("global_index", False)),
            data.get("reason"),
            int(data.get("divisor", 0)),
        )


@dataclasses.dataclass
class KernelSpec:
    """The dims of one kernel (shared by every call of it) and what could not be analysed."""

    kernel: str
    num_inputs: int
    num_outputs: int
    dims: list[DimSpec]
    notes: list[str] = dataclasses.field(default_factory=list)  # unsupported constructs
    unused_inputs: list[int] = dataclasses.field(default_factory=list)  # never read

    @property
    def opaque(self) -> bool:
        """Nothing can be split: the operator runs replicated."""
        return not any(d.valid for d in self.dims)

    def valid_dims(self) -> list[int]:
        return [i for i, d in enumerate(self.dims) if d.valid]

    def to_dict(self) -> dict:
        return {
            "kernel": self.kernel,
            "num_inputs": self.num_inputs,
            "num_outputs": self.num_outputs,
            "dims": [d.to_dict() for d in self.dims],
            "notes": list(self.notes),
            "unused_inputs": list(self.unused_inputs),
        }

    @classmethod
    def from_dict(cls, data: dict) -> KernelSpec:
        return cls(data["kernel"], data["num_inputs"], data["num_outputs"],
                   [DimSpec.from_dict(d) for d in data["dims"]], list(data["notes"]),
                   list(data.get("unused_inputs", [])))


def replicated_spec(kernel: str, num_inputs: int, num_outputs: int, why: str) -> KernelSpec:
    """A kernel nothing is known about: it can only run replicated."""
    return KernelSpec(kernel, num_inputs, num_outputs, [], [why])
