"""The counters of the runtime library's CUDA graph builtins (src/graph/kernel_graphs.cc), for
this process: how often kernel regions were captured, replayed, captured again because an
argument moved, and turned to run without a graph."""

from __future__ import annotations

from .library import get_function

_FIELDS = ("captures", "replays", "recaptures", "direct")


def graph_stats() -> dict[str, int]:
    """{captures, replays, recaptures, direct} since the last `reset_graph_stats`."""
    return dict(zip(_FIELDS, (int(v) for v in get_function("tvm_ext.cuda_graph.stats")()),
                    strict=True))


def reset_graph_stats() -> None:
    get_function("tvm_ext.cuda_graph.reset_stats")()
