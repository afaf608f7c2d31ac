"""Random arrays drawn from plain specs: the arguments a module runs on, drawn by the same code
where it was compiled (`tvm_ext.models.TensorSpec.sample`) and where it is deployed (the GPU
bundle draws a large model's arguments on the GPU machine instead of carrying them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

INITS = ("normal", "uniform", "ones", "zeros", "full", "randint")


def sample(rng: np.random.Generator, shape: Sequence[int], dtype: str, init: str = "normal",
           scale: float = 1.0, high: int = 0) -> np.ndarray:
    """One array: "normal" (std `scale`), "uniform" ([-scale, scale]), "ones", "zeros", "full"
    (every element `scale`), or "randint" (integers in [0, high))."""
    shape = tuple(int(s) for s in shape)
    if init == "randint":
        return rng.integers(0, high, size=shape).astype(dtype)
    if init == "ones":
        return np.ones(shape, dtype)
    if init == "zeros":
        return np.zeros(shape, dtype)
    if init == "full":
        return np.full(shape, scale, dtype)
    if init == "uniform":
        return rng.uniform(-scale, scale, size=shape).astype(dtype)
    if init == "normal":
        return (rng.standard_normal(size=shape) * scale).astype(dtype)
    raise ValueError(f"unknown init {init!r}; one of {INITS}")


def sample_all(specs: Sequence[Mapping], seed: int = 0) -> list[np.ndarray]:
    """One array per spec (a mapping with `shape`, `dtype` and optionally `init`, `scale`,
    `high`, as `dataclasses.asdict` of a TensorSpec gives), from one generator."""
    rng = np.random.default_rng(seed)
    return [sample(rng, s["shape"], s["dtype"], s.get("init", "normal"), s.get("scale", 1.0),
                   s.get("high", 0)) for s in specs]
