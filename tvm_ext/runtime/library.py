"""Finding and loading the tvm_ext runtime library (built from `src/` by CMakeLists.txt)."""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import sysconfig

import tvm_ffi

from ..errors import UnavailableError
from .vendor_libraries import configure as point_at_vendor_libraries

LIBRARY_NAME = "libtvm_ext_runtime.so"
_ENV_LIBRARY = "TVM_EXT_RUNTIME_LIB"
_loaded: str | None = None


class RuntimeLibraryError(UnavailableError):
    """The runtime library could not be found or loaded."""


def _candidate_paths() -> list[str]:
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    roots = [package]
    # A checkout shadowing an installed wheel: the library lives in site-packages.
    for key in ("platlib", "purelib"):
        roots.append(os.path.join(sysconfig.get_paths()[key], "tvm_ext"))
    roots += [os.path.join(p, "tvm_ext") for p in sys.path if p]
    paths = [os.path.join(r, "lib", LIBRARY_NAME) for r in roots]
    # A plain CMake build in the checkout (cmake -B build).
    repo = os.path.dirname(package)
    paths += sorted(glob.glob(os.path.join(repo, "build", "**", LIBRARY_NAME), recursive=True))
    return paths


def library_path() -> str:
    """Path of the runtime library: $TVM_EXT_RUNTIME_LIB, the installed package, or a build."""
    env = os.environ.get(_ENV_LIBRARY)
    if env:
        if not os.path.isfile(env):
            raise RuntimeLibraryError(f"{_ENV_LIBRARY}={env} does not exist")
        return env
    for path in _candidate_paths():
        if os.path.isfile(path):
            return path
    raise RuntimeLibraryError(
        f"{LIBRARY_NAME} not found. Install tvm_ext with `pip install .` (it builds the library), "
        f"or build it with `cmake -B build && cmake --build build` and set {_ENV_LIBRARY}."
    )


def load_library() -> str:
    """Load the runtime library once (global symbols, so exported modules resolve them)."""
    global _loaded
    if _loaded is None:
        path = library_path()
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as err:
            raise RuntimeLibraryError(f"cannot load {path}: {err}") from err
        _loaded = path
        point_at_vendor_libraries()  # those of the installed wheels (never raises)
    return _loaded


def get_function(name: str) -> tvm_ffi.Function:
    """A global function registered by the runtime library."""
    load_library()
    func = tvm_ffi.get_global_func(name, allow_missing=True)
    if func is None:
        raise RuntimeLibraryError(f"{name} is not registered by {_loaded}: rebuild the library")
    return func
