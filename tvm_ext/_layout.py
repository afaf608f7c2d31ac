"""Make `tvm_ext.passes` and `tvm_ext.schedules` importable from a source checkout.

The wheel installs the top-level folders `passes/` and `schedules/` as `tvm_ext/passes` and
`tvm_ext/schedules`. When `tvm_ext` is imported from the checkout instead (PYTHONPATH, or a
non-editable install run from the repository root, where the local folder shadows the installed
package), those folders are siblings of this package; this finder maps them in.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_SUBPACKAGES = ("passes", "schedules")


class _SiblingFinder(importlib.abc.MetaPathFinder):
    def __init__(self, root: str):
        self._root = root

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, name = fullname.partition(".")
        if prefix != "tvm_ext" or name not in _SUBPACKAGES:
            return None
        folder = os.path.join(self._root, name)
        init = os.path.join(folder, "__init__.py")
        if not os.path.isfile(init):
            return None
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=[folder]
        )


def install(package_dir: str) -> None:
    """Register the finder when the package runs from a checkout that lacks the subfolders."""
    if all(os.path.isdir(os.path.join(package_dir, name)) for name in _SUBPACKAGES):
        return  # installed wheel layout: nothing to map
    root = os.path.dirname(package_dir)
    if not any(isinstance(f, _SiblingFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SiblingFinder(root))

