"""Wall-clock timing of calls that run asynchronously on a device."""

from __future__ import annotations

import time
from collections.abc import Callable


def time_calls(call: Callable[[], object], sync: Callable[[], object],
               repeat: int) -> list[float]:
    """Milliseconds of each of `repeat` calls of `call`, each waited for with `sync`."""
    latencies = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        sync()
        latencies.append((time.perf_counter() - start) * 1e3)
    return latencies
