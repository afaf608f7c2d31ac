"""The record of a run of the bundle's checks: one entry per check, pass / fail / skipped with
its reason and its figures, written as one JSON. A check never stops the others: whatever it
raises is recorded as its failure."""

from __future__ import annotations

import dataclasses
import json
import os
import time
import traceback
from collections.abc import Callable

from ...errors import CheckError, UnavailableError

PASS, FAIL, SKIPPED = "pass", "fail", "skipped"


class Skip(UnavailableError):
    """Raised by a check that cannot run here; the message says why."""


class Failed(CheckError):
    """Raised by a check whose result is wrong; `data` keeps the figures it measured."""

    def __init__(self, reason: str, data: dict | None = None) -> None:
        super().__init__(reason)
        self.data = dict(data or {})


@dataclasses.dataclass
class Check:
    name: str
    status: str
    reason: str = ""
    seconds: float = 0.0
    data: dict = dataclasses.field(default_factory=dict)


class Report:
    """Runs checks in order within a time budget and keeps their verdicts."""

    def __init__(self, time_budget_s: float, log: Callable[[str], None] = print) -> None:
        self.start = time.perf_counter()
        self.time_budget_s = float(time_budget_s)
        self.checks: list[Check] = []
        self.log = log

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def run(self, name: str, func: Callable[..., dict | None], *args) -> Check:
        """Run `func(*args)`: the dict it returns is the data of a pass; `Skip` and `Failed`
        give the other verdicts; any other exception is a failure with its traceback."""
        if self.elapsed() > self.time_budget_s:
            return self.skip(name, f"time budget of {self.time_budget_s:.0f} s spent")
        start = time.perf_counter()
        try:
            check = Check(name, PASS, data=dict(func(*args) or {}))
        except Skip as err:
            check = Check(name, SKIPPED, str(err))
        except Failed as err:
            check = Check(name, FAIL, str(err), data=err.data)
        except Exception as err:  # a check must never stop the others
            tail = traceback.format_exc().strip().splitlines()[-12:]
            check = Check(name, FAIL, f"{type(err).__name__}: {err}".strip(),
                          data={"traceback": tail})
        check.seconds = time.perf_counter() - start
        return self._add(check)

    def skip(self, name: str, reason: str) -> Check:
        return self._add(Check(name, SKIPPED, reason))

    def _add(self, check: Check) -> Check:
        self.checks.append(check)
        line = f"{check.status:<7} {check.name}"
        if check.reason:
            line += f": {check.reason.splitlines()[0][:200]}"
        self.log(line + (f" ({check.seconds:.1f} s)" if check.seconds >= 0.05 else ""))
        return check

    def get(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)

    def summary(self) -> dict:
        counts = {PASS: 0, FAIL: 0, SKIPPED: 0}
        for c in self.checks:
            counts[c.status] += 1
        return {**counts, "seconds": round(self.elapsed(), 2)}

    def to_json(self) -> dict:
        return {"summary": self.summary(), "checks": [dataclasses.asdict(c) for c in self.checks]}


def write_json(path: str, data: dict) -> None:
    """Write whole or not at all (a temporary name, then a rename)."""
    path = os.path.abspath(path)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=_plain)
    os.replace(tmp, path)


def _plain(value):
    """numpy scalars and arrays in a JSON."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
