"""The NCCL Disco backend (src/ccl/nccl/ccl_nccl.cc): it builds where CUDA and NCCL are found, it
loads lazily (the runtime library needs neither libcuda nor libnccl), it says how to get it when
it is missing, and on a GPU machine it runs the same code as the cpu backend."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tvm_ext
from tvm_ext.runtime import cuda as cuda_support
from tvm_ext.runtime import distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _nccl_home() -> str | None:
    """Where nccl.h lives: the nvidia-nccl-cu12 package, or $NCCL_HOME."""
    if importlib.util.find_spec("nvidia") is not None:
        spec = importlib.util.find_spec("nvidia.nccl")
        if spec is not None:
            for root in spec.submodule_search_locations:
                if os.path.isfile(os.path.join(root, "include", "nccl.h")):
                    return root
    home = os.environ.get("NCCL_HOME")
    if home and os.path.isfile(os.path.join(home, "include", "nccl.h")):
        return home
    return None


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env}, cwd="/")


def test_runtime_library_does_not_link_cuda_or_nccl():
    if shutil.which("readelf") is None:
        pytest.skip("readelf is not installed")
    needed = subprocess.run(["readelf", "-d", tvm_ext.runtime.library_path()],
                            capture_output=True, text=True, check=True).stdout
    assert "libtvm_runtime_extra" in needed
    assert "libcuda" not in needed and "libnccl" not in needed and "libcudart" not in needed


def test_missing_nccl_backend_says_how_to_get_it():
    result = _python(
        """
        import tvm, tvm_ext
        from tvm_ffi import Shape
        from tvm_ext.runtime import distributed as dist
        assert not dist.nccl_available()
        try:
            dist.Session(1, "nccl")
        except dist.NcclUnavailableError as err:
            print("SESSION:", err)
        sess = dist.disco_module().ThreadedSession(1)
        try:  # TVM's own entry point reaches the same message
            dist.disco_module()._ffi_api.SessionInitCCL(sess, "nccl", Shape([0]))
        except RuntimeError as err:
            print("TVM:", err)
        sess.shutdown()
        """,
        TVM_EXT_NCCL_LIB="/nonexistent/libtvm_ext_nccl.so",
    )
    assert result.returncode == 0, result.stderr
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith(("SESSION:", "TVM:"))]
    assert len(lines) == 2, result.stdout
    for line in lines:
        assert "not part of this tvm_ext build" in line
        assert "nvidia-nccl-cu12" in line and "TVM_EXT_NCCL=ON" in line
        assert '"cpu" backend' in line


@pytest.fixture(scope="module")
def nccl_library(tmp_path_factory) -> str:
    """libtvm_ext_nccl.so built from this checkout with TVM_EXT_NCCL=ON."""
    if shutil.which("nvcc") is None or shutil.which("cmake") is None:
        pytest.skip("no CUDA toolkit (nvcc) or no cmake: the NCCL backend cannot be built here")
    home = _nccl_home()
    if home is None:
        pytest.skip("nccl.h not found (pip install nvidia-nccl-cu12, or set NCCL_HOME)")
    build = tmp_path_factory.mktemp("nccl_build")
    configure = subprocess.run(
        ["cmake", "-S", REPO, "-B", str(build), f"-DPython3_EXECUTABLE={sys.executable}",
         "-DTVM_EXT_NCCL=ON"],
        capture_output=True, text=True, env={**os.environ, "NCCL_HOME": home})
    assert configure.returncode == 0, configure.stdout + configure.stderr
    compiled = subprocess.run(["cmake", "--build", str(build), "--target", "tvm_ext_nccl"],
                              capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    path = os.path.join(build, "libtvm_ext_nccl.so")
    assert os.path.isfile(path)
    return path


def test_nccl_backend_builds_and_loads(nccl_library):
    result = _python(
        """
        import tvm, tvm_ext, tvm_ffi
        from tvm_ext.runtime import cuda as cuda_support
        from tvm_ext.runtime import distributed as dist
        print("LOADED:", dist.load_nccl_backend())
        print("VERSION:", tvm_ffi.get_global_func("tvm_ext.nccl.version")())
        names = set(tvm_ffi.registry.list_global_func_names())
        for op in ("init_ccl", "init_ccl_per_worker", "allreduce", "allgather",
                   "broadcast_from_worker0", "scatter_from_worker0", "gather_to_worker0",
                   "recv_from_worker0", "send_to_worker", "recv_from_worker", "sync_worker"):
            assert "runtime.disco.nccl." + op in names, op
        if not cuda_support.has_gpu():
            try:
                dist.Session(1, "nccl")
            except dist.NcclUnavailableError as err:
                print("NOGPU:", err)
        """,
        TVM_EXT_NCCL_LIB=nccl_library,
    )
    assert result.returncode == 0, result.stderr
    assert f"LOADED: {nccl_library}" in result.stdout
    version = int(result.stdout.split("VERSION:")[1].split()[0])
    assert version >= 21800  # ncclCommSplit needs NCCL 2.18
    if "NOGPU:" in result.stdout:
        assert "no usable GPU" in result.stdout


@pytest.mark.skipif(not cuda_support.has_gpu(), reason="needs a GPU (none on this machine)")
def test_nccl_runs_collectives_and_a_module_on_the_gpus():
    """Everything lent GPUs can run: allreduce and a compiled module with k = number of GPUs."""
    if not dist.nccl_available():
        pytest.skip("tvm_ext was built without the NCCL backend")
    import tvm
    from tvm.script import ir as I
    from tvm.script import relax as R
    from tvm_ffi import Shape

    k = 0
    while tvm.cuda(k).exist:
        k += 1
    src = """
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 6), "float32")):
        y = R.ccl.allreduce(R.matmul(x, w), "sum")
        return y
"""
    mod = tvm.script.from_source(src, extra_vars={"I": I, "R": R})
    target = cuda_support.cuda_target()
    with target:
        mod = tvm.s_tir.dlight.ApplyDefaultSchedule(tvm.s_tir.dlight.gpu.Fallback())(
            tvm.relax.transform.LegalizeOps()(mod))
        executable = tvm.compile(mod, target=target)  # nvcc reads the target in scope
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8 * k)).astype("float32")
    w = rng.standard_normal((8 * k, 6)).astype("float32")
    with dist.Session(k, "nccl") as sess:
        parts = sess.per_worker([np.full(5, i + 1, "float32") for i in range(k)])
        sess.call("runtime.disco.allreduce", parts, Shape([0]), False, parts)
        sess.check()
        for value in sess.worker_values(parts):
            np.testing.assert_array_equal(value, np.full(5, k * (k + 1) / 2, "float32"))
        module = sess.load_module(executable)
        result = dist.run(sess, module, [x, w], [1, 0], [None])
        np.testing.assert_allclose(result.outputs[0], x @ w, rtol=1e-4, atol=1e-4)
