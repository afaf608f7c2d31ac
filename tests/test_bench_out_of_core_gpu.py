"""benchmarks/out_of_core_gpu.py end to end on the CPU stand-in at its quick size (a two-layer
decoder of the Llama structure): modules prepared for llvm, unswapped and at 1/4 of the peak,
run as the GPU machine runs them (each row a child process), beside PyTorch eager and
PyTorch with checkpointing; the swapped losses equal the unswapped build's and its first
loss PyTorch's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "out_of_core_gpu.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

pytest.importorskip("torch")
pytest.importorskip("transformers")

import out_of_core_gpu  # noqa: E402


def _script(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ooc_gpu")
    modules, results = folder / "modules", folder / "results.json"
    _script("prepare", str(modules), "--size", "quick", "--dtypes", "fp32", "--ratios", "4",
            "--target", "llvm", "--hardware", "cpu", "--time-budget", "1")
    rows = "tvm:ideal,tvm:4,torch:eager,torch:ckpt:4,tvm:twin"
    _script("run", str(modules), "--json", str(results), "--dtypes", "fp32",
            "--rows", rows, "--device", "cpu", "--steps", "3", "--timeout", "300")
    # Here, after the run: the plan again, with the kernel times the twin row measured.
    proc = _script("simulate", str(modules), "--json", str(results), "--dtypes", "fp32")
    manifest = json.loads((modules / "manifest.json").read_text())
    return manifest, json.loads(results.read_text()), proc.stdout, modules


def test_modules_are_prepared_with_their_plans(measured):
    manifest, _, _, modules = measured
    entry = manifest["entries"]["fp32"]
    assert set(entry["modules"]) == {"ideal", "twin", "4"}
    quarter = entry["modules"]["4"]
    assert quarter["budget_bytes"] <= quarter["no_swap_peak_bytes"] // 4
    assert quarter["planned_peak_bytes"] <= quarter["budget_bytes"]
    keys = out_of_core_gpu.row_keys(entry)
    assert keys[:3] == ["link", "tvm:ideal", "torch:eager"] and keys[-1] == "tvm:twin"
    assert (modules / "llama_fp32_4.so.plan.json.gz").exists()


def test_the_plan_is_simulated_with_the_kernels_timed_in_place(measured):
    """`simulate`: the swapped module's plan run again in the simulator with the twin's kernel
    times (the twin runs the same kernels: all but a few of the plan's kernel ops are timed;
    the others, reshapes and broadcasts the unswapped build runs as views or within other
    kernels, keep the roofline's), beside the step time measured."""
    _, results, out, _ = measured
    rows = results["rows"]
    twin, swapped = rows["fp32/tvm:twin"], rows["fp32/tvm:4"]
    assert twin["kernel_s"] and all(s >= 0 for s in twin["kernel_s"].values())
    assert twin["profile"]["kernel_calls"] > 0
    timed, total = (int(x) for x in swapped["simulated_kernels_timed"].split(" of "))
    assert total > 0 and timed >= 0.95 * total
    assert swapped["simulated_link"] == "preset"  # no link row on the CPU
    assert swapped["simulated_s"] > 0
    check = out_of_core_gpu.checks(results)["fp32/tvm:4"]
    assert check["measured_over_simulated"] == pytest.approx(
        swapped["step_s"] / swapped["simulated_s"])
    assert "fp32/tvm:4: simulated" in out


def test_swapped_losses_equal_the_unswapped_builds_and_torchs(measured):
    _, results, out, _ = measured
    rows = results["rows"]
    ideal, swapped = rows["fp32/tvm:ideal"], rows["fp32/tvm:4"]
    assert len(ideal["losses"]) == len(swapped["losses"]) == 3
    assert len(set(ideal["losses"])) == 3  # three batches, three losses
    checks = out_of_core_gpu.checks(results)
    assert checks["fp32/tvm:4"]["losses_ok"], (swapped["losses"], ideal["losses"])
    assert checks["fp32/tvm:ideal"]["losses_ok"], (ideal["losses"], rows["fp32/torch:eager"])
    # Checkpointing recomputes the same forward: torch's losses agree with eager's.
    eager, ckpt = rows["fp32/torch:eager"]["losses"], rows["fp32/torch:ckpt:4"]["losses"]
    assert ckpt == pytest.approx(eager, rel=1e-5)
    assert all(r["step_s"] > 0 for r in (ideal, swapped))
    # Nothing bounds torch's memory on the CPU: no baseline counts as fitting the budget.
    assert not rows["fp32/torch:ckpt:4"]["budget_enforced"]
    assert checks["fp32/tvm:4"]["vs_best_torch"] is None
    assert "| fp32 | tvm:4 |" in out


def test_fsdp_offload_and_the_link_need_a_gpu(measured):
    import out_of_core_gpu_steps as steps

    manifest, *_ = measured
    entry = manifest["entries"]["fp32"]
    with pytest.raises(SystemExit, match="CUDA"):
        steps.torch_row(entry, "fsdp", 1 << 20, "cpu", 2, 0, {}, lambda row: None)
    with pytest.raises(SystemExit, match="CUDA"):
        steps.link_row("cpu", {}, lambda row: None)
    with pytest.raises(SystemExit, match="unknown way"):
        steps.torch_row(entry, "offload", None, "cpu", 2, 0, {}, lambda row: None)


def test_unknown_rows_are_refused(measured, tmp_path):
    manifest, _, _, modules = measured
    assert "torch:fsdp_ckpt:4" in out_of_core_gpu.row_keys(manifest["entries"]["fp32"])
    with pytest.raises(SystemExit, match="no rows torch:fsdp:3"):
        out_of_core_gpu.main(["run", str(modules), "--dtypes", "fp32", "--json",
                              str(tmp_path / "j.json"), "--rows", "torch:fsdp:3"])
    assert not (tmp_path / "j.json").exists()
