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


class TableTooLarge(RuntimeError):
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
    tables: dict[int, tuple[tuple[int, ...], np.ndarray]] = {}
    of_var: list[set[int]] = [set() for _ in range(n)]
    constant = 0.0
    for scope, table in factors:
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
            constant += float(table)
            continue
        fid = len(tables)
        tables[fid] = (scope, table)
        for v in scope:
            of_var[v].add(fid)
    next_id = len(tables)

    def weight(v: int) -> int:
        fids = of_var[v]
        if len(fids) == 1:
            return tables[next(iter(fids))][1].size
        neighbours = set()
        for f in fids:
            neighbours.update(tables[f][0])
        size = 1
        for u in neighbours:
            size *= domains[u]
        return size

    eliminated = np.zeros(n, dtype=bool)
    record: list[tuple[int, tuple[int, ...], np.ndarray | int]] = []
    forced = [int(v) for v in first]
    heap = [(weight(v), v) for v in range(n)]
    heapq.heapify(heap)
    while heap or forced:
        if forced:
            v = forced.pop(0)
            if eliminated[v] or weight(v) > max_table:
                continue
        else:
            w, v = heapq.heappop(heap)
            if eliminated[v]:
                continue
            current = weight(v)
            if current != w:
                heapq.heappush(heap, (current, v))
                continue
            if current > max_table:
                raise TableTooLarge(f"eliminating variable {v} needs a table of {current} "
                                    f"entries (limit {max_table})")
        eliminated[v] = True
        fids = list(of_var[v])
        scope = sorted({u for f in fids for u in tables[f][0]} - {v})
        full = [*scope, v]
        shape = [domains[u] for u in full]
        total = np.zeros(shape, dtype=np.float64)
        for f in fids:
            fscope, table = tables.pop(f)
            order = sorted(range(len(fscope)), key=lambda i: full.index(fscope[i]))
            view = table.transpose(order)
            expand = [1] * len(full)
            for i in order:
                expand[full.index(fscope[i])] = domains[fscope[i]]
            total = total + view.reshape(expand)
            for u in fscope:
                if u != v:
                    of_var[u].discard(f)
        of_var[v].clear()
        best = total.argmin(axis=-1)
        reduced = total.min(axis=-1)
        record.append((v, tuple(scope), best))
        if scope:
            tables[next_id] = (tuple(scope), reduced)
            for u in scope:
                of_var[u].add(next_id)
                heapq.heappush(heap, (weight(u), u))
            next_id += 1
        else:
            constant += float(reduced)
    value = [0] * n
    for v, scope, best in reversed(record):
        idx = tuple(value[u] for u in scope)
        value[v] = int(best[idx]) if scope else int(best)
    return value, constant
