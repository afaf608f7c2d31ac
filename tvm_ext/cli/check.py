"""--check: the compiled module's outputs against a plain TVM build and against the source
framework (PyTorch, for a .pt2 model)."""

from __future__ import annotations

import os
import sys

from tvm_ext import driver
from tvm_ext.errors import CheckError
from tvm_ext.models import reference
from tvm_ext.models.reference import tolerance


def check_against_reference(args, report: dict, model, target, device, arguments, outputs,
                            what: str) -> int:
    """--check: `outputs` against a plain `tvm.compile` of the model run on `device` with the
    same `arguments`, and against PyTorch eager for a .pt2 model; the verdict goes into
    `report["check"]`. Returns the exit status."""
    # Two TVM builds may round a float16 / bfloat16 result differently by one step.
    low = [tolerance(o.dtype) for o in outputs if str(o.dtype) in ("float16", "bfloat16")]
    rtol = max([1e-5, *(t[0] for t in low)]) if args.rtol is None else args.rtol
    atol = max([1e-5, *(t[1] for t in low)]) if args.atol is None else args.atol
    reference = driver.build_reference(model, target)
    ref = driver.run(reference, arguments, device, repeat=0)
    try:
        check = driver.compare(outputs, ref.outputs, rtol, atol)
    except CheckError as err:
        report["check"] = {"ok": False, "reference": what, "rtol": rtol, "atol": atol,
                           "error": str(err)}
        print(f"check   FAILED against {what} (rtol {rtol:g}, atol {atol:g}): {err}",
              file=sys.stderr)
        status = 1
    else:
        report["check"] = {"ok": True, "reference": what, "rtol": rtol, "atol": atol,
                           **vars(check)}
        print(f"check   OK: {check.outputs} outputs match {what} (max abs error "
              f"{check.max_abs_error:.2e}, max rel error {check.max_rel_error:.2e}; rtol "
              f"{rtol:g}, atol {atol:g})")
        status = 0
    return max(status, check_against_torch(args, report, model, arguments, outputs))


def torch_file(model, spec: str) -> str | None:
    """The .pt2 file `model` was loaded from: PyTorch eager is then a second reference."""
    path = model.config.get("file") or spec
    return path if str(path).lower().endswith(".pt2") and os.path.isfile(path) else None


def check_against_torch(args, report: dict, model, arguments, outputs) -> int:
    """--check of a .pt2 model: `outputs` against the exported program run by PyTorch eager on
    the same inputs and weights, at the tolerance of each output's dtype (or --rtol/--atol).
    Returns the exit status; 0 where there is nothing to compare with."""
    path = torch_file(model, args.model)
    if path is None:
        return 0
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
            return 0
        if model.training:
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
        return 1
    tolerances = {}
    try:
        if stale:
            raise CheckError(
                f"the weights given to the module differ from {name}'s for "
                f"{', '.join(stale[:5])}{' ...' if len(stale) > 5 else ''}")
        if len(outputs) != len(expected):
            raise CheckError(f"{len(outputs)} outputs, {what} has {len(expected)}")
        max_abs = max_rel = 0.0
        for i, (out, exp) in enumerate(zip(outputs, expected, strict=True)):
            rtol, atol = reference.tolerance(out.dtype)
            rtol = rtol if args.rtol is None else args.rtol
            atol = atol if args.atol is None else args.atol
            tolerances[str(out.dtype)] = (rtol, atol)
            try:
                one = driver.compare([out], [exp], rtol, atol)
            except CheckError as err:
                raise CheckError(f"output {i}{str(err).removeprefix('output 0')}") \
                    from None
            max_abs, max_rel = max(max_abs, one.max_abs_error), max(max_rel, one.max_rel_error)
    except CheckError as err:
        entry.update(ok=False, error=str(err), tolerances=tolerances)
        report["check"]["ok"] = False
        print(f"check   FAILED against {what} ({_fmt_tolerances(tolerances)}): {err}",
              file=sys.stderr)
        return 1
    entry.update(ok=True, outputs=len(outputs), max_abs_error=max_abs, max_rel_error=max_rel,
                 tolerances=tolerances)
    print(f"check   OK: {len(outputs)} outputs match {what} (max abs error {max_abs:.2e}, "
          f"max rel error {max_rel:.2e}; {_fmt_tolerances(tolerances)})")
    return 0


def _fmt_tolerances(tolerances: dict) -> str:
    return "; ".join(f"{dtype} rtol {r:g}, atol {a:g}" for dtype, (r, a) in tolerances.items()) \
        or "no outputs"
