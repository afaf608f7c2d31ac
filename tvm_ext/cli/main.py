"""scripts/compile.py: compile a model with the tvm_ext pipeline (see `--help`)."""

from __future__ import annotations

import os
import sys

from .args import (
    build_parser,
    directory_problem,
    output_path_problem,
    refuse_idle_options,
    values_that_look_negative,
)


def missing_extra(args) -> str | None:
    """What an option needs that the install lacks (the extra that has it), else None."""
    from tvm_ext.errors import MissingExtraError, require

    needs = []
    if args.check and args.optimizer:
        needs.append(("torch", "--check of training steps (against torch.optim)"))
    suffix = os.path.splitext(args.model)[1].lower()
    if suffix in (".pt2", ".onnx"):
        needs.append(("torch" if suffix == ".pt2" else "onnx", f"a {suffix} model"))
    for package, feature in needs:
        try:
            require(package, feature)
        except MissingExtraError as err:
            return str(err)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(values_that_look_negative(parser, sys.argv[1:] if argv is None
                                                       else argv))
    refuse_idle_options(parser, args)
    problem = output_path_problem(args)
    if problem is None and args.tune_db:
        problem = directory_problem("--tune-db", args.tune_db, "MetaSchedule's work dir")
    if problem is None and args.dump_dir:
        problem = directory_problem("--dump-dir", args.dump_dir, "the IR after each pass")
    if problem is None and args.devices is not None and args.devices < 1:
        problem = f"--devices takes a number of devices >= 1, got {args.devices}"
    if problem is None:
        problem = missing_extra(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    # TVM and the model load only once the arguments are valid: --help and argument errors
    # stay instant.
    from tvm_ext import interrupts

    from .job import compile_model
    from .tvm_log import logged_lines, tvm_log_captured

    with interrupts.ExitOnSignal(), tvm_log_captured(args.verbose) as log:
        status = compile_model(args)
        hidden = len(logged_lines(log))
    if status and hidden:
        print(f"note: TVM logged {hidden} lines that are not shown; --verbose shows them",
              file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
