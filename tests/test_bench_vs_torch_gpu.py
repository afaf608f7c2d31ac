"""benchmarks/vs_torch_gpu.py, both halves on this CPU (`prepare --target llvm`, `run --device
cpu`, the run half with TVM's runtime alone) at the tiny sizes: the module's parameters are
the torch model's by name (tied ones once), a torch model rebuilt from the recorded config runs
the same weights, and inference outputs, the first AdamW step's loss and the parameters after
it agree with torch (fp32 and bf16). Rows accumulate in one JSON across runs; a row whose child
outruns its time limit is an error row and the others still run. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "vs_torch_gpu.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import vs_torch_gpu  # noqa: E402
import vs_torch_gpu_measure as measure  # noqa: E402
from built_once import built_once  # noqa: E402

KEYS = ("gpt2/inference/fp32,gpt2/inference/bf16,gpt2/training/fp32,gpt2/training/bf16,"
        "resnet/inference/fp32,resnet/training/fp32")


def _script(*args, env=None, timeout=600):
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)
    return proc, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    def build(folder: Path) -> None:
        proc, out = _script("prepare", str(folder), "--target", "llvm", "--size", "quick",
                            "--keys", KEYS, timeout=900)
        assert proc.returncode == 0, out

    return built_once(tmp_path_factory, "vs_torch_gpu", build)


@pytest.fixture(scope="module")
def results(prepared, tmp_path_factory) -> tuple[dict, str]:
    """Two `run` calls into one JSON (gpt2's rows, then resnet's, profiled), with TVM's
    runtime alone (TVM_USE_RUNTIME_LIB=1: no compiler, tvm_ext's runtime side only)."""

    def build(folder: Path) -> None:
        env = dict(os.environ, TVM_USE_RUNTIME_LIB="1")
        for model, extra in (("gpt2", ()), ("resnet", ("--profile",))):
            proc, out = _script("run", str(prepared), "--device", "cpu", "--models", model,
                                "--rounds", "1", "--round-seconds", "0.01", "--json",
                                str(folder / "r.json"), *extra, env=env)
            assert proc.returncode == 0, out
        (folder / "stdout.txt").write_text(proc.stdout)

    folder = built_once(tmp_path_factory, "vs_torch_gpu_run", build)
    return json.loads((folder / "r.json").read_text()), (folder / "stdout.txt").read_text()


def test_parameters_are_named_and_none_carried(prepared):
    gpt2 = json.loads((prepared / "gpt2" / "manifest.json").read_text())["entries"]
    training = gpt2["gpt2/training/fp32"]
    # The tied head is the embedding: one parameter, as torch and its optimizer see it.
    assert training["tied"] == {"inner.lm_head.weight": "inner.transformer.wte.weight"}
    assert "inner.lm_head.weight" not in training["parameters"]
    assert all(n.startswith("inner.") for n in training["parameters"])
    assert training["trainable"] == list(range(len(training["parameters"])))
    names = [s["name"] for s in training["state"]]
    assert names[-1] == "step" and len(names) == 2 * len(training["parameters"]) + 1
    assert training["labels"]["dtype"] == "int64" and training["loss"] == "cross_entropy"
    assert not list((prepared / "gpt2").glob("*.npz"))  # no weight travels
    resnet = json.loads((prepared / "resnet" / "manifest.json").read_text())["entries"]
    # ResNet's BatchNorm statistics travel (folded into the module as constants).
    assert any("running_mean" in b for b in resnet["resnet/inference/fp32"]["buffers"])


def test_rows_agree_with_torch(results):
    rows = results[0]["rows"]
    assert sorted(rows) == sorted(KEYS.split(","))
    for key, row in rows.items():
        assert row["ok"] and "error" not in row, (key, row)
        assert row["tvm_ext_ms"] > 0 and row["eager_ms"] > 0 and row["bf16_autocast_ms"] > 0
        assert row["vm_calls"]["kernels"] > 0
        if row["mode"] == "inference":
            # A bf16 row is checked against torch under bf16 autocast.
            assert row["reference"] == ("eager" if row["dtype"] == "fp32" else "bf16_autocast")
            assert row["max_abs_error"] < (1e-4 if row["dtype"] == "fp32" else 2e-2), row
        else:
            check = row["parameters_check"]
            assert check["elements"] > 0 and check["beyond_with_signal_gradient"] == 0
            assert check["max_abs_error_signal"] < 1e-5, (key, check)
            assert row["loss_error"] <= measure.LOSS_RTOL[row["dtype"]] * row["torch_loss"]


def test_profiled_rows_name_their_slowest_kernels(results):
    """`--profile` (resnet's run): tvm_ext's call timed call by call, beside the timing."""
    rows = results[0]["rows"]
    assert not any("profile" in rows[k] for k in rows if k.startswith("gpt2/"))
    for key in ("resnet/inference/fp32", "resnet/training/fp32"):
        profile = rows[key]["profile"]
        assert profile["kernel_calls"] == rows[key]["vm_calls"]["kernels"], (key, profile)
        assert 0 < len(profile["slowest"]) <= measure.PROFILE_TOP
        assert profile["kernels_net_ms"] > 0 and profile["wall_ms"] > 0


def test_rows_accumulate_across_runs(results):
    """The second run's table lists the first run's rows too."""
    table = results[1].split("| model |", 1)[1]
    assert table.count("| gpt2 |") == 4 and table.count("| resnet |") == 2


def test_merge_replaces_a_row_of_the_same_key(tmp_path):
    path = str(tmp_path / "r.json")
    vs_torch_gpu.merge_row(path, "a/inference/fp32", {"x": 1})
    vs_torch_gpu.merge_row(path, "b/inference/fp32", {"x": 2})
    results = vs_torch_gpu.merge_row(path, "a/inference/fp32", {"x": 3})
    assert results["rows"] == {"a/inference/fp32": {"x": 3}, "b/inference/fp32": {"x": 2}}
    (tmp_path / "other.json").write_text(json.dumps({"benchmark": "vs_torch", "rows": []}))
    with pytest.raises(SystemExit):
        vs_torch_gpu.merge_row(str(tmp_path / "other.json"), "a/inference/fp32", {})


def test_unfused_attention_on_a_cpu_target_is_refused(tmp_path, capsys):
    """Attention is fused on GPU targets only: the option would do nothing there."""
    with pytest.raises(SystemExit):
        vs_torch_gpu.main(["prepare", str(tmp_path), "--target", "llvm", "--unfused-attention"])
    assert "does nothing with --target llvm" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing prepared


def _fake_prepared(folder: Path, keys: list[str]) -> None:
    entries = {}
    for key in keys:
        model, mode, dtype = key.split("/")
        entries[key] = {"file": measure.module_file(model, mode, dtype)}
        (folder / entries[key]["file"]).write_bytes(b"")
    (folder / "manifest.json").write_text(json.dumps({"entries": entries}))


def test_a_row_over_its_time_limit_is_an_error_and_the_others_run(tmp_path, monkeypatch,
                                                                   capsys):
    """The first row's child writes what it measured, starts a grandchild and hangs: it is
    killed at the limit with its process group, its row keeps the partial figures and says
    why; the next row runs."""
    keys = ["gpt2/inference/fp32", "bert/inference/fp32"]
    _fake_prepared(tmp_path, keys)
    marker = tmp_path / "grandchild.pid"

    def fake_child(args, folder, key, out_path):
        if key == keys[0]:
            code = (f"import json, subprocess, time; json.dump({{'model': 'gpt2', "
                    f"'setup_s': 1.0}}, open({out_path!r}, 'w')); "
                    f"p = subprocess.Popen(['sleep', '60']); "
                    f"open({str(marker)!r}, 'w').write(str(p.pid)); time.sleep(60)")
        else:
            code = (f"import json; json.dump({{'model': 'bert', 'ok': True, 'complete': True, "
                    f"'tvm_ext_ms': 1.0}}, open({out_path!r}, 'w'))")
        return [sys.executable, "-c", code]

    monkeypatch.setattr(vs_torch_gpu, "child_argv", fake_child)
    out = tmp_path / "r.json"
    status = vs_torch_gpu.main(["run", str(tmp_path), "--device", "cpu", "--keys",
                                ",".join(keys), "--timeout", "5", "--json", str(out)])
    assert status == 1
    rows = json.loads(out.read_text())["rows"]
    slow, fine = rows[keys[0]], rows[keys[1]]
    assert slow["error"] == "timed out after 5 s" and slow["setup_s"] == 1.0
    assert not slow["ok"] and fine["ok"] and "error" not in fine
    # The grandchild was killed with the child's process group (gone, or a zombie where
    # nothing has reaped it yet).
    stat = Path(f"/proc/{int(marker.read_text())}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    assert "timed out after 5 s" in capsys.readouterr().out
    # Resuming (--missing): only the row that failed runs again.
    ran = []

    def quick_child(args, folder, key, out_path):
        ran.append(key)
        return [sys.executable, "-c", f"import json; json.dump({{'ok': True, 'complete': "
                f"True}}, open({out_path!r}, 'w'))"]

    monkeypatch.setattr(vs_torch_gpu, "child_argv", quick_child)
    assert vs_torch_gpu.main(["run", str(tmp_path), "--device", "cpu", "--keys",
                              ",".join(keys), "--missing", "--json", str(out)]) == 0
    assert ran == [keys[0]] and json.loads(out.read_text())["rows"][keys[0]]["ok"]


def test_parameter_check_refuses_a_wrong_update():
    """An element whose gradient is far from noise must move as torch's does; noise-gradient
    elements may move up to 2 lr the other way, and are counted."""
    lr, eps = 1e-3, 1e-8

    def check(ours, theirs, grads):
        return measure.compare_parameters(torch, ours, theirs, grads, lr, 1e-3, eps)

    theirs = torch.zeros(4)
    grads = torch.tensor([1.0, -1.0, 1e-6, 0.5])
    ours = theirs.clone()
    ours[2] = 1.9 * lr  # a noise gradient flipped
    result = check([ours], [theirs], [grads])
    assert result["ok"] and result["beyond_with_noise_gradient"] == 1
    ours[3] = 1.9 * lr  # a real gradient flipped
    result = check([ours], [theirs], [grads])
    assert not result["ok"] and result["beyond_with_signal_gradient"] == 1
    assert result["signal_worst"][0]["gradient"] == 0.5
    ours[3] = 0.0
    ours[2] = 3 * lr  # beyond what Adam's first step can move anything
    assert check([ours], [theirs], [grads])["beyond_2lr"] == 1
    # A noise gradient below eps moves its element by a fraction of lr: a flip is 2 lr wrong.
    ours[2] = 0.0
    tiny = torch.tensor([1.0, 1e-9])
    assert not check([torch.tensor([0.0, 1.9 * lr])], [torch.zeros(2)], [tiny])["ok"]
    # A tensor whose gradient is all noise (exactly zero, e.g. a key bias): judged against
    # the step's largest gradient, not its own.
    bias, bias_grads = torch.zeros(2), torch.tensor([1e-7, -2e-7])
    flipped = torch.tensor([1.8 * lr, 0.0])
    result = check([ours, flipped], [theirs, bias], [grads, bias_grads])
    assert result["ok"] and result["beyond_with_noise_gradient"] == 1


def test_parameter_check_near_eps():
    """A gradient just above the noise level of a tensor whose scale is small sits near Adam's
    eps, where its rounding moves the update by a fraction of lr (the H200's Llama step:
    1.23e-6 off at 1.07x the noise level); the same error on a large gradient is wrong."""
    lr, eps = 1e-3, 1e-8
    scale = 7e-3
    grads = torch.tensor([scale, 1.07e-3 * scale])
    theirs = torch.zeros(2)
    near = torch.tensor([0.0, 1.23e-6])
    result = measure.compare_parameters(torch, [near], [theirs], [grads], lr, 1e-3, eps)
    assert result["ok"] and result["beyond_with_signal_gradient"] == 1
    far = torch.tensor([1.23e-6, 0.0])
    result = measure.compare_parameters(torch, [far], [theirs], [grads], lr, 1e-3, eps)
    assert not result["ok"] and result["beyond_bound"] == 1


def test_bf16_inference_check_is_autocasts_envelope():
    """A bf16 inference row passes within twice what autocast itself loses against float32,
    and fails beyond it or with a NaN; a float32 row at its fixed tolerance alone."""
    row = {"dtype": "bf16", "within_tolerance": False, "max_abs_error": 0.03,
           "bf16_autocast_max_abs_error": 0.029, "fp32_max_abs_error": 0.04}
    assert measure.inference_ok(row)
    assert not measure.inference_ok({**row, "fp32_max_abs_error": 0.07})
    assert not measure.inference_ok({**row, "max_abs_error": 0.07})
    assert not measure.inference_ok({**row, "nan": {"tvm_ext": 1, "torch": 0}})
    assert not measure.inference_ok({**row, "dtype": "fp32"})


def test_first_nan_kernel(prepared):
    import tvm
    from tvm.runtime.vm import VirtualMachine

    import tvm_ext  # noqa: F401  (library kernels)

    folder = prepared / "gpt2"
    entry = json.loads((folder / "manifest.json").read_text())["entries"][
        "gpt2/inference/fp32"]
    model = measure.torch_model(entry, torch, "cpu")
    named = dict(model.named_parameters(remove_duplicate=False))
    params = [named[n].detach().numpy().copy() for n in entry["parameters"]]
    ids = measure.draw_inputs(entry, 0)[0]
    vm = VirtualMachine(tvm.runtime.load_module(str(folder / entry["file"])), tvm.cpu())

    def args():
        return [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in (ids, *params)]

    assert measure.first_nan_kernel(vm, args()) is None
    # +inf and -inf in one weight: a kernel downstream (inf - inf) makes the first NaN from
    # inputs that hold none.
    index = next(i for i, n in enumerate(entry["parameters"])
                 if n.endswith("h.0.attn.c_proj.weight"))
    params[index].flat[0], params[index].flat[1] = np.inf, -np.inf
    found = measure.first_nan_kernel(vm, args())
    assert found is not None and found["kernel"], found
    assert found["nan_before"] == []
    assert found["argument"] < len(found["shapes"])
