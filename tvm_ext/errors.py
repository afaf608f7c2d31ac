"""The errors tvm_ext raises, in four families a caller can tell apart:

- `InputError`: the input cannot be handled as given (a model, an option, a budget, a plan or a
  file); the message says what to change. Also a `ValueError`.
- `UnavailableError`: this machine lacks something the request needs (the runtime library, a
  CUDA driver, NCCL, a device to time on, an optional package: `MissingExtraError` names the
  pip extra that installs it). Also a `RuntimeError`.
- `RunError`: running a compiled module failed where it ran (a worker of a session, a copy
  stream); the message names where and why. Also a `RuntimeError`.
- `InternalError`: an invariant of tvm_ext itself is broken (a plan that breaks its own rules, a
  compiled module whose numbers differ from the reference): a bug to report. Also a
  `RuntimeError`.

Every one derives from `TvmExtError`.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class TvmExtError(Exception):
    """Base of every error tvm_ext raises on purpose."""


class InputError(TvmExtError, ValueError):
    """The input (model, option, budget, plan, file) cannot be handled as given."""


class UnavailableError(TvmExtError, RuntimeError):
    """Something the request needs is missing on this machine."""


class MissingExtraError(UnavailableError):
    """An optional package a feature needs is not installed; the message names its extra."""


# The pip extra (pyproject.toml's optional-dependencies) that installs each optional package.
EXTRA_OF = {"torch": "frontends", "onnx": "frontends", "onnxruntime": "frontends",
            "transformers": "test"}


def install_hint(package: str) -> str:
    extra = EXTRA_OF[package]
    return f"install the {extra} extra: pip install '.[{extra}]' in the tvm_ext checkout"


def require(package: str, feature: str) -> ModuleType:
    """`package` imported, or MissingExtraError: "<feature> needs <package> ...; install the
    <extra> extra ..."."""
    try:
        return importlib.import_module(package)
    except ImportError as err:
        raise MissingExtraError(f"{feature} needs {package}, which is not installed; "
                                f"{install_hint(package)}") from err


class RunError(TvmExtError, RuntimeError):
    """Running a compiled module failed on a device or a worker."""


class InternalError(TvmExtError, RuntimeError):
    """An invariant of tvm_ext is broken: a bug, not a problem with the input."""


class CheckError(InternalError):
    """A compiled module's outputs disagree with the reference beyond tolerance."""
