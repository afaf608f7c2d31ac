"""Every error tvm_ext defines belongs to one family under `TvmExtError`: bad input, something
missing on this machine, a failure where a module ran, or a broken invariant of tvm_ext."""

from __future__ import annotations

import importlib
import inspect

import pytest
from test_layers import MODULES

from tvm_ext.errors import InputError, InternalError, RunError, TvmExtError, UnavailableError
from tvm_ext.swap import InfeasibleBudgetError, PlanError

FAMILIES = (InputError, UnavailableError, RunError, InternalError)


def _defined_errors() -> list[type]:
    found = []
    for name in sorted(MODULES):
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == name and issubclass(cls, BaseException) \
                    and not cls.__name__.startswith("_"):
                found.append(cls)
    return found


def test_every_public_error_is_in_a_family():
    errors = _defined_errors()
    assert len(errors) >= 15, [e.__name__ for e in errors]
    orphans = [f"{e.__module__}.{e.__name__}" for e in errors
               if e not in (TvmExtError, *FAMILIES) and not issubclass(e, FAMILIES)]
    assert not orphans, orphans


def test_families_keep_their_builtin_bases():
    """`except ValueError` around a bad budget keeps working; a broken plan is not an assert."""
    with pytest.raises(ValueError):
        raise InfeasibleBudgetError(1, 2, "op")
    assert issubclass(PlanError, InternalError) and not issubclass(PlanError, AssertionError)
    assert issubclass(UnavailableError, RuntimeError)


def test_a_missing_optional_package_names_its_extra(monkeypatch):
    import sys

    from tvm_ext.errors import MissingExtraError, UnavailableError, require
    from tvm_ext.models import reference

    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(MissingExtraError, match=r"comparing with PyTorch needs torch.*frontends"):
        reference.torch_reference("m.pt2", [])
    assert issubclass(MissingExtraError, UnavailableError)
    assert require("json", "reading JSON").loads("1") == 1
