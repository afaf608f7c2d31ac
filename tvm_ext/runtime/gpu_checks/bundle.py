"""The layout of a GPU bundle, read by the checks that run from it and written by
`tvm_ext.driver.gpu_bundle` (one definition for both sides).

    BUNDLE/run_gpu_checks.py          the one entry script
    BUNDLE/manifest.json              what was built, how, and the sha256 of every artefact
    BUNDLE/site/                      TVM's runtime, tvm-ffi, tvm_ext's runtime (no compiler)
    BUNDLE/artifacts/<suite>/...      per suite ("cuda": the GPU checks; "llvm": the CPU
                                      self-check): exported modules with their sidecars, and
                                      arrays.npz (inputs and expected outputs computed on the
                                      machine that built the bundle)
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

FORMAT = 1
MANIFEST = "manifest.json"
ENTRY = "run_gpu_checks.py"
SITE = "site"
ARTIFACTS = "artifacts"
ARRAYS = "arrays.npz"
SUITES = ("cuda", "llvm")  # the GPU checks; the CPU self-check (same code, CPU stand-in)


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Bundle:
    """A bundle directory and its manifest."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        path = os.path.join(self.root, MANIFEST)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{self.root} is not a GPU bundle: no {MANIFEST}")
        with open(path) as f:
            self.manifest = json.load(f)
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{path}: bundle format {self.manifest.get('format')}, these checks "
                             f"read format {FORMAT}: rebuild the bundle")
        self._arrays: dict[str, np.lib.npyio.NpzFile] = {}

    def path(self, relative: str) -> str:
        return os.path.join(self.root, relative)

    def suite(self, name: str) -> dict | None:
        return self.manifest.get("suites", {}).get(name)

    def arrays(self, suite: str, keys: list[str]) -> list[np.ndarray]:
        """Arrays of a suite's arrays.npz, by key (inputs and expected outputs)."""
        if suite not in self._arrays:
            self._arrays[suite] = np.load(self.path(f"{ARTIFACTS}/{suite}/{ARRAYS}"))
        data = self._arrays[suite]
        return [data[k] for k in keys]

    def verify(self) -> dict[str, list[str]]:
        """Artefacts missing or changed since the bundle was built (by sha256)."""
        missing, changed = [], []
        for relative, digest in sorted(self.manifest.get("files", {}).items()):
            path = self.path(relative)
            if not os.path.isfile(path):
                missing.append(relative)
            elif sha256(path) != digest:
                changed.append(relative)
        return {"missing": missing, "changed": changed}
