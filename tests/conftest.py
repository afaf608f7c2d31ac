"""Shared fixtures: the llvm and CUDA targets and a cache of compiled tiny zoo models."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import tvm

import tvm_ext  # noqa: F401  (loads the runtime library before any VM exists)

sys.path.insert(0, os.path.dirname(__file__))  # tests/reference.py


@pytest.fixture(scope="session")
def llvm() -> tvm.target.Target:
    return tvm.target.Target("llvm")


@pytest.fixture
def cuda_target() -> tvm.target.Target:
    """The CUDA target to compile for (nothing runs); skips without nvcc or CUDA support."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH: CUDA code cannot be compiled here")
    from tvm_ext import driver
    from tvm_ext.runtime.cuda import CudaUnavailableError

    try:
        return driver.resolve_target("cuda")
    except CudaUnavailableError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="session")
def zoo_cache():
    """(name, training) -> Model, built once per session."""
    from tvm_ext.models import get_model

    cache: dict = {}

    def get(name: str, training: bool = False):
        key = (name, training)
        if key not in cache:
            cache[key] = get_model(name, "tiny", training=training)
        return cache[key]

    return get
