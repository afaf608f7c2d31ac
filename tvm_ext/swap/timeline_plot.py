"""Pictures of swap plans: device memory over the simulated iteration against the budget, and
what each of the three streams (compute, device-to-host, host-to-device) does when (a second
run of an op, recompute, and an op run in chunks, each in its own colour on the compute lane);
and the stream lanes of a simulated and a measured iteration one above the other, on one time
axis."""

from __future__ import annotations

from collections.abc import Sequence

from .plan import SwapPlan
from .problem import SwapProblem
from .simulator import simulate

_LANES = {"compute": (3, "tab:green"), "d2h": (2, "tab:orange"), "h2d": (1, "tab:purple"),
          "stall": (0, "tab:red")}
_MS = 1e3  # seconds to milliseconds


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _draw_lanes(ax, lanes: dict, names: Sequence[str]) -> None:
    """One row per lane of (label, start s, end s) spans, the first name on top."""
    rows = {name: (len(names) - 1 - i, _LANES[name][1]) for i, name in enumerate(names)}
    for name, (y, color) in rows.items():
        spans = [(s * _MS, (e - s) * _MS) for _, s, e in lanes.get(name, []) if e > s]
        if spans:
            ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=color)
    ax.set_yticks([y for y, _ in rows.values()], list(rows))


def marked_spans(plan: SwapPlan, compute: list) -> dict[str, list[tuple[float, float]]]:
    """The compute lane's spans (start s, end s) of work the plan adds beyond running each op
    once whole: "recompute" (a second run of an op) and "split" (an op run in chunks)."""
    split = {sp.op for sp in plan.splits}
    seen: set[int] = set()
    marked: dict[str, list[tuple[float, float]]] = {"recompute": [], "split": []}
    for op, (_, s, e) in zip(plan.schedule, compute, strict=True):
        if e > s:
            if op in seen:
                marked["recompute"].append((s, e))
            elif op in split:
                marked["split"].append((s, e))
        seen.add(op)
    return marked


_MARKS = {"recompute": "tab:red", "split": "tab:cyan"}


def _draw_marked(ax, plan: SwapPlan, compute: list, row: int) -> None:
    """Over the compute lane (at `row`), recomputed and split work in their own colours."""
    drawn = False
    for name, spans in marked_spans(plan, compute).items():
        if spans:
            ax.broken_barh([(s * _MS, (e - s) * _MS) for s, e in spans], (row - 0.35, 0.7),
                           facecolors=_MARKS[name], label=name)
            drawn = True
    if drawn:
        ax.legend(loc="upper right", fontsize=8)


def plot_plan(problem: SwapProblem, plan: SwapPlan, path: str, title: str = "") -> str:
    """Write the PNG to `path` and return it."""
    plt = _pyplot()
    sim = simulate(problem, plan)
    fig, (mem, streams) = plt.subplots(2, 1, figsize=(11, 5.5), sharex=True,
                                       gridspec_kw={"height_ratios": [3, 1.4]})
    mib = 2**20
    mem.step(sim.memory_times * _MS, sim.memory_bytes / mib, where="post", color="tab:blue",
             label=f"device memory ({plan.planner})")
    mem.axhline(problem.budget / mib, color="tab:red", linestyle="--", label="budget")
    mem.axhline(problem.no_swap_peak() / mib, color="gray", linestyle=":",
                label="no-swap peak")
    mem.set_ylabel("MiB")
    mem.legend(loc="upper right", fontsize=8)
    mem.set_title(title or f"{problem.name}: {plan.planner}, predicted "
                  f"{plan.predicted_time * _MS:.3f} ms, {plan.bytes_swapped / mib:.1f} MiB "
                  f"swapped")
    tl = sim.timelines(plan)
    _draw_lanes(streams, tl, ("compute", "d2h", "h2d"))
    _draw_marked(streams, plan, tl["compute"], row=2)
    streams.set_xlabel("simulated time (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_timelines(path: str, panels: Sequence[tuple[str, dict]], title: str = "") -> str:
    """One panel per (title, lanes) (lanes as `tvm_ext.swap.measured` gives them: "compute",
    "d2h", "h2d", "stall"), stacked on one time axis; writes the PNG to `path`."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 1.6 + 1.5 * len(panels)),
                             sharex=True, squeeze=False)
    for ax, (name, lanes) in zip(axes[:, 0], panels, strict=True):
        _draw_lanes(ax, lanes, ("compute", "d2h", "h2d", "stall"))
        ax.set_title(name, fontsize=9)
    axes[-1, 0].set_xlabel("time (ms)")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
