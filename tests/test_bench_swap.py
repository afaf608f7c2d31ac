"""benchmarks/swap.py's account of where a plan's saved device bytes came from: swap,
recompute and splitting in time, each from the plan itself."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from test_swap_split import _chain

from tvm_ext.swap.derive import Evaluator, Knobs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import swap


def test_split_ops_count_their_streamed_bytes_less_their_chunk_buffers():
    p = _chain().with_budget(4352)  # op1 and op2 must run in chunks
    plan = Evaluator(p, "swapadvisor").plan(np.asarray(p.order), Knobs(keep=0.0), "swapadvisor")
    assert plan.splits
    shares = swap.freed_shares(plan, p)
    expected = sum(int(p.sizes[[*sp.cut_inputs, *sp.cut_outputs]].sum()) - sp.nbytes
                   for sp in plan.splits)
    assert shares["split_bytes"] == expected > 0
    total = shares["swap_bytes"] + shares["recompute_bytes"] + shares["split_bytes"]
    assert shares["split_share"] == expected / total
    whole = _chain(splits=False).with_budget(8192)  # fits whole: nothing split
    plan = Evaluator(whole, "swapadvisor").plan(np.asarray(whole.order), Knobs(keep=0.0),
                                                "swapadvisor")
    assert not plan.splits and swap.freed_shares(plan, whole)["split_bytes"] == 0
