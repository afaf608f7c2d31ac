"""A measured iteration as lanes (tvm_ext/swap/measured.py): events sorted into lanes, copy time
hidden under compute, and the comparison with a simulated iteration."""

from __future__ import annotations

import pytest
from swap_dags import hand_problem_and_plan

from tvm_ext.swap import simulate
from tvm_ext.swap.measured import Event, MeasuredTimeline, compare, hidden_fraction

MS = 1_000_000  # ns


def _events() -> list[Event]:
    """Kernel k0 [1, 3] ms, a swap-out of y [3, 6] on stream 0, the caller blocked on stream 0
    [5, 6], kernel k1 [6, 8], a swap-in [4, 7] on stream 1; builtins between them."""
    return [
        Event("call", "vm.builtin.alloc_tensor", 0, 1 * MS),
        Event("call", "k0", 1 * MS, 3 * MS),
        Event("copy", "y", 3 * MS, 6 * MS, stream=0, nbytes=256, enqueued_ns=3 * MS),
        Event("call", "tvm_ext.swap.wait", 5 * MS, 6 * MS),
        Event("wait", "", 5 * MS, 6 * MS, stream=0),
        Event("copy", "x", 4 * MS, 7 * MS, stream=1, nbytes=256, enqueued_ns=3 * MS),
        Event("call", "k1", 6 * MS, 8 * MS),
    ]


def test_events_go_to_their_lanes():
    tl = MeasuredTimeline.from_events(_events(), kernels={"k0", "k1"})
    assert tl.makespan == pytest.approx(8e-3)
    assert tl.lanes["compute"] == [("k0", 1e-3, 3e-3), ("k1", 6e-3, 8e-3)]
    assert tl.lanes["d2h"] == [("y", 3e-3, 6e-3)]
    assert tl.lanes["h2d"] == [("x", 4e-3, 7e-3)]
    assert tl.lanes["stall"] == [("d2h", 5e-3, 6e-3)]
    assert [n for n, _, _ in tl.lanes["other"]] == ["vm.builtin.alloc_tensor",
                                                    "tvm_ext.swap.wait"]
    assert tl.busy("compute") == pytest.approx(4e-3)


def test_hidden_fraction_is_copy_time_outside_stalls():
    """6 ms of copies (y [3, 6], x [4, 7]); the stall [5, 6] covers 1 ms of each: 4/6 hidden."""
    tl = MeasuredTimeline.from_events(_events(), kernels={"k0", "k1"})
    assert tl.hidden_fraction() == pytest.approx(4 / 6)
    assert hidden_fraction([], [(0, 1)]) == 1.0
    assert hidden_fraction([(0, 2)], [(0.5, 1), (0.8, 1.5)]) == pytest.approx(0.5)
    assert MeasuredTimeline.from_events([], kernels=()).makespan == 0.0


def test_compare_lines_up_simulated_and_measured():
    problem, plan = hand_problem_and_plan()
    sim = simulate(problem, plan)  # 4 s: op 1 stalls [1, 2] on y's swap-out [1, 2]
    s = 1_000_000_000
    measured = MeasuredTimeline.from_events([
        Event("call", "add_one", 0, 1 * s), Event("copy", "y", 1 * s, 2 * s, stream=0),
        Event("wait", "", 1 * s, 2 * s + s // 2, stream=0),
        Event("copy", "y", 2 * s, 3 * s, stream=1),
        Event("call", "double", 2 * s + s // 2, 3 * s + s // 2),
        Event("call", "add", 3 * s + s // 2, 5 * s)], kernels={"add_one", "double", "add"})
    cmp = compare(problem, plan, sim, measured)
    assert cmp["simulated_s"] == pytest.approx(4.0)
    assert cmp["measured_s"] == pytest.approx(5.0)
    assert cmp["error"] == pytest.approx(0.25)
    assert cmp["simulated_stall_s"] == pytest.approx(1.0)
    assert cmp["measured_stall_s"] == pytest.approx(1.5)
    assert cmp["simulated_compute_s"] == cmp["simulated_d2h_s"] * 3 == pytest.approx(3.0)
    # Simulated: y's swap-out [1, 2] lies in the stall, the swap-in [2, 3] does not.
    assert cmp["simulated_hidden"] == pytest.approx(0.5)
    assert cmp["measured_hidden"] == pytest.approx(0.5 / 2)
