"""Collective cost formulas (tvm_ext.cost.collectives)."""

from __future__ import annotations

import pytest

from tvm_ext.cost import LINKS, collective_bytes, collective_steps, collective_time

MB = 1e6


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_ring_formulas(p):
    assert collective_bytes("allreduce", p, MB) == pytest.approx(2 * (p - 1) / p * MB)
    assert collective_bytes("allgather", p, MB) == pytest.approx((p - 1) / p * MB)
    assert collective_bytes("reduce_scatter", p, MB) == pytest.approx((p - 1) / p * MB)
    assert collective_bytes("all_to_all", p, MB) == pytest.approx((p - 1) / p ** 2 * MB)
    assert collective_steps("allreduce", p) == 2 * (p - 1)
    assert collective_steps("allgather", p) == p - 1


def test_time_is_latency_plus_bandwidth():
    link = LINKS["pcie"]
    t = collective_time("allgather", 4, 8 * MB, "pcie")
    assert t == pytest.approx(3 * link.latency + 6 * MB / link.bandwidth)
    assert collective_time("slice", 4, MB, link) == 0.0
    assert collective_bytes("allreduce", 1, MB) == 0.0


def test_unknown_collective():
    with pytest.raises(ValueError, match="unknown collective"):
        collective_bytes("broadcast_everything", 2, MB)
