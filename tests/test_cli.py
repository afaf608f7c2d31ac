"""scripts/compile.py end to end."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tvm_ext.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "compile.py")


def test_run_check_report(tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["mlp", "--target", "llvm", "--run", "--check", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "check   OK" in out and "measured peak" in out
    data = json.loads(report.read_text())
    assert data["check"]["ok"] and data["run"]["measured_peak_bytes"] > 0
    assert data["graph"]["ops"] > 0 and data["model_summary"]["name"] == "mlp"


def test_training_export_and_overrides(tmp_path, capsys):
    so = tmp_path / "m.so"
    argv = ["resnet", "--training", "--set", "widths=4,8", "--output", str(so), "--run"]
    assert main(argv) == 0
    assert so.stat().st_size > 0 and "training step" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["vgg"], "unknown model"),
    (["mlp", "--set", "layers"], "FIELD=VALUE"),
    (["mlp", "--size", "huge"], "unknown size"),
    (["missing.onnx"], "does not exist"),
])
def test_bad_input_exits_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cuda_export_holds_device_code(tmp_path):
    """--target cuda on a machine without a GPU compiles with nvcc and exports a module whose
    CUDA part is a cubin (an ELF image with .nv.info sections, embedded in the library), and
    which loads back through TVM's CUDA runtime."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH: CUDA code cannot be compiled here")
    so = tmp_path / "gpt_cuda.so"
    proc = subprocess.run([sys.executable, SCRIPT, "gpt", "--target", "cuda", "--output",
                           str(so)], capture_output=True, text=True, timeout=600)
    if proc.returncode == 2 and "CUDA runtime does not load" in proc.stderr:
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stderr
    # Its kernels are replayed as CUDA graphs: a few launches a call, not one per kernel.
    launch = re.search(r"launch  (\d+) of (\d+) kernel calls in 1 CUDA graph: (\d+) launches",
                       proc.stdout)
    assert launch, proc.stdout
    captured, kernels, launches = map(int, launch.groups())
    assert captured > 30 and launches == 1 + kernels - captured
    check = f"""
import tvm, tvm_ext
from tvm_ext.runtime.cuda import ensure_cuda_runtime
ensure_cuda_runtime()
lib = tvm.runtime.load_module({str(so)!r})
assert [m.kind for m in lib.imports[0].imports] == ["cuda"]
"""
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = so.read_bytes()
    assert data.count(b"\x7fELF") >= 2 and b".nv.info" in data


def test_exported_module_runs_with_runtime_only(tmp_path):
    """A module exported by tvm_ext runs where only TVM's runtime library (no compiler) and the
    tvm_ext runtime library are loaded."""
    from tvm_ext import runtime
    from tvm_ext.runtime import blas

    so = tmp_path / "mlp.so"
    assert main(["mlp", "--output", str(so)]) == 0
    code = f"""
import ctypes, numpy as np, tvm, tvm_ffi
ctypes.CDLL({runtime.load_library()!r}, ctypes.RTLD_GLOBAL)
assert tvm_ffi.get_global_func("relax.build", allow_missing=True) is None  # no compiler here
from tvm.runtime import vm
machine = vm.VirtualMachine(tvm.runtime.load_module({str(so)!r}), tvm.cpu())
shapes = [(4, 16), (32, 16), (32,), (8, 32), (8,)]
out = machine["main"](*[tvm.runtime.tensor(np.ones(s, "float32")) for s in shapes])
print(out.numpy().shape)
"""
    # The GEMMs call the BLAS the runtime library loads: where it is on the machine deployed to.
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1", TVM_EXT_BLAS_LIB=blas.cpu_blas_path())
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "(4, 8)"


def test_device_memory_run_check(tmp_path, capsys):
    report, plot = tmp_path / "r.json", tmp_path / "plan.png"
    argv = ["gpt", "--training", "--set", "layers=4", "--device-memory", "25%", "--run",
            "--check", "--report", str(report), "--plot", str(plot), "--swap-time-budget", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "check   OK" in out and "planned peak" in out and "without swapping" in out
    data = json.loads(report.read_text())
    assert data["run"]["measured_peak_bytes"] <= data["run"]["budget_bytes"]
    assert data["swap"]["budget"] == data["run"]["budget_bytes"]
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_emulated_link_run_is_reported(tmp_path, capsys):
    """--link-gbps: the plan is made for the link, the swapped run's copies are paced to it (the
    report says so), outputs stay exact, and the sidecar names the environment to set."""
    from tvm_ext.runtime import swap_streams

    report, module = tmp_path / "r.json", tmp_path / "m.so"
    argv = ["mlp", "--training", "--device-memory", "min", "--planner", "lru", "--link-gbps",
            "0.05", "--link-latency-us", "300", "--run", "--check", "--repeat", "1",
            "--report", str(report), "--output", str(module)]
    cpus = sorted(os.sched_getaffinity(0))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "link    emulated 0.05 GB/s, 300 us per copy (--link-gbps)" in out
    assert "copies were paced to an emulated link: 0.05 GB/s, 300 us per copy" in out
    assert "check   OK" in out
    data = json.loads(report.read_text())
    process = swap_streams.process_cpus()
    copy_cpu = max(process) if len(process) > 1 else None  # the copy workers' own CPU
    assert data["run"]["emulated_link"] == {"gbps": pytest.approx(0.05),
                                            "latency_us": pytest.approx(300),
                                            "source": "--link-gbps", "copy_cpu": copy_cpu}
    assert data["swap"]["emulated_link"]["link_gbps"] == pytest.approx(0.05)
    side = json.loads((tmp_path / "m.so.swap.json").read_text())
    assert side["emulated_link"]["environment"] == {"TVM_EXT_LINK_GBPS": "0.05",
                                                    "TVM_EXT_LINK_LATENCY_US": "300"}
    assert swap_streams.emulated_link() is None, "the link is off again after the run"
    assert swap_streams.copy_worker_cpus() == (), "and the copy workers unpinned"
    assert sorted(os.sched_getaffinity(0)) == cpus, "and this thread's CPUs restored"


def test_device_memory_too_small_fails_before_compiling(capsys):
    assert main(["gpt", "--training", "--device-memory", "1KiB"]) == 2
    captured = capsys.readouterr()
    assert "smallest feasible budget" in captured.err and "compile" not in captured.out


def test_device_memory_size_errors(capsys):
    assert main(["mlp", "--device-memory", "lots"]) == 2
    assert "cannot read 'lots' as a size" in capsys.readouterr().err


# In the sweep: test_schedules_default_gpu compiles swapped steps for CUDA, test_cli exports
# CUDA modules and test_cli_partitioned partitioned ones.
@pytest.mark.sweep
def test_cuda_swapped_export(tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH: CUDA code cannot be compiled here")
    so = tmp_path / "gpt.so"
    proc = subprocess.run([sys.executable, SCRIPT, "gpt", "--training", "--target", "cuda",
                           "--device-memory", "25%", "--swap-time-budget", "1", "--output",
                           str(so)], capture_output=True, text=True, timeout=600)
    if proc.returncode == 2 and "CUDA runtime does not load" in proc.stderr:
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stderr
    data = so.read_bytes()
    assert b".nv.info" in data and b"tvm_ext.swap.copy_async" in data
    side = json.loads((tmp_path / "gpt.so.swap.json").read_text())
    assert set(side["argument_devices"]) <= {0, 1} and side["plan"]["budget"] > 0


# --------------------------------------------------------------------------------------------
# --check against PyTorch eager for .pt2 models
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pt2_file(tmp_path_factory):
    """An exported program whose parameters are not in submodule order (a top-level
    parameter registered first), with two outputs."""
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.linspace(0.5, 2.0, 4))
            self.fc1 = torch.nn.Linear(8, 16)
            self.fc2 = torch.nn.Linear(16, 4)

        def forward(self, x):
            h = torch.nn.functional.gelu(self.fc1(x))
            return self.fc2(h) * self.scale, h.mean(dim=0)

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("pt2") / "net.pt2"
    torch.export.save(torch.export.export(Net(), (torch.randn(3, 8),)), str(path))
    return path


def test_pt2_check_against_torch(pt2_file, tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main([str(pt2_file), "--check", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "2 outputs match the plain TVM build" in out and "rtol 1e-05, atol 1e-05" in out
    assert "2 outputs match PyTorch eager (net.pt2)" in out
    assert "float32 rtol 0.0001, atol 1e-05" in out
    data = json.loads(report.read_text())
    assert data["check"]["ok"] and data["check"]["torch"]["ok"]
    assert data["check"]["torch"]["tolerances"] == {"float32": [1e-4, 1e-5]}


def test_pt2_training_check_against_torch(pt2_file, capsys):
    assert main([str(pt2_file), "--training", "--check"]) == 0
    assert "6 outputs match PyTorch eager (net.pt2)" in capsys.readouterr().out


def test_pt2_check_fails_on_torch_mismatch(pt2_file, monkeypatch, capsys):
    from tvm_ext.models import reference

    real = reference.torch_reference

    def off(*args, **kwargs):
        outputs = real(*args, **kwargs)
        outputs[1] = outputs[1] + 1e-3
        return outputs

    monkeypatch.setattr(reference, "torch_reference", off)
    assert main([str(pt2_file), "--check"]) == 1
    captured = capsys.readouterr()
    assert "match the plain TVM build" in captured.out
    assert "FAILED against PyTorch eager (net.pt2) (float32 rtol 0.0001, atol 1e-05): " \
           "output 1 differs" in captured.err


@pytest.fixture
def plain_build_off(monkeypatch):
    """The plain TVM reference build's first output scaled by 1 + `off[0]` (a less accurate
    reference: TVM's serial float32 sums)."""
    from tvm_ext.cli import check

    references, off = set(), [1e-2]
    real_build, real_run = check.driver.build_reference, check.driver.run

    def build(*args, **kwargs):
        executable = real_build(*args, **kwargs)
        references.add(id(executable))
        return executable

    def run(executable, *args, **kwargs):
        result = real_run(executable, *args, **kwargs)
        if id(executable) in references:
            result.outputs[0] = result.outputs[0] * (1 + off[0])
        return result

    monkeypatch.setattr(check.driver, "build_reference", build)
    monkeypatch.setattr(check.driver, "run", run)
    return off


def test_pt2_plain_build_farther_from_torch_is_no_verdict(pt2_file, tmp_path, capsys,
                                                          plain_build_off):
    report = tmp_path / "r.json"
    assert main([str(pt2_file), "--check", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "farther from PyTorch than this build" in out and "PyTorch decides" in out
    data = json.loads(report.read_text())
    assert data["check"]["ok"] and data["check"]["torch"]["ok"]
    assert data["check"]["arbitrated"]["plain_vs_torch"] > data["check"]["arbitrated"][
        "ours_vs_torch"]


def test_pt2_plain_build_within_torch_tolerance_is_judged_by_pytorch_float64(
        pt2_file, capsys, plain_build_off, monkeypatch):
    """Both builds within PyTorch's tolerance but apart beyond the plain check's: PyTorch in
    float64 decides whether this build is as close to it as PyTorch's float32 is."""
    from tvm_ext.cli import check

    plain_build_off[0] = 5e-5  # beyond the plain check's rtol 1e-5, within PyTorch's 1e-4
    assert main([str(pt2_file), "--check"]) == 0
    assert "as close to PyTorch float64 as PyTorch's own float32 is" in \
        capsys.readouterr().out
    monkeypatch.setattr(check, "NOISE_FACTOR", 0.0)  # no build is that close: it decides
    assert main([str(pt2_file), "--check"]) == 1
    assert "FAILED against the plain TVM build" in capsys.readouterr().err


def test_pt2_with_random_ops_is_not_compared_with_torch(tmp_path, capsys):
    torch = pytest.importorskip("torch")

    class Noisy(torch.nn.Module):
        def forward(self, x):
            return x + torch.randn_like(x)

    path = tmp_path / "noise.pt2"
    torch.export.save(torch.export.export(Noisy(), (torch.randn(2, 8),)), str(path))
    assert main([str(path), "--check"]) == 0
    out = capsys.readouterr().out
    assert "match the plain TVM build" in out
    assert "not compared with PyTorch eager (noise.pt2): PyTorch draws random numbers in " \
           "randn_like" in out


def test_a_train_mode_export_trains_with_dropout_as_torch_optim_does(tmp_path, capsys):
    """The README's --training --optimizer --check on a module exported in train mode: its
    dropouts applied, with the masks PyTorch is given too."""
    torch = pytest.importorskip("torch")
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5),
                              torch.nn.Linear(16, 4)).train()
    path = tmp_path / "drop.pt2"
    torch.export.save(torch.export.export(net, (torch.randn(2, 8),)), str(path))
    argv = [str(path), "--training", "--optimizer", "adamw", "--steps", "3", "--run", "--check"]
    assert main(argv) == 0
    assert "check   OK: 3 steps match torch.optim" in capsys.readouterr().out


def test_torch_reference_matches_parameters_by_name(pt2_file):
    """The weights fed to torch are the ones given under each Relax argument name, and a
    parameter attached to the wrong argument is reported by its state-dict key."""
    torch = pytest.importorskip("torch")
    from tvm_ext.models import load_model
    from tvm_ext.models.reference import file_weight_mismatches, torch_reference

    model = load_model(str(pt2_file))
    names = [p.name for p in model.params]
    assert names[0] == "p_scale"
    args = model.random_arguments(0)
    x, params = args[0], args[1:]
    assert file_weight_mismatches(str(pt2_file), params, names) == []
    doubled = [p * 2 for p in params]
    out, _ = torch_reference(str(pt2_file), [x], doubled, names)
    fc2_w, fc2_b, scale = doubled[3], doubled[4], doubled[0]
    h = torch.nn.functional.gelu(torch.from_numpy(x @ doubled[1].T + doubled[2]))
    np.testing.assert_allclose(out, (h.numpy() @ fc2_w.T + fc2_b) * scale, rtol=1e-5,
                               atol=1e-6)
    swapped = [params[0], params[3], params[4], params[1], params[2]]
    bad = file_weight_mismatches(str(pt2_file), swapped, names)
    assert bad == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def test_pt2_training_check_with_an_unused_parameter(tmp_path, capsys):
    """torch gives a parameter the graph never reads no gradient at all: it counts as zero,
    and the compiled step's gradient for it is compared with zeros."""
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 4)
            self.unused = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            return self.fc(x)

    path = tmp_path / "unused.pt2"
    torch.export.save(torch.export.export(Net(), (torch.randn(3, 8),)), str(path))
    report = tmp_path / "r.json"
    assert main([str(path), "--training", "--check", "--report", str(report)]) == 0
    assert "4 outputs match PyTorch eager (unused.pt2)" in capsys.readouterr().out
    assert json.loads(report.read_text())["check"]["torch"]["ok"]


def test_pt2_bfloat16_check_against_torch(tmp_path, capsys):
    """bfloat16 inputs and weights reach torch (which reads no ml_dtypes array) and its
    outputs come back as ml_dtypes bfloat16."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Linear(16, 8).to(torch.bfloat16)
    path = tmp_path / "bf16.pt2"
    x = torch.randn(4, 16).to(torch.bfloat16)
    torch.export.save(torch.export.export(net.eval(), (x,)), str(path))
    assert main([str(path), "--check"]) == 0
    out = capsys.readouterr().out
    assert "1 outputs match PyTorch eager (bf16.pt2)" in out and "bfloat16 rtol 0.05" in out


def _zero_score_picker(torch):
    """topk over scores of a zero weight (as Doge's at its initialisation): every score ties."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.score = torch.nn.Parameter(torch.zeros(16))

        def forward(self, x):
            picked = torch.topk(self.score * x, 4, dim=-1, sorted=False).indices
            return torch.gather(x, -1, picked).sum(-1)
    return Net()


def test_a_check_failed_by_a_selection_among_ties_says_so(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    x = torch.arange(32, dtype=torch.float32).reshape(2, 16)
    path = tmp_path / "ties.pt2"
    torch.export.save(torch.export.export(_zero_score_picker(torch).eval(), (x,)), str(path))
    report = tmp_path / "r.json"
    assert main([str(path), "--check", "--report", str(report)]) == 1
    err = capsys.readouterr().err
    assert "PyTorch chose among tied values in topk (node topk): 2 of 2 rows" in err
    ties = json.loads(report.read_text())["check"]["torch"]["tied_selections"]
    assert ties == {"topk": {"op": "topk", "tied_rows": 2, "rows": 2}}


@pytest.mark.parametrize("op, args, kwargs, expected", [
    ("topk", ([[3.0, 2.0, 2.0, 1.0]], 2), {}, (1, 1)),   # which 2 is the second: a tie
    ("topk", ([[3.0, 2.0, 2.0, 1.0]], 1), {}, (0, 1)),
    ("topk", ([[1.0, 2.0], [2.0, 2.0]], 1, 0, False), {}, (1, 2)),  # smallest along dim 0
    ("argmax", ([[1.0, 5.0, 5.0], [1.0, 2.0, 3.0]], 1), {}, (1, 2)),
    ("argmin", ([[1.0, 0.0], [0.0, 2.0]],), {}, (1, 1)),  # over the flattened tensor
    ("sort", ([[1.0, 2.0, 1.0], [1.0, 2.0, 3.0]],), {}, (1, 2)),
])
def test_tied_rows_reads_the_deciding_values(op, args, kwargs, expected):
    torch = pytest.importorskip("torch")
    from tvm_ext.models import selection_ties

    kind = {"topk": "k", "argmax": "one", "argmin": "one", "sort": "all"}[op]
    args = (torch.tensor(args[0]), *args[1:])
    assert selection_ties.tied_rows(op, kind, args, kwargs) == expected


# --------------------------------------------------------------------------------------------
# Output paths: checked before compiling, replaced atomically, stale sidecars removed
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("option", ["--output", "--report"])
def test_output_path_errors_before_compiling(option, tmp_path, capsys):
    assert main(["mlp", option, str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert f"{option} {tmp_path} is a directory" in captured.err
    assert "compile" not in captured.out and "model" not in captured.out
    assert main(["mlp", option, str(tmp_path / "missing" / "m.so")]) == 2
    assert f"directory {tmp_path / 'missing'} does not exist" in capsys.readouterr().err
    assert main(["mlp", option, "/proc/m.so"]) == 2  # a directory no file can be made in
    captured = capsys.readouterr()
    assert f"{option} /proc/m.so" in captured.err and "compile" not in captured.out


def test_output_path_clashes(tmp_path, capsys):
    path = str(tmp_path / "m.so")
    assert main(["mlp", "--output", path, "--report", path]) == 2
    assert "--report" in capsys.readouterr().err
    (tmp_path / "m.so.swap.json").mkdir()
    argv = ["mlp", "--output", path, "--device-memory", "90%"]
    assert main(argv) == 2
    assert "m.so.swap.json is a directory" in capsys.readouterr().err


def test_failed_export_keeps_the_existing_file(tmp_path, monkeypatch):
    from tvm_ext import driver

    so = tmp_path / "m.so"
    so.write_bytes(b"the module of yesterday")

    def broken(executable, path):
        with open(path, "wb") as f:
            f.write(b"half a module")
        raise OSError("disk full")

    monkeypatch.setattr(driver, "export", broken)
    with pytest.raises(OSError, match="disk full"):
        main(["mlp", "--output", str(so)])
    assert so.read_bytes() == b"the module of yesterday"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.so"]


def test_export_removes_stale_sidecars(tmp_path, capsys):
    so = tmp_path / "m.so"
    for suffix in (".swap.json", ".partition.json"):
        (tmp_path / f"m.so{suffix}").write_text("{}")
    assert main(["mlp", "--output", str(so)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.so"]
    assert "removed" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# Arguments refused before any work
# --------------------------------------------------------------------------------------------

BAD_PY = """
def helper(width):
    raise ValueError(f"width {width} is odd")

def get_model(width=3):
    return helper(width)
"""


@pytest.mark.parametrize("argv, message", [
    (["mlp", "--set", "layers=abc"], "--set layers=abc: layers takes an integer >= 1"),
    (["mlp", "--set", "layers=2.5"], "layers takes an integer >= 1"),
    (["mlp", "--set", "hidden=-4"], "--set hidden=-4: hidden takes an integer >= 1"),
    (["gpt", "--set", "batch=0"], "batch takes an integer >= 1"),
    (["resnet", "--set", "widths=8,x"], "widths takes integers >= 1 separated by commas"),
    (["mlp", "--set", "=4"], "FIELD=VALUE"),
    (["model.onnx", "--set", "layers=2"], "--set applies to zoo models and to .py files"),
    (["{tmp}"], "is a directory"),
    (["{tmp}/bad.py"], "bad.py raised ValueError: width 3 is odd at {tmp}/bad.py:3 in helper"),
    (["mlp", "--tune-db", "{tmp}/bad.py"], "--tune-db {tmp}/bad.py is a file"),
    (["mlp", "--dump-dir", "{tmp}/bad.py"], "--dump-dir {tmp}/bad.py is a file"),
    (["mlp", "--tune-db", "/proc/db/x"], "--tune-db /proc/db/x: cannot create files in /proc"),
    (["mlp", "--dump-dir", "/proc/ir"], "--dump-dir /proc/ir: cannot create files in /proc"),
    (["mlp", "--device-memory", "-5%"], "'-5%': a percentage must be in (0, 100]"),
    (["mlp", "--device-memory", "-.5GB"], "cannot read '-.5GB' as a size"),
])
def test_bad_values_exit_2(argv, message, tmp_path, capsys):
    (tmp_path / "bad.py").write_text(BAD_PY)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message.replace("{tmp}", str(tmp_path)) in captured.err
    assert "compile" not in captured.out


@pytest.mark.parametrize("argv, message", [
    (["mlp", "--plot", "p.png"], "--plot draws the swap plan: it needs --device-memory"),
    (["mlp", "--device-memory", "50%", "--devices", "2", "--plot", "p.png"],
     "--plot draws a single-device swap plan: not with --devices"),
    (["mlp", "--arch", "sm_80"], "--arch applies to --target cuda only, not llvm"),
    (["mlp", "--no-cuda-graph"], "--no-cuda-graph applies to --target cuda only, not llvm"),
    (["mlp", "--target", "cuda", "--no-cuda-graph", "--device-memory", "50%"],
     "--no-cuda-graph does nothing with --device-memory or --devices"),
    (["mlp", "--target", "cuda", "--arch", "sm_1"], "--arch sm_1: expected sm_NN"),
    (["mlp", "--target", "cuda", "--arch", "90"], "--arch 90: expected sm_NN"),
    (["mlp", "--link", "pcie"], "--link applies to a partitioned build: it needs --devices"),
    (["mlp", "--strategy", "megatron"], "--strategy applies to a partitioned build"),
    (["mlp", "--partition-plan", "p.json"], "--partition-plan applies to a partitioned build"),
    (["mlp", "--devices", "2", "--partition-plan", "p.json", "--link", "pcie"],
     "--link does nothing with --partition-plan"),
    (["mlp", "--planner", "lru"], "--planner applies to swap planning: it needs --device-memory"),
    (["mlp", "--swap-time-budget", "2"], "--swap-time-budget applies to swap planning"),
    (["mlp", "--hardware", "h100"], "--hardware is the cost model of swap and partition "
     "planning: it needs --device-memory or --devices"),
    (["mlp", "--device-memory", "50%", "--planner", "vdnn", "--swap-time-budget", "2"],
     "--swap-time-budget bounds the SwapAdvisor search; --planner vdnn does not search"),
    (["mlp", "--rtol", "1e-3"], "--rtol is a tolerance of --check: it needs --check"),
    (["model.pt2", "--size", "small"], "--size picks a zoo model size"),
    (["mlp", "--link-gbps", "2"], "--link-gbps emulates the link of swap copies: it needs "
     "--device-memory"),
    (["mlp", "--device-memory", "50%", "--link-gbps", "fast"],
     "--link-gbps takes a number of GB/s > 0 or 'scaled'"),
    (["mlp", "--device-memory", "50%", "--link-gbps", "0"],
     "--link-gbps takes a number of GB/s > 0"),
    (["mlp", "--device-memory", "50%", "--link-gbps", "scaled", "--link-latency-us", "5"],
     "--link-latency-us is the latency of --link-gbps GBPS"),
    (["mlp", "--device-memory", "50%", "--link-gbps", "2", "--target", "cuda"],
     "--link-gbps paces the CPU stand-in's copies"),
    (["mlp", "--device-memory", "50%", "--link-gbps", "2", "--devices", "2"],
     "--link-gbps emulates the host link of a single-device swapped run: not with --devices"),
    (["mlp", "--device-memory", "50%", "--link-gbps", "2", "--hardware", "h100"],
     "--hardware does nothing with --link-gbps GBPS"),
])
def test_idle_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: compile.py") and f"compile.py: error: {message}" in err


def test_arch_nvcc_rejects(capsys):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    from tvm_ext.cli import arch_problem

    codes = subprocess.run(["nvcc", "--list-gpu-code"], capture_output=True,
                           text=True).stdout.split()
    if "sm_52" in codes:
        pytest.skip("this nvcc compiles for sm_52")
    assert "this nvcc does not compile for it" in arch_problem("sm_52")
    assert arch_problem(codes[-1]) is None


def test_cuda_without_output_or_run_warns(capsys):
    from tvm_ext.cli import build_parser, refuse_idle_options

    parser = build_parser()
    for argv, warned in ((["mlp", "--target", "cuda"], True),
                         (["mlp", "--target", "cuda", "--output", "m.so"], False),
                         (["mlp", "--target", "cuda", "--run"], False)):
        refuse_idle_options(parser, parser.parse_args(argv))
        err = capsys.readouterr().err
        assert ("compiles the module and discards it" in err) == warned


@pytest.mark.parametrize("argv, package", [
    (["mlp", "--training", "--optimizer", "adamw", "--run", "--check"], "torch"),
    (["{tmp}/m.pt2", "--run"], "torch"),
    (["{tmp}/m.onnx", "--run"], "onnx"),
])
def test_a_missing_extra_is_named_in_one_line(argv, package, tmp_path, monkeypatch, capsys):
    """The README's training --check after a plain `pip install .`: one line naming the extra
    to install, before anything compiles."""
    for suffix in (".pt2", ".onnx"):
        (tmp_path / f"m{suffix}").write_bytes(b"")
    monkeypatch.setitem(sys.modules, package, None)
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"needs {package}" in err and "'.[frontends]'" in err


def test_a_budget_above_the_peak_says_nothing_is_swapped(tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["mlp", "--device-memory", "1TB", "--report", str(report)]) == 0
    assert "the model fits as it is, nothing needs to leave the device" in \
        capsys.readouterr().out
    assert "no-swap peak" in json.loads(report.read_text())["swap"]["note"]
