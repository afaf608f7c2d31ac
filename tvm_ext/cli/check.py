"""--check: the compiled module's outputs against a plain TVM build and against the source
framework (PyTorch eager for a .pt2 model, ONNX Runtime for a .onnx model)."""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np

from tvm_ext import driver
from tvm_ext.errors import CheckError, install_hint
from tvm_ext.models import reference, selection_ties
from tvm_ext.models.onnx_reference import onnx_reference
from tvm_ext.models.reference import tolerance


def check_against_reference(args, report: dict, model, target, device, arguments, outputs,
                            what: str) -> int:
    """--check: `outputs` against a plain `tvm.compile` of the model run on `device` with the
    same `arguments`, and against PyTorch eager for a .pt2 model; the verdict goes into
    `report["check"]`. Returns the exit status.

    Where the plain build differs and PyTorch was run, PyTorch arbitrates: a plain build that
    misses PyTorch's tolerance where tvm_ext meets it (TVM's own float32 reductions sum in one
    serial accumulator: a loss over a million terms is off by ~1e-3) is no verdict against
    tvm_ext, and the report says so and by how much."""
    # Two TVM builds may round a float16 / bfloat16 result (or, autocast, an intermediate)
    # differently by one step.
    least = autocast_tolerance(model)
    low = [tolerance(o.dtype) for o in outputs if str(o.dtype) in ("float16", "bfloat16")]
    low += [least] if least is not None else []
    rtol = max([1e-5, *(t[0] for t in low)]) if args.rtol is None else args.rtol
    atol = max([1e-5, *(t[1] for t in low)]) if args.atol is None else args.atol
    unfinished = _non_finite_step(model, outputs)
    if unfinished:
        report.setdefault("check", {}).update(ok=False, error=unfinished, reference=what)
        print(f"check   FAILED: {unfinished}", file=sys.stderr)
        return 1
    reference = driver.build_reference(model, target)
    ref = driver.run(reference, arguments, device, repeat=0)
    torch_status, expected = torch_expected(args, report, model, arguments)
    entry = {"reference": what, "rtol": rtol, "atol": atol}
    try:
        check = driver.compare(outputs, ref.outputs, rtol, atol)
    except CheckError as err:
        arbiter = _plain_farther_from_torch(args, outputs, ref.outputs, expected, least)
        noise = None
        if arbiter is None and expected is not None:
            noise = _within_pytorch_noise(args, model, arguments, outputs, expected, least,
                                          ref.outputs, (rtol, atol)) \
                if _noise_measurable(report) else None
        elif arbiter is None:
            noise = _within_onnx_autocast_noise(args, model, arguments, outputs, ref.outputs,
                                                (rtol, atol))
        if noise is not None:
            report.setdefault("check", {}).update(ok=True, noise=noise, error=str(err),
                                                  **entry)
            print(_noise_line(what, err, noise))
            status = 0
        elif arbiter is None:
            report.setdefault("check", {}).update(ok=False, error=str(err), **entry)
            print(f"check   FAILED against {what} (rtol {rtol:g}, atol {atol:g}): {err}",
                  file=sys.stderr)
            status = 1
        else:
            report.setdefault("check", {}).update(ok=True, arbitrated=arbiter, error=str(err),
                                                  **entry)
            print(f"check   {what} differs ({err}), but it is farther from PyTorch than this "
                  f"build (max rel error {arbiter['plain_vs_torch']:.2e} against "
                  f"{arbiter['ours_vs_torch']:.2e}): PyTorch decides")
            status = 0
    else:
        report.setdefault("check", {}).update(ok=True, **entry, **vars(check))
        print(f"check   OK: {check.outputs} outputs match {what} "
              f"({_errors(check.max_abs_error, check.max_rel_error, rtol)}; rtol {rtol:g}, "
              f"atol {atol:g})")
        status = 0
    if expected is None:
        return max(status, torch_status)
    torch_status = compare_with_torch(
        args, report, outputs, expected, least,
        lambda: _within_pytorch_noise(args, model, arguments, outputs, expected, least))
    if torch_status:
        say_tied_selections(args, report, model, arguments)
    return max(status, torch_status)


def _noise_measurable(report: dict) -> bool:
    """Whether PyTorch's own rounding noise can be measured: not where its autocast run
    failed and float32 stood in for it (`torch_expected`)."""
    return "autocast_error" not in report.get("check", {}).get("torch", {})


def autocast_tolerance(model) -> tuple[float, float] | None:
    """The (rtol, atol) of an autocast model's low dtype, which its float32 outputs carry the
    rounding of too; None for a model computed in its own dtypes."""
    if not model.config.get("autocast"):
        return None
    return reference.tolerance(model.config["compute_dtype"])


def _output_tolerance(args, dtype, least) -> tuple[float, float]:
    """(rtol, atol) of one output against PyTorch: its dtype's, at least `least`, or the
    command's --rtol / --atol."""
    rtol, atol = reference.tolerance(dtype, least)
    return (rtol if args.rtol is None else args.rtol, atol if args.atol is None else args.atol)


def _plain_farther_from_torch(args, outputs, plain, expected, least=None) -> dict | None:
    """{"plain_vs_torch", "ours_vs_torch"} (largest relative errors) when every output meets
    PyTorch's tolerance and some output of the plain build does not; None otherwise."""
    if expected is None or len(expected) != len(outputs) or len(plain) != len(outputs):
        return None
    plain_misses, worst_plain, worst_ours = False, 0.0, 0.0
    for ours, base, exp in zip(outputs, plain, expected, strict=True):
        rtol, atol = _output_tolerance(args, ours.dtype, least)
        try:
            mine = driver.compare([ours], [exp], rtol, atol)
        except CheckError:
            return None
        worst_ours = max(worst_ours, mine.max_rel_error)
        try:
            theirs = driver.compare([base], [exp], rtol, atol)
            worst_plain = max(worst_plain, theirs.max_rel_error)
        except CheckError:
            plain_misses = True
            diff = np.abs(np.asarray(base, "float64") - np.asarray(exp, "float64"))
            scale = np.maximum(np.abs(np.asarray(exp, "float64")), np.finfo("float64").tiny)
            worst_plain = max(worst_plain, float(np.nanmax(diff / scale)) if diff.size else 0.0)
    if not plain_misses:
        return None
    return {"plain_vs_torch": worst_plain, "ours_vs_torch": worst_ours}


NOISE_FACTOR = 2.0


def _within_pytorch_noise(args, model, arguments, outputs, expected, least=None,
                          against=None, tolerance=None) -> dict | None:
    """For outputs that miss their dtype's fixed tolerance (at least `least`): {"reference",
    "ours", "torch"} (largest absolute errors from PyTorch run at a higher precision: float32
    for an autocast model, else float64) where every output that misses it is about as close
    to that run as PyTorch's own output (`expected`) is (within `NOISE_FACTOR`: two
    computations rounded alike land on either side of each other); None otherwise. `against`
    (another build's outputs) at `tolerance` (rtol, atol) is what the outputs missed, where it
    is not PyTorch's. A fixed tolerance fails PyTorch itself where rounding noise is large
    against an element: bfloat16 through WavLM's group norm, a float32 gradient of 14 in a
    tensor of 4700 (DeiT's position embeddings)."""
    path = torch_file(model, args.model)
    if path is None or len(expected) != len(outputs):
        return None
    n = model.num_input
    inputs, params = arguments[:n], arguments[n:]
    names = [p.name for p in model.params]
    autocast = bool(model.config.get("autocast"))
    higher = "float32" if autocast else "float64"

    def run(values, float64: bool) -> list:
        if model.training:
            return reference.torch_training_step(
                path, inputs[:-1], inputs[-1], values, names, model.config["gradients"],
                model.config.get("loss", "mse"), float64=float64)
        return reference.torch_reference(path, inputs, values, names, float64=float64)

    def neighbours():
        for values in ulp_neighbours(params):
            yield run(values, False), run(values, True)

    try:
        exact = reference.torch_reference(path, inputs, params, names) if autocast else \
            run(params, True)
    except Exception:  # no run at the higher precision: no second opinion
        return None
    tolerances = [tolerance or _output_tolerance(args, np.asarray(t).dtype, least)
                  for t in expected]
    # An autocast model's yardstick rounds to its low dtype: a float32 step is lost in it.
    return noise_verdict(outputs, expected if against is None else against, expected, exact,
                         tolerances, f"PyTorch {higher}", None if autocast else neighbours)


def _within_onnx_autocast_noise(args, model, arguments, outputs, plain, tolerance
                                ) -> dict | None:
    """`_within_pytorch_noise` for an autocast .onnx model, which ONNX Runtime cannot run in
    the low dtype: the outputs that miss the plain TVM build's (`plain`, the same autocast
    graph) pass where they are about as close to ONNX Runtime's float32 outputs as the plain
    build's are."""
    path = onnx_file(model, args.model)
    if path is None or not model.config.get("autocast"):
        return None
    try:
        exact = _onnx_outputs(path, model, arguments)
    except Exception:  # no float32 run: no second opinion
        return None
    noise = noise_verdict(outputs, plain, plain, exact, [tolerance] * len(outputs),
                          "ONNX Runtime float32")
    return None if noise is None else {**noise, "yardstick": "the plain TVM build"}


def noise_verdict(ours, against, torch_outputs, exact, tolerances, reference_name: str,
                  neighbours=None) -> dict | None:
    """{"reference", "ours", "torch"} where every tensor of `ours` either meets its
    (rtol, atol) against `against` (PyTorch's outputs, or another build's) or is within
    `NOISE_FACTOR` of the largest absolute error of `torch_outputs` (PyTorch's own) from
    `exact` (a higher-precision run); None otherwise, and where no tensor needed it. The
    worst errors are those of the tensors that needed it.

    `neighbours` (a callable giving (PyTorch's outputs, exact) pairs at parameters one
    rounding step from these, `ulp_neighbours`) widens that yardstick where one point's is
    too narrow: where a result jumps between inputs float32 cannot tell apart (bilinear
    sampling at a near-integer coordinate), PyTorch's own error is luck of the draw, and
    the largest over neighbouring points is what float32 can promise; then "neighbours" is
    how many were run (`near_line` says it)."""
    if not len(ours) == len(against) == len(torch_outputs) == len(exact) == len(tolerances):
        return None
    mine_err, torch_err = {}, {}
    for i, (mine, other, torch_out, best, (rtol, atol)) in enumerate(zip(
            ours, against, torch_outputs, exact, tolerances, strict=True)):
        mine, other = np.asarray(mine, "float64"), np.asarray(other, "float64")
        if not mine.shape == other.shape == np.shape(torch_out) == np.shape(best):
            return None
        if not np.allclose(mine, other, rtol=rtol, atol=atol):
            mine_err[i] = largest_error(mine, best)
            torch_err[i] = largest_error(torch_out, best)
    if not mine_err:
        return None

    def within() -> bool:
        return all(mine_err[i] <= NOISE_FACTOR * torch_err[i] for i in mine_err)

    tried = 0
    if not within() and neighbours is not None:
        try:
            for near_torch, near_exact in neighbours():
                tried += 1
                for i in mine_err:
                    torch_err[i] = max(torch_err[i],
                                       largest_error(near_torch[i], near_exact[i]))
                if within():
                    break
        except Exception:  # a neighbour PyTorch cannot run widens nothing
            pass
    if not within():
        return None
    verdict = {"reference": reference_name, "ours": max(mine_err.values()),
               "torch": max(torch_err.values())}
    if tried:
        verdict["neighbours"] = tried
    return verdict


def largest_error(values, exact) -> float:
    """The largest absolute difference of two arrays, in float64."""
    return float(np.max(np.abs(np.asarray(values, "float64") - np.asarray(exact, "float64")),
                        initial=0.0))


# How many parameter sets one rounding step away `noise_verdict` may try.
NEIGHBOURS = 4


def ulp_neighbours(params, count: int = NEIGHBOURS, seed: int = 0):
    """`count` copies of `params`, each float32 element moved one representable value up or
    down at random (other dtypes as they are): points float32 cannot tell from `params`."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        yield [np.nextafter(p, np.where(rng.random(np.shape(p)) < 0.5, np.float32(-np.inf),
                                        np.float32(np.inf)))
               if np.asarray(p).dtype == np.float32 else p for p in params]


def _noise_line(what: str, err, noise: dict) -> str:
    own = "autocast" if noise["reference"].endswith("float32") else "float32"
    yardstick = noise.get("yardstick", f"PyTorch's own {own}")
    return (f"check   {what} differs ({err}), but this build is as close to "
            f"{noise['reference']} as {yardstick} is{near_line(noise)} (max abs error "
            f"{noise['ours']:.2e} against {noise['torch']:.2e})")


def near_line(noise: dict) -> str:
    """Where the yardstick was widened to parameters one rounding step away, the words."""
    tried = noise.get("neighbours")
    return f" at parameters one rounding step from these ({tried} tried)" if tried else ""


def _model_file(model, spec: str, suffix: str) -> str | None:
    path = model.config.get("file") or spec
    return path if str(path).lower().endswith(suffix) and os.path.isfile(path) else None


def _non_finite_step(model, outputs) -> str | None:
    """Why a training step's outputs (its loss, then its gradients) are no evidence, or None:
    a loss or gradient that is not finite. The plain build's is likely not finite either, and
    NaN equal to NaN says nothing of the step."""
    if not model.training:
        return None
    for i, out in enumerate(outputs):
        if np.issubdtype(out.dtype, np.floating) or str(out.dtype) == "bfloat16":
            wide = np.asarray(out, np.float64)
            if not np.all(np.isfinite(wide)):
                what = "the loss" if i == 0 else f"output {i} (a gradient)"
                return f"{what} is not finite: a check of non-finite steps proves nothing"
    return None


def torch_file(model, spec: str) -> str | None:
    """The .pt2 file `model` was loaded from: PyTorch eager is then a second reference."""
    return _model_file(model, spec, ".pt2")


def onnx_file(model, spec: str) -> str | None:
    """The .onnx file `model` was loaded from: ONNX Runtime is then a second reference."""
    return _model_file(model, spec, ".onnx")


def _onnx_outputs(path: str, model, arguments) -> list:
    """ONNX Runtime's outputs of the file on `arguments`, each weight fed under its name in
    the file (the loader renames some)."""
    n = model.num_input
    in_file = model.config.get("onnx_weight_names", {})
    return onnx_reference(path, arguments[:n], arguments[n:],
                          [in_file.get(p.name, p.name) for p in model.params])


def _onnx_expected(args, report: dict, model, arguments, path: str) -> tuple[int, list | None]:
    """`torch_expected` for a .onnx model: its outputs run by ONNX Runtime."""
    what = f"ONNX Runtime ({os.path.basename(path)})"
    entry = report.setdefault("check", {}).setdefault("onnxruntime", {"reference": what})
    skipped = None
    if model.training:
        skipped = "ONNX Runtime runs no training step"
    elif model.config.get("autocast"):
        skipped = "ONNX Runtime has no autocast"
    elif importlib.util.find_spec("onnxruntime") is None:
        skipped = f"onnxruntime is not installed; {install_hint('onnxruntime')}"
    if skipped:
        entry.update(ok=None, skipped=skipped)
        print(f"check   not compared with {what}: {skipped}")
        return 0, None
    try:
        expected = _onnx_outputs(path, model, arguments)
    except Exception as err:  # any failure of ONNX Runtime itself is a failed check
        entry.update(ok=False, error=f"{type(err).__name__}: {err}")
        report["check"]["ok"] = False
        print(f"check   FAILED: {what} did not run: {type(err).__name__}: {err}",
              file=sys.stderr)
        return 1, None
    return 0, expected


def torch_expected(args, report: dict, model, arguments) -> tuple[int, list | None]:
    """(exit status, outputs of the exported program run by PyTorch eager on the same inputs
    and weights) for a .pt2 model, or of a .onnx model run by ONNX Runtime; (0, None) where
    there is nothing to compare with or the comparison does not apply (said in the report),
    (1, None) where the framework failed."""
    path = torch_file(model, args.model)
    if path is None:
        onnx = onnx_file(model, args.model)
        return (0, None) if onnx is None else _onnx_expected(args, report, model, arguments,
                                                             onnx)
    name = os.path.basename(path)
    what = f"PyTorch eager ({name})"
    entry = report.setdefault("check", {}).setdefault("torch", {"reference": what})
    n = model.num_input
    names = [p.name for p in model.params]
    inputs, params = arguments[:n], arguments[n:]
    try:
        skipped = None
        if reference.random_ops(path):
            skipped = (f"PyTorch draws random numbers in {', '.join(reference.random_ops(path))}"
                       ", the compiled module does not")
        elif model.training and "training_semantics" not in model.config \
                and reference.has_batch_norm(path):
            skipped = ("the training step normalizes with batch statistics whatever mode the "
                       "program was exported in")
        if skipped:
            entry.update(ok=None, skipped=skipped)
            print(f"check   not compared with {what}: {skipped}")
            return 0, None
        if model.config.get("autocast"):
            dtype = model.config["compute_dtype"]
            entry["reference"] = what = f"PyTorch eager under autocast to {dtype} ({name})"
            try:
                expected = reference.torch_reference(path, inputs, params, names,
                                                     autocast=dtype)
            except Exception as err:  # PyTorch's autocast itself may fail
                # Some models do not run under PyTorch's autocast at all (BigBird's scatter
                # of a low-dtype product into a float32 tensor): the float32 run at the low
                # dtype's tolerance is what is left to compare with, and it is said.
                failed = f"{type(err).__name__}: {err}"
                entry.update(reference=f"PyTorch eager in float32 ({name})",
                             autocast_error=failed)
                what = entry["reference"]
                print(f"check   note: PyTorch eager under autocast to {dtype} did not run "
                      f"({failed}); compared with PyTorch eager in float32 at {dtype}'s "
                      "tolerance")
                expected = reference.torch_reference(path, inputs, params, names)
        elif model.training:
            expected = reference.torch_training_step(
                path, inputs[:-1], inputs[-1], params, names, model.config["gradients"],
                model.config.get("loss", "mse"))
        else:
            expected = reference.torch_reference(path, inputs, params, names)
        stale = reference.file_weight_mismatches(path, params, names) \
            if model.weights is not None else []
    except Exception as err:  # any failure of torch itself is a failed check, with its reason
        entry.update(ok=False, error=f"{type(err).__name__}: {err}")
        report["check"]["ok"] = False
        print(f"check   FAILED: {what} did not run: {type(err).__name__}: {err}",
              file=sys.stderr)
        return 1, None
    if stale:
        entry.update(stale=stale)
    return 0, expected


def check_against_torch(args, report: dict, model, arguments, outputs) -> int:
    """--check of a .pt2 model against PyTorch eager alone (see `torch_expected`). Returns the
    exit status; 0 where there is nothing to compare with."""
    status, expected = torch_expected(args, report, model, arguments)
    if expected is None:
        return status
    status = compare_with_torch(
        args, report, outputs, expected, autocast_tolerance(model),
        lambda: _within_pytorch_noise(args, model, arguments, outputs, expected,
                                      autocast_tolerance(model)))
    if status:
        say_tied_selections(args, report, model, arguments)
    return status


def say_tied_selections(args, report: dict, model, arguments) -> None:
    """After a failed comparison with PyTorch: the selections (topk, sort, argmax ...) PyTorch
    made among tied values, which TVM may break otherwise, said and kept in the report. The
    check still fails: a tie explains a difference, it does not prove that nothing else
    does."""
    path = torch_file(model, args.model)
    if path is None:
        return
    n = model.num_input
    inputs = arguments[:n - 1] if model.training else arguments[:n]  # the labels last
    try:
        found = reference.tied_selections(path, inputs, arguments[n:],
                                          [p.name for p in model.params])
    except Exception:  # a diagnosis that cannot run leaves the failure as it is
        return
    if not found:
        return
    report["check"]["torch"]["tied_selections"] = {
        node: {"op": op, "tied_rows": tied, "rows": rows}
        for node, (op, tied, rows) in found.items()}
    print(f"check   note: PyTorch chose among tied values in {selection_ties.describe(found)}; "
          "where values tie, PyTorch and TVM may choose different ones and their outputs then "
          "differ without a fault in either (a model at its initialisation may tie, e.g. "
          "scores made from weights set to zero)", file=sys.stderr)


def compare_with_torch(args, report: dict, outputs, expected: list, least=None,
                       noise=None) -> int:
    """`outputs` against PyTorch's `expected` (from `torch_expected`), at the tolerance of
    each output's dtype, at least `least` (or --rtol/--atol). Where they differ, `noise()`
    (see `_within_pytorch_noise`) may still pass them. Returns the exit status."""
    checks = report["check"]
    entry = checks["torch"] if "torch" in checks else checks["onnxruntime"]
    what = entry["reference"]
    stale = entry.pop("stale", [])
    tolerances = {}
    try:
        if stale:
            raise CheckError(
                f"the weights given to the module differ from the file's for "
                f"{', '.join(stale[:5])}{' ...' if len(stale) > 5 else ''}")
        if len(outputs) != len(expected):
            raise CheckError(f"{len(outputs)} outputs, {what} has {len(expected)}")
        max_abs = max_rel = 0.0
        for i, (out, exp) in enumerate(zip(outputs, expected, strict=True)):
            if least is not None and out.dtype != exp.dtype and \
                    {str(out.dtype), str(exp.dtype)} <= reference.TOLERANCES.keys():
                # Autocast's policies differ by device: torch's on the CPU leaves some ops
                # (layer norms) in the low dtype that its CUDA policy, and the module, run
                # in float32. The values are compared in float32 at the low dtype's
                # tolerance; the dtypes are said.
                note = (f"output {i} is {out.dtype} here, {exp.dtype} from PyTorch (its CPU "
                        "autocast keeps some ops, layer norms, in the low dtype)")
                entry.setdefault("dtype_notes", []).append(note)
                print(f"check   note: {note}; compared in float32")
                out, exp = out.astype(np.float32), exp.astype(np.float32)
            rtol, atol = _output_tolerance(args, out.dtype, least)
            tolerances[str(out.dtype)] = (rtol, atol)
            try:
                one = driver.compare([out], [exp], rtol, atol)
            except CheckError as err:
                raise CheckError(f"output {i}{str(err).removeprefix('output 0')}") \
                    from None
            max_abs, max_rel = max(max_abs, one.max_abs_error), max(max_rel, one.max_rel_error)
    except CheckError as err:
        judged = None if noise is None or stale or not _noise_measurable(report) else noise()
        if judged is not None:
            entry.update(ok=True, noise=judged, error=str(err), tolerances=tolerances)
            print(_noise_line(what, err, judged))
            return 0
        entry.update(ok=False, error=str(err), tolerances=tolerances)
        report["check"]["ok"] = False
        print(f"check   FAILED against {what} ({_fmt_tolerances(tolerances)}): {err}",
              file=sys.stderr)
        return 1
    entry.update(ok=True, outputs=len(outputs), max_abs_error=max_abs, max_rel_error=max_rel,
                 tolerances=tolerances)
    rtol = min((r for r, _ in tolerances.values()), default=0.0)
    print(f"check   OK: {len(outputs)} outputs match {what} ({_errors(max_abs, max_rel, rtol)}; "
          f"{_fmt_tolerances(tolerances)})")
    return 0


def _errors(max_abs: float, max_rel: float, rtol: float) -> str:
    """The largest errors; a relative error above rtol is of an element near zero, which
    passes on atol (|ours - ref| <= atol + rtol |ref|): said, so the line does not read as a
    contradiction."""
    past = " (elements past rtol are near zero and pass on atol)" if max_rel > rtol else ""
    return f"max abs error {max_abs:.2e}, max rel error {max_rel:.2e}{past}"


def _fmt_tolerances(tolerances: dict) -> str:
    return "; ".join(f"{dtype} rtol {r:g}, atol {a:g}" for dtype, (r, a) in tolerances.items()) \
        or "no outputs"
