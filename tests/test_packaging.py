"""The asked-for layout: `passes/` and `schedules/` import as tvm_ext subpackages whether the
package comes from an installed wheel or from this checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_subpackages_import():
    import tvm_ext.passes
    import tvm_ext.schedules

    assert os.path.basename(os.path.dirname(tvm_ext.passes.__file__)) == "passes"
    assert os.path.basename(os.path.dirname(tvm_ext.schedules.__file__)) == "schedules"


def test_imports_from_the_repository_root():
    """Run from the checkout root, the local tvm_ext/ shadows an installed one; its siblings
    passes/ and schedules/ must still resolve, and the runtime library must still load."""
    code = ("import tvm_ext, tvm_ext.passes, tvm_ext.schedules;"
            "print(tvm_ext.passes.__file__); print(tvm_ext.runtime.load_library())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].endswith("libtvm_ext_runtime.so")


def test_the_installed_package_carries_its_nccl_backend():
    """Where the CUDA toolkit is, installing builds the NCCL Disco backend (its nccl.h and
    libnccl come with the build requirements), so a GPU bundle made from any install has it."""
    if shutil.which("nvcc") is None or not sys.platform.startswith("linux"):
        pytest.skip("no CUDA toolkit here: the NCCL backend is not built")
    from tvm_ext.runtime.library import library_path

    lib_dir = os.path.dirname(library_path())
    assert os.path.isfile(os.path.join(lib_dir, "libtvm_ext_nccl.so")), os.listdir(lib_dir)
