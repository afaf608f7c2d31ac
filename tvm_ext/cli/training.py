"""--optimizer: the compiled training iteration run for --steps steps on a fixed synthetic batch
(each step's loss, time and peak), and --check against as many steps of torch.optim."""

from __future__ import annotations

import sys

import numpy as np

from tvm_ext.driver import training
from tvm_ext.errors import CheckError, InputError
from tvm_ext.models.mixed_precision import low_precision_step
from tvm_ext.models.optimizer import Optimizer, make_optimizer_step
from tvm_ext.models.reference import OptimizerSteps, tolerance
from tvm_ext.units import format_size

from .check import largest_error, near_line, noise_verdict, torch_file, ulp_neighbours


def optimizer_of(args) -> Optimizer:
    """The optimizer the options describe (torch's defaults for what they leave out)."""
    options = {name: getattr(args, name) for name in ("lr", "momentum", "weight_decay",
                                                      "betas", "eps")
               if getattr(args, name) is not None}
    return Optimizer(args.optimizer, **options)


def with_optimizer(args, model, loss_scaled):
    """(the optimizer step of the training step `model` in --dtype, `model`), or None after
    printing why it cannot be built. `loss_scaled()` loads the model's training step with a
    loss scale input (for fp16)."""
    try:
        optimizer = optimizer_of(args)
        low = model if args.dtype != "fp16" else loss_scaled()
        step = make_optimizer_step(low_precision_step(low, args.dtype), optimizer)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return None
    precision = "" if args.dtype == "fp32" else (
        f"; GEMMs and convolutions in {args.dtype} (float32 accumulation, master weights "
        "and state" + (", dynamic loss scaling)" if args.dtype == "fp16" else ")"))
    print(f"train   {optimizer.describe()}: parameters and state updated in place, "
          f"{len(step.config['state'])} state tensors "
          f"({format_size(sum(s.nbytes for s in step.params[len(model.params):]))}){precision}")
    return step, model


def print_steps(results, what: str = "") -> None:
    """One line per step: loss, time, device peak (per worker when partitioned), host memory
    in use after it (when some arguments live there)."""
    for i, r in enumerate(results, start=1):
        peak = r.peak_bytes if isinstance(r.peak_bytes, list) else [r.peak_bytes]
        host = r.host_bytes if isinstance(r.host_bytes, list) else [r.host_bytes]
        line = (f"step {i:<3} loss {r.loss:.6f}  {r.seconds * 1e3:.3f} ms  peak "
                f"{', '.join(format_size(p) for p in peak)}{what}")
        if any(host):
            line += f"  host {', '.join(format_size(h) for h in host)}"
        print(line)
    first, last = results[0].loss, results[-1].loss
    verdict = "falls" if last < first else "does NOT fall"
    print(f"train   loss {verdict} from {first:.6f} to {last:.6f} over {len(results)} steps on a "
          f"fixed batch; median {np.median([r.seconds for r in results]) * 1e3:.3f} ms per step")


def step_report(results) -> dict:
    return {"losses": [r.loss for r in results], "seconds": [r.seconds for r in results],
            "peak_bytes": [r.peak_bytes for r in results],
            "host_bytes": [r.host_bytes for r in results],
            "loss_falls": results[-1].loss < results[0].loss}


def run_training(args, report: dict, step, gradient_model, session, target) -> int:
    """--run/--check of an optimizer step: --steps steps on one synthetic batch through
    `session` (a `TrainingSession` or `PartitionedTrainingSession`), then --check. The exit
    status."""
    batch = step.random_inputs(args.seed)
    results, trail = run_steps(session, batch, args)
    print_steps(results)
    report.setdefault("training", {}).update(step_report(results))
    if not args.check:
        return 0
    return check_training(args, report, step, gradient_model, target, batch, results,
                          session.parameters(), session.state(), trail=trail)


def _reference_gradient(args, step, gradient_model, target):
    """(gradient(params, batch) by torch.autograd (a .pt2 model) or by a plain TVM build of the
    training step (a zoo model); what that is, in words)."""
    path = torch_file(step, args.model)
    if path is not None:
        return training.torch_gradient(path, gradient_model), "PyTorch"
    return training.tvm_gradient(gradient_model, target), "a plain TVM build"


def reference_of(args, step, gradient_model, target, batch, steps: int):
    """(N steps of torch.optim from the same parameters on the same batch, with gradients by
    `_reference_gradient`; what that is, in words)."""
    gradient, what = _reference_gradient(args, step, gradient_model, target)
    ref = training.reference_steps(step, gradient, [batch] * steps,
                                   step.random_params(args.seed)[:len(gradient_model.params)])
    return ref, f"torch.optim with gradients by {what}"


# The most host memory the copies of the parameters and state after every step may take (a
# check of a model this large keeps no trail, and has no step-by-step judge).
TRAIL_BYTES = 2 << 30


def run_steps(session, batch, args) -> tuple[list, list | None]:
    """--steps steps of `session` on `batch`: the results, and with --check the parameters and
    state after each (for `check_training` to check the steps one by one; None without
    --check, or where they would take more than TRAIL_BYTES)."""
    results, trail = [], [] if args.check else None
    for _ in range(args.steps):
        results.append(session.step(batch))
        if trail is not None:
            trail.append((session.parameters(), session.state()))
            if len(trail) == 1 and args.steps * sum(
                    a.nbytes for a in (*trail[0][0], *trail[0][1])) > TRAIL_BYTES:
                trail = None
    return results, trail


# How far a low-precision loss curve may stray from the float32 one (relative, absolute), as
# measured on the zoo and the corpus over the first steps (see the README).
LOW_PRECISION_BOUND = {"bf16": (3e-2, 1e-3), "fp16": (1e-2, 1e-3)}


def _tolerance_of(step) -> tuple[float, float]:
    """The loosest of the float32 tolerance and those of the step's parameter dtypes (a
    float16 model's updates differ from torch.optim's by an ulp of float16)."""
    pairs = [tolerance(p.dtype) for p in step.params
             if str(p.dtype).startswith(("float", "bfloat"))]
    return max([(1e-4, 1e-5), *pairs])


def match_build(args, results, params, state, expected, build, reference, rtol, atol,
                gradient_model, batch, target=None, trail=None) -> training.TrainingCheck:
    """`results`, `params` and `state` against the same steps of another build (`expected`,
    the run of `build`, a TrainingSession) at rtol / atol, the elements whose gradient was
    rounding noise in `reference` (`reference_of`) held to their own bound: an Adam step turns
    such a gradient (a key bias's, exactly zero through softmax) into a step of lr of either
    sign, whichever way the two builds round it. Where they still differ, the steps pass if
    they are about as close to torch.optim in float64 as torch.optim's float32 steps are
    (`_within_float64_noise`), or, given `trail` (this build's values after each step) and the
    `target`, if each step matches torch.optim's step from this build's own values
    (`_step_by_step`: the two builds' steps parted as correct steps can); said. Raises
    CheckError."""
    alone = OptimizerSteps([r.loss for r in expected], build.parameters(), build.state(),
                           reference[0].noise)
    try:
        return training.compare_training([r.loss for r in results], params, state, alone,
                                         optimizer_of(args), rtol, atol)
    except CheckError as err:
        noise = _within_float64_noise(args, build.model, gradient_model, batch, results,
                                      params, state, reference[0], rtol, atol, alone)
        if noise is not None:
            print(_steps_noise_line("check   note:", err, noise))
            return _distances([r.loss for r in results], params, state, alone, rtol, atol)
        if trail is None:
            raise
        own_rtol, own_atol = _tolerance_of(build.model)
        stepwise = _step_by_step(args, build.model, gradient_model, target, batch, results,
                                 trail, own_rtol, own_atol)
        if not isinstance(stepwise, training.TrainingCheck):
            raise CheckError(f"{err}; {stepwise}") from err
        print(f"check   note: the steps part from the other build's ({err}), but each, taken "
              f"from this build's own parameters and state, matches the step torch.optim "
              f"takes from them (rtol {own_rtol:g}, atol {own_atol:g}): {_PARTING}")
        return stepwise


def check_training(args, report, step, gradient_model, target, batch, results, params,
                   state, reference=None, trail=None) -> int:
    """N steps against N steps of torch.optim (`reference_of`, or `reference` if given); in
    bf16 / fp16, the loss curve against torch.optim's float32 one. Float32 steps that stray
    from torch.optim's pass if they are rounding noise by float64 (`_within_float64_noise`),
    or if each step taken from this build's own parameters and state (`trail`, those after
    each step) matches torch.optim's step from them (`_step_by_step`)."""
    ref, what = reference or reference_of(args, step, gradient_model, target, batch,
                                          len(results))
    if args.dtype != "fp32":
        return _check_loss_curve(args, report, results, ref, what)
    rtol, atol = _tolerance_of(step)
    rtol = rtol if args.rtol is None else args.rtol
    atol = atol if args.atol is None else args.atol
    optimizer = optimizer_of(args)
    try:
        check = training.compare_training([r.loss for r in results], params, state, ref,
                                          optimizer, rtol, atol)
    except CheckError as err:
        noise = _within_float64_noise(args, step, gradient_model, batch, results, params,
                                      state, ref, rtol, atol)
        if noise is not None:
            report["check"] = {**report.get("check", {}), "ok": True, "reference": what,
                               "error": str(err), "rtol": rtol, "atol": atol, "noise": noise}
            print(_steps_noise_line(f"check   {what} differs", err, noise))
            return 0
        stepwise = None if trail is None else _step_by_step(
            args, step, gradient_model, target, batch, results, trail, rtol, atol)
        if isinstance(stepwise, training.TrainingCheck):
            report["check"] = {**report.get("check", {}), "ok": True, "reference": what,
                               "error": str(err), "step_by_step": vars(stepwise)}
            print(f"check   OK: each of {len(results)} steps, taken from this build's own "
                  f"parameters and state, matches the step {what} takes from them (losses within "
                  f"{stepwise.max_loss_error:.2e}, parameters {stepwise.max_param_error:.2e}, "
                  f"state {stepwise.max_state_error:.2e}; rtol {rtol:g}, atol {atol:g}); over "
                  f"{len(results)} steps the two part ({err}): "
                  f"{_PARTING}")
            return 0
        message = str(err) if stepwise is None else f"{err}; {stepwise}"
        report["check"] = {"ok": False, "reference": what, "error": message, "rtol": rtol,
                           "atol": atol}
        print(f"check   FAILED against {what} (rtol {rtol:g}, atol {atol:g}): {message}",
              file=sys.stderr)
        return 1
    entry = {"ok": True, "reference": what, **vars(check)}
    # Kept beside the other checks the report holds (e.g. against the unswapped build).
    report["check"] = {**report.get("check", {}), **entry, "torch": {
        **entry, "max_abs_error": max(check.max_loss_error, check.max_param_error,
                                      check.max_state_error)}}
    noise = (f"; {check.noise_elements} elements with rounding-noise gradients within "
             f"2 N lr" if check.noise_elements else "")
    print(f"check   OK: {check.steps} steps match {what} (losses within "
          f"{check.max_loss_error:.2e}, parameters {check.max_param_error:.2e}, state "
          f"{check.max_state_error:.2e}; rtol {rtol:g}, atol {atol:g}{noise})")
    return 0


def parted_line(steps: int, other: str, tail: str = "") -> str:
    """The check line of steps that match torch.optim's one by one but part from the `other`
    build's (`match_build` printed the note)."""
    return (f"check   OK: {steps} steps, each matching torch.optim's step from its own values, "
            f"though they part from the {other} build's (the note){tail}")


# Why correct steps part over several: the reason `_step_by_step` is asked.
_PARTING = ("an Adam step turns a gradient element of rounding-noise size into a step of up to "
            "lr, whichever way it rounds, and the next gradients feel those steps")


def _step_by_step(args, step, gradient_model, target, batch, results, trail, rtol: float,
                  atol: float) -> training.TrainingCheck | str:
    """Each step of this build from its own parameters and state before it (the start, then
    `trail`) against one torch.optim step from the same values: the TrainingCheck of all of
    them, or why one differs. Errors do not compound here, so a wrong gradient or update shows
    at the step it happens, while correct steps that part over several (`_PARTING`) pass; a
    step that misses rtol / atol passes if it is as close to the float64 step from the same
    values as torch.optim's float32 step is (`_within_float64_noise`)."""
    gradient, _ = _reference_gradient(args, step, gradient_model, target)
    optimizer = optimizer_of(args)
    params = step.random_params(args.seed)[:len(gradient_model.params)]
    state = None
    checks = []
    for k, (result, (after_params, after_state)) in enumerate(zip(results, trail,
                                                                  strict=True)):
        ref = training.reference_steps(step, gradient, [batch], params, state)
        try:
            checks.append(training.compare_training([result.loss], after_params, after_state,
                                                    ref, optimizer, rtol, atol))
        except CheckError as err:
            # One step can miss rtol by rounding alone (Inception v3's moments, at a loss
            # of 1e15): float64 decides, as for the steps from the start.
            noise = _within_float64_noise(args, step, gradient_model, batch, [result],
                                          after_params, after_state, ref, rtol, atol,
                                          start=(params, state), widen=True)
            if noise is None:
                return (f"step {k + 1} differs from torch.optim's step from the same values: "
                        f"{err}")
            print(_steps_noise_line(f"check   note: step {k + 1} from its own values", err,
                                    noise))
            checks.append(_distances([result.loss], after_params, after_state, ref, rtol,
                                     atol))
        params, state = after_params, after_state
    return training.TrainingCheck(
        len(checks), max(c.max_loss_error for c in checks),
        max(c.max_param_error for c in checks), max(c.max_state_error for c in checks),
        sum(c.noise_elements for c in checks), rtol, atol, step_by_step=True)


def _steps_noise_line(head: str, err, noise: dict) -> str:
    return (f"{head} ({err}), but these steps are as close to {noise['reference']} as "
            f"torch.optim's in float32 are{near_line(noise)} (max abs error "
            f"{noise['ours']:.2e} against {noise['torch']:.2e})")


def _distances(losses, params, state, steps: OptimizerSteps, rtol: float,
               atol: float) -> training.TrainingCheck:
    """The TrainingCheck of steps that passed by float64 rather than rtol / atol: their
    largest absolute differences from `steps`."""
    def largest(ours, theirs) -> float:
        return max((largest_error(a, b) for a, b in zip(ours, theirs, strict=True)),
                   default=0.0)

    return training.TrainingCheck(len(losses), largest([losses], [steps.losses]),
                                  largest(params, steps.params), largest(state, steps.state),
                                  0, rtol, atol)


def _within_float64_noise(args, step, gradient_model, batch, results, params, state, ref,
                          rtol: float, atol: float, against=None, start=None,
                          widen: bool = False) -> dict | None:
    """For float32 steps of a .pt2 model that miss rtol / atol against torch.optim's (`ref`),
    or against another build's steps (`against`, an OptimizerSteps): {"reference", "ours",
    "torch"} (largest absolute errors from the same steps taken in float64, gradients by
    torch.autograd in float64) where every loss curve, parameter and state tensor that misses
    is about as close to them as torch.optim's float32 steps are (`check.noise_verdict`);
    None otherwise. The steps start from the step's parameters and zero state, or from
    `start` (parameters, state). `widen`: that yardstick may be torch.optim's at parameters
    one rounding step away (`check.noise_verdict`'s neighbours); for one step only, as over
    several a neighbour's steps can part from float64's without bound (VGG's loss jumps from
    1.5 to 897 in a step) and would excuse anything."""
    path = torch_file(step, args.model)
    if path is None:
        return None
    start_params, start_state = start or (
        step.random_params(args.seed)[:len(gradient_model.params)], None)
    batches = [batch] * len(results)

    def steps_from(values, float64: bool):
        return training.reference_steps(
            step, training.torch_gradient(path, gradient_model, float64=float64), batches,
            _widened(values) if float64 else values,
            None if start_state is None else
            _widened(start_state) if float64 else start_state)

    def neighbours():
        for values in ulp_neighbours(start_params):
            yield (steps_tensors(steps_from(values, False)),
                   steps_tensors(steps_from(values, True)))

    try:
        exact = steps_from(start_params, True)
    except Exception:  # no float64 run: no second opinion
        return None
    optimizer = optimizer_of(args)
    bound = 2 * len(results) * optimizer.lr + atol
    compared = against or ref
    mine_params = []
    for p, r, mask in zip(params, compared.params, ref.noise, strict=True):
        if mask is not None and optimizer.kind in ("adam", "adamw"):
            # Held to their own bound by compare_training: an Adam step of either sign.
            near = mask & (np.abs(np.asarray(p, np.float64) - r) <= bound)
            p = np.where(near, r, p)
        mine_params.append(p)

    ours = [np.asarray([r.loss for r in results]), *mine_params, *state]
    return noise_verdict(ours, steps_tensors(compared), steps_tensors(ref),
                         steps_tensors(exact), [(rtol, atol)] * len(ours), "torch.optim in float64",
                         neighbours if widen else None)


def steps_tensors(steps) -> list:
    """The losses, parameters and state of OptimizerSteps, as `noise_verdict` compares them."""
    return [np.asarray(steps.losses), *steps.params, *steps.state]


def _widened(arrays) -> list:
    """Float32 arrays as float64 (the rest as they are), for the float64 reference steps."""
    return [np.asarray(a, np.float64) if np.asarray(a).dtype == np.float32 else a
            for a in arrays]


def _check_loss_curve(args, report, results, ref, what) -> int:
    """The low-precision losses within LOW_PRECISION_BOUND of the float32 reference's."""
    rtol, atol = LOW_PRECISION_BOUND[args.dtype]
    rtol = rtol if args.rtol is None else args.rtol
    atol = atol if args.atol is None else args.atol
    losses = np.array([r.loss for r in results])
    expected = np.array(ref.losses)
    deviation = float(np.max(np.abs(losses - expected) / np.maximum(np.abs(expected), 1e-12)))
    ok = bool(np.all(np.abs(losses - expected) <= atol + rtol * np.abs(expected)))
    entry = {"ok": ok, "reference": f"{what}, float32", "rtol": rtol, "atol": atol,
             "max_relative_deviation": deviation, "steps": len(results)}
    report["check"] = {**report.get("check", {}), **entry, "torch": {
        **entry, "max_abs_error": float(np.max(np.abs(losses - expected)))}}
    if not ok:
        print(f"check   FAILED: the {args.dtype} losses stray from the float32 curve of {what} "
              f"by up to {deviation:.2e} relative (rtol {rtol:g}, atol {atol:g})", file=sys.stderr)
        return 1
    print(f"check   OK: {len(results)} {args.dtype} losses track the float32 curve of {what} "
          f"(largest relative deviation {deviation:.2e}; rtol {rtol:g}, atol {atol:g})")
    return 0
