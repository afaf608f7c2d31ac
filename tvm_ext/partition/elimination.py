"""Exact min-sum over discrete variables by variable elimination (non-serial dynamic programming).

Minimise `sum_f table_f[x_scope(f)]` over assignments x of variables with finite domains.
Eliminating a variable combines the factors that mention it into one table over its neighbours
and minimises it out (remembering the argmin); back-substitution in reverse order recovers an
optimal assignment. Tofu's dynamic program over BFS levels of a chain is the special case whose
elimination order follows the chain; here the order is chosen greedily (smallest resulting
table first, the min-weight heuristic), which keeps the tables of layered graphs (forward and
backward chains joined at every layer) small. The result is exact whatever the order; only
the time and memory depend on it, and `max_table` bounds them.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from ..errors import InputError


class TableTooLarge(InputError):
    """An elimination step would build a table above the limit."""


def minimize(
    domains: Sequence[int],
    factors: Sequence[tuple[Sequence[int], np.ndarray]],
    max_table: int = 1 << 24,
    first: Sequence[int] = (),
) -> tuple[list[int], float]:
    """An assignment minimising the sum of the factors, and its value.

    Args:
        domains: size of each variable's domain.
        factors: (scope, table) pairs; `table.shape == [domains[v] for v in scope]`, no variable
            twice in a scope.
        max_table: the largest intermediate table allowed (entries).
        first: variables to eliminate before the others, in this order (a coarsening: the
            factors around them merge into one); skipped when that would exceed `max_table`.
    """
    n = len(domains)
    graph = _FactorGraph(domains, factors)
    eliminated = np.zeros(n, dtype=bool)
    record: list[tuple[int, tuple[int, ...], np.ndarray | int]] = []
    forced = [int(v) for v in first]
    heap = [(graph.weight(v), v) for v in range(n)]
    heapq.heapify(heap)
    while (v := _next_variable(graph, heap, forced, eliminated, max_table)) is not None:
        eliminated[v] = True
        scope, best = graph.eliminate(v)
        record.append((v, scope, best))
        for u in scope:  # their factors merged: requeue them at their new weight
            heapq.heappush(heap, (graph.weight(u), u))
    return _back_substitute(n, record), graph.constant


class _FactorGraph:
    """The factors not yet eliminated, indexed by the variables they mention."""

    def __init__(self, domains: Sequence[int],
                 factors: Sequence[tuple[Sequence[int], np.ndarray]]):
        self.domains = domains
        self.tables: dict[int, tuple[tuple[int, ...], np.ndarray]] = {}
        self.of_var: list[set[int]] = [set() for _ in range(len(domains))]
        self.constant = 0.0  # the sum of the factors over no variable
        for scope, table in factors:
            self._add_input(scope, table)
        self.next_id = len(self.tables)

    def _add_input(self, scope: Sequence[int], table: np.ndarray) -> None:
        """Checks an input factor and adds it without its one-value variables."""
        domains = self.domains
        scope = tuple(int(v) for v in scope)
        table = np.asarray(table, dtype=np.float64)
        if table.shape != tuple(domains[v] for v in scope):
            raise ValueError(f"factor table shape {table.shape} does not match its scope "
                             f"{scope}")
        if len(set(scope)) != len(scope):
            raise ValueError(f"variable repeated in a factor scope {scope}")
        keep = [i for i, v in enumerate(scope) if domains[v] > 1]
        if len(keep) < len(scope):  # a one-value variable is no choice: index it out
            table = table.reshape([domains[v] for v in scope if domains[v] > 1])
            scope = tuple(scope[i] for i in keep)
        if not scope:
            self.constant += float(table)
            return
        fid = len(self.tables)
        self.tables[fid] = (scope, table)
        for v in scope:
            self.of_var[v].add(fid)

    def weight(self, v: int) -> int:
        """The number of entries of the table that eliminating `v` builds."""
        fids = self.of_var[v]
        if len(fids) == 1:
            return self.tables[next(iter(fids))][1].size
        neighbours = set()
        for f in fids:
            neighbours.update(self.tables[f][0])
        size = 1
        for u in neighbours:
            size *= self.domains[u]
        return size

    def eliminate(self, v: int) -> tuple[tuple[int, ...], np.ndarray]:
        """Minimises `v` out of its factors: (their other variables, the argmin over them)."""
        fids = list(self.of_var[v])
        scope = sorted({u for f in fids for u in self.tables[f][0]} - {v})
        total = self._combine(fids, [*scope, v])
        self.of_var[v].clear()
        best = total.argmin(axis=-1)
        reduced = total.min(axis=-1)
        if scope:
            self.tables[self.next_id] = (tuple(scope), reduced)
            for u in scope:
                self.of_var[u].add(self.next_id)
            self.next_id += 1
        else:
            self.constant += float(reduced)
        return tuple(scope), best

    def _combine(self, fids: list[int], full: list[int]) -> np.ndarray:
        """The sum of factors `fids`, removed from the graph, as one table over `full`."""
        v = full[-1]
        domains = self.domains
        total = np.zeros([domains[u] for u in full], dtype=np.float64)
        for f in fids:
            fscope, table = self.tables.pop(f)
            order = sorted(range(len(fscope)), key=lambda i: full.index(fscope[i]))
            view = table.transpose(order)
            expand = [1] * len(full)
            for i in order:
                expand[full.index(fscope[i])] = domains[fscope[i]]
            total = total + view.reshape(expand)
            for u in fscope:
                if u != v:
                    self.of_var[u].discard(f)
        return total


def _next_variable(graph: _FactorGraph, heap: list[tuple[int, int]], forced: list[int],
                   eliminated: np.ndarray, max_table: int) -> int | None:
    """The next variable to eliminate: a forced one that fits, else the lightest (None: done)."""
    while heap or forced:
        if forced:
            v = forced.pop(0)
            if eliminated[v] or graph.weight(v) > max_table:
                continue
            return v
        w, v = heapq.heappop(heap)
        if eliminated[v]:
            continue
        current = graph.weight(v)
        if current != w:  # a stale entry: the variable's tables changed since it was queued
            heapq.heappush(heap, (current, v))
            continue
        if current > max_table:
            raise TableTooLarge(f"eliminating variable {v} needs a table of {current} "
                                f"entries (limit {max_table})")
        return v
    return None


def _back_substitute(n: int, record: list[tuple[int, tuple[int, ...], np.ndarray | int]]
                     ) -> list[int]:
    """The optimal assignment, reading each argmin table in reverse elimination order."""
    value = [0] * n
    for v, scope, best in reversed(record):
        idx = tuple(value[u] for u in scope)
        value[v] = int(best[idx]) if scope else int(best)
    return value
