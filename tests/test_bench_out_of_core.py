"""benchmarks/out_of_core.py end to end at its quick size (a two-layer decoder of the Llama
structure): the AdamW step's graph is built once and kept, every planner is simulated per
budget, and the bounds hold."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import out_of_core


def test_quick_size_plans_every_budget_within_its_bounds(tmp_path, capsys):
    pytest.importorskip("transformers")
    graphs, output = tmp_path / "graphs", tmp_path / "out_of_core.json"
    argv = ["--size", "quick", "--dtypes", "fp32", "--ratios", "4", "--presets", "h100",
            "--time-budget", "1", "--graphs", str(graphs), "--output", str(output)]
    assert out_of_core.main(argv) == 0
    assert "graph built" in capsys.readouterr().err
    (row,) = json.loads(output.read_text())["cases"]
    assert row["budget"] <= row["no_swap_peak"] // 4 and row["ops"] > 50
    times = {name: p["time_s"] for name, p in row["planners"].items()}
    assert set(times) == set(out_of_core.PLANNERS)
    assert all(t >= times["ideal"] for t in times.values())
    assert times["swapadvisor"] <= times["swap_only"] * (1 + 1e-9)
    assert times["swapadvisor"] >= row["limit_recompute_s"] * (1 - 1e-9)
    assert row["planners"]["swapadvisor"]["predicted_peak"] <= row["budget"]
    # The unswapped step's time is the ideal: the budgeted build makes its attention's
    # probabilities again for the backward, so its own unswapped time is not below it.
    assert row["ideal_s"] <= times["ideal"] * (1 + 1e-9)
    # Both graphs kept (the budgeted and the unswapped build's): a second run plans without
    # exporting.
    assert len(list(graphs.iterdir())) == 2
    assert out_of_core.main(argv) == 0
    assert "graph built" not in capsys.readouterr().err
