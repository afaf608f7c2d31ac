"""Byte sizes as users write them (`512MiB`, `4GB`, `1.5 GiB`, `1048576`, or `25%` of a
reference size such as the no-swap peak) and as reports print them; JSON of plain data."""

from __future__ import annotations

import re

import numpy as np

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
    "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, reference: int | None = None) -> int:
    """Bytes from `text`; a percentage needs `reference` (what 100% is)."""
    if isinstance(text, int):
        if text <= 0:
            raise ValueError(f"a size must be positive, got {text}")
        return text
    s = str(text).strip()
    if s.endswith("%"):
        if reference is None:
            raise ValueError(f"{text!r} is a percentage, but there is nothing it is a "
                             "percentage of here")
        try:
            pct = float(s[:-1])
        except ValueError:
            raise ValueError(f"cannot read {text!r} as a percentage") from None
        if not 0 < pct <= 100:
            raise ValueError(f"{text!r}: a percentage must be in (0, 100]")
        return max(1, int(reference * pct / 100))
    match = _PATTERN.match(s)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: write e.g. 512MiB, 4GB, 1048576 "
                         "or 25%")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < 1:
        raise ValueError(f"a size must be at least one byte, got {text!r}")
    return int(value)


def format_size(nbytes: float, digits: int = 1) -> str:
    """`nbytes` in the largest binary unit it reaches ("1.5 MiB"; whole bytes below 1 KiB)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.{digits}f} {unit}"
    return f"{int(nbytes)} B"


def json_default(obj):
    """`json.dump(..., default=json_default)`: numpy scalars as numbers, anything else as its
    string."""
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    return str(obj)
