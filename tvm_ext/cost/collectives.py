"""Bytes and time of the collectives a partitioned graph needs, over one group of p devices.

`nbytes` is the size of the whole tensor the group holds between them (the union of the
pieces). Bytes are those each device sends, so they set the time on a link of per-direction
bandwidth; ring algorithms (NCCL's for large messages):

| collective      | bytes per device      | steps   |
| --------------- | --------------------- | ------- |
| allreduce       | 2 (p - 1) / p * B     | 2 (p-1) |
| allgather       | (p - 1) / p * B       | p - 1   |
| reduce_scatter  | (p - 1) / p * B       | p - 1   |
| all_to_all      | (p - 1) / p^2 * B     | p - 1   |
| halo            | the halo rows' bytes  | 1 or 2  |
| slice           | 0 (local)             | 0       |

Time = steps * link latency + bytes / link bandwidth (the alpha-beta model).
"""

from __future__ import annotations

from .hardware import Link, get_link

COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "all_to_all", "halo", "slice")


def collective_bytes(kind: str, parts: int, nbytes: float) -> float:
    """Bytes each device sends for one collective over `parts` devices on `nbytes` of data
    (for `halo`, `nbytes` is already the halo)."""
    p = parts
    if p <= 1 or kind == "slice":
        return 0.0
    if kind == "allreduce":
        return 2.0 * (p - 1) / p * nbytes
    if kind in ("allgather", "reduce_scatter"):
        return (p - 1) / p * nbytes
    if kind == "all_to_all":
        return (p - 1) / (p * p) * nbytes
    if kind == "halo":
        return float(nbytes)
    raise ValueError(f"unknown collective {kind!r}; one of {', '.join(COLLECTIVES)}")


def collective_steps(kind: str, parts: int) -> int:
    """Message rounds (each pays the link latency once)."""
    p = parts
    if p <= 1 or kind == "slice":
        return 0
    if kind == "allreduce":
        return 2 * (p - 1)
    if kind == "halo":
        return 1 if p == 2 else 2
    if kind in ("allgather", "reduce_scatter", "all_to_all"):
        return p - 1
    raise ValueError(f"unknown collective {kind!r}; one of {', '.join(COLLECTIVES)}")


def collective_time(kind: str, parts: int, nbytes: float, link: str | Link) -> float:
    """Seconds for one collective on `link` (alpha-beta)."""
    link = get_link(link)
    sent = collective_bytes(kind, parts, nbytes)
    if sent <= 0:
        return 0.0
    return collective_steps(kind, parts) * link.latency + sent / link.bandwidth
