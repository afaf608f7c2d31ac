"""benchmarks/swap_measured.py's judgement of a run (the run itself is the benchmark's, on a
quiet machine): errors within 15%, planners ranked alike where the simulator tells them apart,
SwapAdvisor against the best baseline, infeasible pressures reported."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import swap_measured


def _row(planner: str, sim: float, meas: float, ratio: float = 4, exact: bool = True,
         agrees: bool = True) -> dict:
    return {"model": "m", "ratio": ratio, "planner": planner, "simulated_ms": sim,
            "measured_ms": meas, "error": meas / sim - 1, "simulated_pct_ideal": 100 * 5 / sim,
            "measured_pct_ideal": 100 * 5 / meas, "exact": exact, "agrees": agrees,
            "hidden_simulated": 0.5,
            "hidden_measured": 0.4, "swap_outs": 1, "swap_ins": 2,
            "run": {"mean_overshoot_us": 30.0}}


def test_summary_counts_errors_ranks_and_the_speedup():
    rows = [_row("swapadvisor", 10, 11), _row("vdnn", 20, 26), _row("lru", 20, 19),
            {"model": "m", "ratio": 12, "budget": 1, "infeasible": True}]
    lines = swap_measured.summarize(rows)
    assert lines[0] == "simulated vs measured within 15%: 2/3 (largest error 30.0%)"
    # vdnn and lru tie in the simulator: only their pairs with swapadvisor are ranked.
    assert lines[1].startswith("planners ranked alike measured and simulated: 2/2 pairs")
    assert "m at 4x: swapadvisor 45.5% of ideal measured (50.0% simulated), 1.73x the best " \
        "baseline measured" in lines
    assert lines[-1] == ("outputs exact: 3/3, within float tolerance (ops run in chunks that "
                         "round differently): 0, differing: 0")
    assert "infeasible" in swap_measured.format_row(rows[-1])
    assert swap_measured.format_row(rows[0]).split()[:6] == ["m", "4", "swapadvisor", "10.00",
                                                              "11.00", "+10.0%"]


def test_summary_of_a_misranked_case():
    lines = swap_measured.summarize([_row("swapadvisor", 10, 30), _row("lru", 20, 21)])
    assert lines[1].startswith("planners ranked alike measured and simulated: 0/1 pairs")


def test_chunked_ops_agree_within_tolerance_not_exactly():
    rows = [_row("swapadvisor", 10, 11, exact=False), _row("lru", 20, 21, exact=False,
                                                           agrees=False)]
    lines = swap_measured.summarize(rows)
    assert lines[-1] == ("outputs exact: 0/2, within float tolerance (ops run in chunks that "
                         "round differently): 1, differing: 1")
    assert swap_measured.format_row(rows[0]).split()[-1] == "tol"
    assert swap_measured.format_row(rows[1]).split()[-1] == "NO"


def test_rows_against_the_unswapped_run_beside_them():
    """The machine ran 10% slower than at calibration when the row was measured: the error
    against the plan simulated at that speed, % of ideal against the run beside it, ranking by
    slowdown."""
    a, b = _row("swapadvisor", 10, 11), _row("lru", 20, 21)
    a["base_ms"], b["base_ms"] = 5.5, 4.5
    swap_measured.beside(a, calibrated_ms=5.0, ideal_ms=5.0, simulated_at_speed_ms=11.0)
    swap_measured.beside(b, calibrated_ms=5.0, ideal_ms=5.0, simulated_at_speed_ms=18.0)
    assert a["speed"] == 1.1 and a["error_rescaled"] == 0.0
    assert a["measured_pct_ideal"] == 50.0 and a["simulated_pct_ideal"] == 50.0
    assert b["error_rescaled"] == 21 / 18 - 1
    lines = swap_measured.summarize([a, b])
    assert lines[1] == ("the same, simulated with the compute at the speed the unswapped run "
                        "beside each measured (err*): 1/2 (largest 16.7%; "
                        "speed 0.90-1.10x the calibration's)")
    # Slowdowns 2.0 and 4.67: ranked as simulated.
    assert lines[2].startswith("planners ranked alike measured and simulated: 1/1 pairs")
    assert swap_measured.format_row(a).split()[6:8] == ["5.50", "+0.0%"]


def test_a_plan_simulated_at_the_machines_speed_slows_its_compute_not_its_copies():
    """Compute twice as slow (ops 2 s, copies still 1 s): op 1 still waits for the swap-out,
    which now ends within op 0's time plus 1 s; the iteration gains the compute's 3 s."""
    from swap_dags import hand_problem_and_plan

    from tvm_ext.swap import simulate

    problem, plan = hand_problem_and_plan()
    assert simulate(problem, plan).makespan == pytest.approx(4.0)
    assert swap_measured.at_speed(problem, plan, 2.0) == pytest.approx(7e3)
    assert swap_measured.at_speed(problem, plan, 1.0) == pytest.approx(4e3)
