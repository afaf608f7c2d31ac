"""The runtime-only Python tree of a GPU bundle (BUNDLE/site): TVM's Python package without its
compiler library, third-party headers and compiler-only packages; tvm-ffi (with its extension
built for each Python version asked for); typing_extensions; and the part of tvm_ext that runs
exported modules, with its runtime library, the no-device CUDA stub and the NCCL backend.

`import tvm` there falls back to TVM's runtime-only mode by itself (no libtvm_compiler.so), and
`import tvm_ext` then loads only its runtime side.
"""

from __future__ import annotations

import ast
import glob
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Callable, Iterable

import tvm
import tvm_ffi

from ..errors import UnavailableError
from ..runtime.library import library_path

# Left out of TVM's package: the compiler, its headers and sources, and packages only the
# compiler imports (TVM itself skips them in runtime-only mode).
TVM_LEFT_OUT = ("3rdparty", "include", "src", "web", "relax", "s_tir", "topi", "testing",
                "cmake", "lib64", "lib/libtvm_compiler.so")
FFI_LEFT_OUT = ("3rdparty", "include", "src", "share", "cython", "stub", "CMakeLists.txt")
# The tvm_ext modules the checks start from; everything they import (in any statement) comes.
RUNTIME_ROOTS = ("tvm_ext._layout", "tvm_ext.runtime", "tvm_ext.runtime.gpu_checks")
NCCL_LIBRARY = "libtvm_ext_nccl.so"
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tvm_ext/
Log = Callable[[str], None]


class BundleBuildError(UnavailableError):
    """A part of the bundle cannot be made on this machine."""


def _copy_tree(src: str, dst: str, left_out: Iterable[str]) -> None:
    left_out = {os.path.normpath(p) for p in left_out}

    def ignore(folder: str, names: list[str]) -> set[str]:
        rel = os.path.relpath(folder, src)
        return {n for n in names if n == "__pycache__" or n.endswith(".pyc")
                or os.path.normpath(os.path.join(rel, n)) in left_out}

    shutil.copytree(src, dst, ignore=ignore)


def copy_tvm(site: str) -> None:
    _copy_tree(os.path.dirname(tvm.__file__), os.path.join(site, "tvm"), TVM_LEFT_OUT)


def copy_tvm_ffi(site: str, python_versions: Iterable[str], cache: str, log: Log) -> None:
    """tvm-ffi, with its extension (`core.cpython-3XY-...so`) for each Python version: the
    local one from this install, others from the same release's wheel (pip download, kept in
    `cache`), whose C++ library must be the one copied."""
    src = os.path.dirname(tvm_ffi.__file__)
    dst = os.path.join(site, "tvm_ffi")
    _copy_tree(src, dst, FFI_LEFT_OUT)
    local = f"{sys.version_info.major}.{sys.version_info.minor}"
    ours = _digest(os.path.join(src, "lib", "libtvm_ffi.so"))
    for version in sorted(set(python_versions) - {local}):
        wheel = _ffi_wheel(version, cache, log)
        with zipfile.ZipFile(wheel) as z:
            cores = [n for n in z.namelist() if n.startswith("tvm_ffi/core.cpython-")]
            if not cores or hashlib.sha256(z.read("tvm_ffi/lib/libtvm_ffi.so")).hexdigest() \
                    != ours:
                raise BundleBuildError(f"{os.path.basename(wheel)} is not the tvm-ffi "
                                       "installed here: cannot add its Python extension")
            with open(os.path.join(dst, os.path.basename(cores[0])), "wb") as f:
                f.write(z.read(cores[0]))


def _ffi_wheel(version: str, cache: str, log: Log) -> str:
    release = tvm_ffi.__version__
    tag = "cp" + version.replace(".", "")
    pattern = os.path.join(cache, f"apache_tvm_ffi-{release}-{tag}-*.whl")
    if not glob.glob(pattern):
        log(f"  fetching tvm-ffi {release} for Python {version} (pip download)")
        os.makedirs(cache, exist_ok=True)
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--only-binary=:all:", "--python-version", version, "--platform",
             "manylinux_2_28_x86_64", f"apache-tvm-ffi=={release}", "-d", cache],
            capture_output=True, text=True, timeout=300)
        if done.returncode != 0 or not glob.glob(pattern):
            tail = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise BundleBuildError(f"cannot fetch tvm-ffi {release} for Python {version} "
                                   f"({tail}); leave that version out (--python)")
    return sorted(glob.glob(pattern))[0]


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def copy_typing_extensions(site: str) -> None:
    spec = importlib.util.find_spec("typing_extensions")  # tvm-ffi imports it
    shutil.copy2(spec.origin, os.path.join(site, "typing_extensions.py"))


def runtime_modules(roots: Iterable[str] = RUNTIME_ROOTS) -> list[str]:
    """The tvm_ext modules the roots import, directly or not (any import statement, inside
    functions too), with every package on their paths."""
    package_dir = PACKAGE_DIR
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = _module_path(package_dir, name)
        if path is None:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(2, len(parts))]  # packages on the way
        todo += [m for m in _imports(name, path) if m.startswith("tvm_ext.")]
    return sorted(seen)


def _module_path(package_dir: str, name: str) -> str | None:
    rel = os.path.join(*name.split(".")[1:]) if "." in name else ""
    for candidate in (os.path.join(package_dir, rel, "__init__.py"),
                      os.path.join(package_dir, rel + ".py")):
        if os.path.isfile(candidate):
            return candidate
    return None


def _imports(name: str, path: str) -> set[str]:
    is_package = path.endswith("__init__.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([module] if module else []))
            out.add(module)
            out |= {f"{module}.{a.name}" for a in node.names}
    return out


def copy_tvm_ext(site: str, nccl_library: str | None) -> list[str]:
    """tvm_ext's runtime modules and libraries (the package's own __init__ loads only the
    runtime side where TVM has no compiler). Returns the modules copied."""
    package_dir = PACKAGE_DIR
    dst = os.path.join(site, "tvm_ext")
    modules = runtime_modules()
    for name in ["tvm_ext", *modules]:
        src = _module_path(package_dir, name)
        target = os.path.join(dst, os.path.relpath(src, package_dir))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(src, target)
    template = os.path.join(package_dir, "runtime", "gpu_checks", "run_gpu_checks.py")
    if not os.path.isfile(template):
        raise BundleBuildError(f"the entry script template {template} is missing")
    lib_dir = os.path.join(dst, "lib")
    os.makedirs(os.path.join(lib_dir, "cuda_stub"), exist_ok=True)
    runtime_lib = library_path()
    shutil.copy2(runtime_lib, os.path.join(lib_dir, os.path.basename(runtime_lib)))
    stub = os.path.join(os.path.dirname(runtime_lib), "cuda_stub", "libcuda.so.1")
    if os.path.isfile(stub):
        shutil.copy2(stub, os.path.join(lib_dir, "cuda_stub", "libcuda.so.1"))
    if nccl_library:
        shutil.copy2(nccl_library, os.path.join(lib_dir, NCCL_LIBRARY))
    return modules


def build_nccl_backend(cache: str, log: Log) -> tuple[str | None, str]:
    """The NCCL Disco backend (src/ccl/nccl) built from this checkout with the runtime paths of
    an installed tree (so it finds TVM beside it in the bundle): (its path, how it was built) or
    (None, why not)."""
    for found in _installed_nccl_backends():
        return found, f"the installed {found}"
    source = os.path.dirname(PACKAGE_DIR)
    if not os.path.isfile(os.path.join(source, "CMakeLists.txt")):
        return None, "tvm_ext is not installed from a source checkout (no CMakeLists.txt)"
    if shutil.which("cmake") is None or shutil.which("nvcc") is None:
        return None, "no cmake or no CUDA toolkit (nvcc) here"
    home = nccl_home()
    if home is None:
        return None, "no nccl.h here (pip install nvidia-nccl-cu12, or set NCCL_HOME)"
    build = os.path.join(cache, "nccl-build")
    env = {**os.environ, "NCCL_HOME": home}
    steps = [["cmake", "-S", source, "-B", build, f"-DPython3_EXECUTABLE={sys.executable}",
              "-DTVM_EXT_NCCL=ON", "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON"],
             ["cmake", "--build", build, "--target", "tvm_ext_nccl"]]
    log(f"  building the NCCL backend against {home}")
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, env=env, timeout=900)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
            return None, f"its build failed: {' / '.join(tail)}"
    return os.path.join(build, NCCL_LIBRARY), f"built against {home}"


def _installed_nccl_backends() -> list[str]:
    path = os.path.join(os.path.dirname(library_path()), NCCL_LIBRARY)
    return [path] if os.path.isfile(path) else []


def nccl_home() -> str | None:
    """Where nccl.h is: $NCCL_HOME, a CUDA 13 NCCL (the GPU machines'), else the
    nvidia-nccl-cu12 wheel that xgboost installs."""
    homes = [os.environ.get("NCCL_HOME", "")]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations if spec else []):
        homes += [os.path.join(root, "cu13"), os.path.join(root, "nccl")]
    homes += ["/usr/local/cuda", "/usr"]
    for home in homes:
        if home and os.path.isfile(os.path.join(home, "include", "nccl.h")):
            return home
    return None


def cache_dir() -> str:
    """Where downloads and the NCCL build are kept between bundle builds."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-{sysconfig.get_platform()}"
    return os.path.join(root, "tvm_ext", "gpu_bundle", tag)
