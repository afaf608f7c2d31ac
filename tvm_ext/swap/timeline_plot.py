"""A picture of one swap plan: device memory over the simulated iteration against the budget,
and what each of the three streams (compute, device-to-host, host-to-device) does when; a
second run of an op (recompute) is drawn on the compute lane in its own colour."""

from __future__ import annotations

from .plan import SwapPlan
from .problem import SwapProblem
from .simulator import simulate


def plot_plan(problem: SwapProblem, plan: SwapPlan, path: str, title: str = "") -> str:
    """Write the PNG to `path` and return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sim = simulate(problem, plan)
    scale = 1e3  # milliseconds
    fig, (mem, streams) = plt.subplots(2, 1, figsize=(11, 5.5), sharex=True,
                                       gridspec_kw={"height_ratios": [3, 1.4]})
    mib = 2**20
    mem.step(sim.memory_times * scale, sim.memory_bytes / mib, where="post", color="tab:blue",
             label=f"device memory ({plan.planner})")
    mem.axhline(problem.budget / mib, color="tab:red", linestyle="--", label="budget")
    mem.axhline(problem.no_swap_peak() / mib, color="gray", linestyle=":",
                label="no-swap peak")
    mem.set_ylabel("MiB")
    mem.legend(loc="upper right", fontsize=8)
    mem.set_title(title or f"{problem.name}: {plan.planner}, predicted "
                  f"{plan.predicted_time * scale:.3f} ms, {plan.bytes_swapped / mib:.1f} MiB "
                  f"swapped")
    lanes = {"compute": (2, "tab:green"), "d2h": (1, "tab:orange"), "h2d": (0, "tab:purple")}
    seen: set[int] = set()
    again = []  # positions whose op ran before: recompute
    for i, op in enumerate(plan.schedule):
        if op in seen:
            again.append(i)
        seen.add(op)
    for name, events in sim.timelines(plan).items():
        y, color = lanes[name]
        redo = set(again) if name == "compute" else set()
        for keep, colour, label in ((False, color, None), (True, "tab:red", "recompute")):
            spans = [(s * scale, (e - s) * scale) for i, (_, s, e) in enumerate(events)
                     if e > s and (i in redo) == keep]
            if spans:
                streams.broken_barh(spans, (y - 0.35, 0.7), facecolors=colour, label=label)
    if again:
        streams.legend(loc="upper right", fontsize=8)
    streams.set_yticks([lane for lane, _ in lanes.values()], list(lanes))
    streams.set_xlabel("simulated time (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
