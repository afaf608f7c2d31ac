"""`compile.py MODEL --devices K` end to end: run on K cpu workers, check against the
single-device build, report the plan and the measured per-worker peaks; saved plans; the
composition with --device-memory; a CUDA export for 4 GPUs (compile only: no GPU here)."""

from __future__ import annotations

import json

import pytest

from tvm_ext.cli import main


@pytest.fixture(scope="module")
def gpt_report(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "gpt2.json"
    argv = ["gpt", "--training", "--devices", "2", "--run", "--check", "--repeat", "1",
            "--report", str(path)]
    assert main(argv) == 0
    return path


def test_run_check_report(gpt_report, capsys):
    data = json.loads(gpt_report.read_text())
    assert data["check"]["ok"]
    part = data["partition"]
    assert part["summary"]["num_devices"] == 2 and part["layout"]["mesh"] == [2]
    assert isinstance(part["fallbacks"], list)
    run = data["run"]
    predicted = run["predicted_peak_bytes_per_device"]
    assert len(run["measured_peak_bytes_per_worker"]) == 2
    for measured in run["measured_peak_bytes_per_worker"]:
        assert abs(measured - predicted) <= 0.1 * predicted


@pytest.mark.sweep  # test_partition_plan applies a saved plan (tests/data/partition_plan.json)
def test_saved_plan_is_applied(gpt_report, capsys):
    argv = ["gpt", "--training", "--devices", "2", "--partition-plan", str(gpt_report),
            "--run", "--check", "--repeat", "0"]
    assert main(argv) == 0
    assert "check   OK" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["mlp", "--devices", "0"], "--devices takes a number of devices >= 1"),
    (["gpt", "--training", "--devices", "4", "--partition-plan", "{report}"],
     "partitions over 2 devices, not 4"),
    (["mlp", "--devices", "2", "--partition-plan", "{report}"], "another model"),
    (["mlp", "--devices", "2", "--partition-plan", "/nonexistent.json"], "--partition-plan"),
    (["mlp", "--devices", "2", "--partition-plan", "{tmp}/garbage.json"],
     "garbage.json is not JSON (Expecting value: line 2 column 2"),
    (["mlp", "--devices", "2", "--partition-plan", "{tmp}/other.json"],
     "other.json holds no partition plan: a PartitionPlan record has a field 'weights' a plan "
     "does not have; give a plan"),
    (["mlp", "--devices", "2", "--partition-plan", "{tmp}/list.json"],
     "list.json holds no partition plan: it holds a JSON list"),
    (["gpt", "--devices", "1000"], "--devices 1000: no tensor of this model has a dimension "
     "longer than 128"),
    (["gpt", "--set", "vocab=2000", "--devices", "100", "--run"],
     "--devices 100 with --run/--check runs 100 worker threads"),
])
def test_bad_input_exits_2(argv, message, gpt_report, tmp_path, capsys):
    (tmp_path / "garbage.json").write_text("\n not json")
    (tmp_path / "other.json").write_text('{"num_devices": 2, "weights": [1, 2]}')
    (tmp_path / "list.json").write_text("[1, 2]")
    argv = [a.replace("{report}", str(gpt_report)).replace("{tmp}", str(tmp_path))
            for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message.replace("{tmp}", str(tmp_path)) in err and "__init__" not in err


def test_devices_with_device_memory(capsys):
    argv = ["mlp", "--training", "--devices", "2", "--device-memory", "70%",
            "--swap-time-budget", "1", "--run", "--check", "--repeat", "0"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "swap    per device" in out and "every worker fits" in out and "check   OK" in out


def test_a_swapped_partition_is_measured_against_the_swap_plan(capsys):
    """Each worker's measured peak against the swap plan's per-device peak (near 1), not the
    partition's unswapped one (about the budget fraction)."""
    argv = ["gpt", "--devices", "4", "--device-memory", "50%", "--swap-time-budget", "1",
            "--run", "--repeat", "0"]
    assert main(argv) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines()
                if ln.startswith("memory  measured peak per worker"))
    ratios = [float(r) for r in line.split("measured / predicted: ")[1].rstrip(")").split(", ")]
    assert "swap plan" in line and all(0.85 <= r <= 1.0 for r in ratios), line


def test_cuda_export_for_four_gpus(tmp_path, capsys):
    """Inference: the single-device CUDA build of the tiny training steps already fails in
    dlight's default GPU schedules (a GEMV rule assertion), partitioned or not."""
    so = tmp_path / "m.so"
    argv = ["gpt", "--devices", "4", "--target", "cuda", "--output", str(so)]
    assert main(argv) == 0
    assert so.stat().st_size > 0
    side = json.loads((tmp_path / "m.so.partition.json").read_text())
    assert side["layout"]["num_devices"] == 4 and side["layout"]["mesh"] == [2, 2]
    assert len(side["layout"]["arguments"]) == 38  # ids + 37 parameters
    assert side["plan"]["collectives"], "the 4-way plan communicates (mesh collectives)"
    assert "compile-only here" in capsys.readouterr().out
    assert main([*argv, "--run"]) == 2
    assert "needs 4 GPUs" in capsys.readouterr().err


def test_exported_module_runs_from_its_sidecar(tmp_path, capsys):
    import tvm

    from tvm_ext import driver
    from tvm_ext.models import get_model
    from tvm_ext.runtime import distributed

    so = tmp_path / "r.so"
    (tmp_path / "r.so.swap.json").write_text("{}")  # of an earlier single-device export
    argv = ["resnet", "--devices", "2", "--device-memory", "80%", "--swap-time-budget", "1",
            "--output", str(so)]
    assert main(argv) == 0
    assert not (tmp_path / "r.so.swap.json").exists()
    model = get_model("resnet", "tiny")
    args = model.random_arguments(1)
    ref = driver.run(driver.build_reference(model, tvm.target.Target("llvm")), args,
                       tvm.cpu(0), repeat=0)
    with distributed.Session(2) as sess:
        result = distributed.run_exported(sess, so, args)
    driver.compare(result.outputs, ref.outputs, rtol=1e-5, atol=1e-5)
    with pytest.raises(FileNotFoundError, match=r"partition\.json"):
        with distributed.Session(2) as sess:
            distributed.run_exported(sess, tmp_path / "missing.so", args)


def test_pt2_partitioned_check_against_torch(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    path = tmp_path / "mlp.pt2"
    torch.export.save(torch.export.export(net, (torch.randn(4, 8),)), str(path))
    assert main([str(path), "--devices", "2", "--check", "--repeat", "0"]) == 0
    out = capsys.readouterr().out
    assert "1 outputs match the single-device TVM build" in out
    assert "1 outputs match PyTorch eager (mlp.pt2)" in out and "float32 rtol 0.0001" in out
