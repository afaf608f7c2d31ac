"""Import TVM's tensor intrinsics (`tvm.s_tir.tensor_intrin`) in seconds rather than minutes.

MetaSchedule's TuneContext imports that package, which parses about 250 TVMScript functions.
TVMScript's `prim_func` calls `inspect.stack()` for each, which reads the source line of every
frame on the stack; for a frame of the import machinery ("<frozen importlib._bootstrap>", a
file that does not exist) `inspect.getmodule` scans all of `sys.modules`. That is ~24 s in a
fresh process and over 100 s in one that has loaded torch under a deep stack (a test run).
TVMScript reads only the frames themselves and the code context of the few frames nearest its
caller, so during the import `inspect.stack` gives full frame records for those and bare ones
(no source context) for the rest. The swap is process-wide for that one import (seconds, once
per process): another thread's `inspect.stack` meanwhile gets the same frames, with less context.
"""

from __future__ import annotations

import contextlib
import inspect
import sys

_FULL_FRAMES = 4  # TVMScript reads the code context of stack()[2] (the decorator's line)


def _stack(context: int = 1) -> list[inspect.FrameInfo]:
    frame = sys._getframe(1)
    records = []
    while frame is not None:
        if len(records) < _FULL_FRAMES:
            records.append(inspect.FrameInfo(frame, *inspect.getframeinfo(frame, context)))
        else:
            records.append(inspect.FrameInfo(frame, frame.f_code.co_filename, frame.f_lineno,
                                             frame.f_code.co_name, None, None))
        frame = frame.f_back
    return records


@contextlib.contextmanager
def _cheap_stack():
    saved = inspect.stack
    inspect.stack = _stack
    try:
        yield
    finally:
        inspect.stack = saved


def import_tensor_intrinsics() -> None:
    """Import `tvm.s_tir.tensor_intrin` (once per process) with the cheap stack above."""
    if "tvm.s_tir.tensor_intrin" in sys.modules:
        return
    with _cheap_stack():
        import tvm.s_tir.tensor_intrin  # noqa: F401
