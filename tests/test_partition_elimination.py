"""Variable elimination equals brute-force minimisation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tvm_ext.partition.elimination import TableTooLarge, minimize


def brute(domains, factors):
    best = np.inf
    for x in itertools.product(*(range(d) for d in domains)):
        best = min(best, sum(t[tuple(x[v] for v in scope)] for scope, t in factors))
    return best


def random_factors(rng, n, domains):
    factors = []
    for _ in range(int(rng.integers(0, 9))):
        size = int(rng.integers(1, min(n, 3) + 1))
        scope = [int(v) for v in rng.choice(n, size=size, replace=False)]
        factors.append((scope, rng.random([domains[v] for v in scope])))
    return factors


def test_minimize_equals_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(150):
        n = int(rng.integers(1, 7))
        domains = [int(d) for d in rng.integers(1, 4, size=n)]
        factors = random_factors(rng, n, domains)
        values, cost = minimize(domains, factors)
        assert cost == pytest.approx(brute(domains, factors), abs=1e-12)
        achieved = sum(t[tuple(values[v] for v in scope)] for scope, t in factors)
        assert achieved == pytest.approx(cost, abs=1e-12)


def test_forced_order_keeps_the_optimum():
    rng = np.random.default_rng(1)
    for _ in range(50):
        n = 6
        domains = [int(d) for d in rng.integers(2, 4, size=n)]
        factors = random_factors(rng, n, domains)
        _, free = minimize(domains, factors)
        _, forced = minimize(domains, factors, first=[3, 1])
        assert forced == pytest.approx(free, abs=1e-12)


def test_chain_is_linear():
    # A chain of 2000 variables: tables stay pairwise.
    n = 2000
    rng = np.random.default_rng(2)
    factors = [([i, i + 1], rng.random((4, 4))) for i in range(n - 1)]
    values, cost = minimize([4] * n, factors, max_table=16)
    assert len(values) == n and np.isfinite(cost)


def test_table_limit_and_bad_factors():
    clique = [([a, b], np.zeros((3, 3))) for a in range(5) for b in range(a + 1, 5)]
    with pytest.raises(TableTooLarge):
        minimize([3] * 5, clique, max_table=20)
    with pytest.raises(ValueError, match="shape"):
        minimize([2, 2], [([0, 1], np.zeros((2, 3)))])
    with pytest.raises(ValueError, match="repeated"):
        minimize([2], [([0, 0], np.zeros((2, 2)))])
