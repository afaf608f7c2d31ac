"""The Tofu search: coarsen, then dynamic programming level by level of the device mesh (no IR).

Formulation (objective in `model.py`): one variable per coarsened tensor group, its domain the
schemes legal at the level(s) being decided; one factor per operator, its table the least over
the operator's legal strategies of its kernel-internal allreduces + the conversions of all its
edges (+ tie-breaks), or, for an operator with many tensors, a variable for its strategy tied
to each tensor by a pairwise factor (`DENSE_TABLE`). The sum of the factors is minimised
exactly by variable elimination (`elimination.py`): Tofu's DP over BFS levels, with a better
elimination order.

* Coarsening: a parameter and its gradient share one layout (`tie_groups`: the optimizer update
  stays local); an element-wise chain becomes one operator (`chain_tensors`: the tensor between
  an op and its only, element-wise consumer is eliminated first, which merges their factors).
  Repeated layers give equal factor tables, computed once (`_factor` is memoised on the
  operator's signature and context). These keep the optimum. Tying each activation to its
  gradient, or all layers to one choice (Tofu's other coarsenings), would not (under
  partition-n-reduce a tensor tied to a replicated one pays an extra allgather), and
  elimination does not need them to stay fast.
* Recursion for k devices (`search`): k is factored into a mesh of levels (k = 8 -> 2 x 2 x 2,
  k = 6 -> 3 x 2, k = 5 -> 5), one p-way cut per level, outermost first (the slowest link when
  the links differ). Each level is solved with the levels above fixed and those below assumed to
  split everything evenly, as in Tofu's `cost(k) = onecut + 2 cost(k/2)`; then every level, and
  every pair of adjacent levels whose joint tables are small, is solved again with all the
  others fixed, under the exact costs, until nothing improves. `plan_partition` also refines
  the data-parallel plan this way and keeps the better result: with links of different speeds
  the level-by-level descent can stop in a worse local optimum.
* `solve(levels=all)` decides all levels jointly over tuple domains: the exact optimum of the
  uncoarsened problem, affordable on small graphs only.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from .elimination import TableTooLarge, minimize
from .layout import REP
from .model import PartitionModel

# An operator's factor is one dense table over its tensors when that table is at most this big;
# otherwise its strategy becomes a variable with one pairwise factor per tensor (a star), so
# that a fused kernel with many tensors never needs the product of all their domains.
DENSE_TABLE = 65536
# ... and has at most this many tensor axes: numpy arrays have at most 64 axes (32 before
# numpy 2), and a kernel can read more tensors than that whose domains are single layouts
# (RWKV's kernels over its per-step states read 75 and 90).
DENSE_TABLE_AXES = 31


class State:
    """A (partial) assignment: per tensor and per op, one choice per level (None: undecided)."""

    def __init__(self, model: PartitionModel):
        levels = model.levels
        self.layout: list[list[int | None]] = [[None] * levels for _ in model.graph.tensors]
        self.strategy: list[list[int | None]] = [[None] * levels for _ in model.graph.ops]
        for t, free in enumerate(model.free):
            if free:
                self.layout[t] = [REP] * levels
        # Tensors the search held at a fixed layout, its tables being too large otherwise
        # (`Searcher.solve_holding`).
        self.held: list[int] = []

    def copy(self) -> State:
        other = State.__new__(State)
        other.layout = [list(x) for x in self.layout]
        other.strategy = [list(x) for x in self.strategy]
        other.held = list(self.held)
        return other


def gradient_pairs(model: PartitionModel) -> list[tuple[int, int]]:
    """(parameter, gradient) tensor pairs of a training step `main(...) -> (loss, grads...)`."""
    g = model.graph
    params = sorted((t for t in g.tensors if t.kind == "parameter" and t.arg_index is not None),
                    key=lambda t: t.arg_index)
    outs = g.outputs
    if len(outs) != len(params) + 1 or g.tensors[outs[0]].shape != ():
        return []
    pairs = []
    for p, o in zip(params, outs[1:], strict=True):
        if g.tensors[o].shape != p.shape:
            return []
        pairs.append((p.id, o))
    return pairs


def tie_groups(model: PartitionModel) -> list[int]:
    """The group of each tensor (the tensors of a group share one layout): a parameter and its
    gradient; an argument and its in-place update (an optimizer step writes the new value into
    the argument's own buffer, so it has the argument's layout); -1 for constants."""
    g = model.graph
    group = list(range(len(g.tensors)))
    for p, grad in gradient_pairs(model):
        group[grad] = p
    for t in g.tensors:
        if t.overwrites is not None:
            group[t.id] = g.base(t.id)
    return [-1 if model.free[t] else group[t] for t in range(len(g.tensors))]


def chain_tensors(model: PartitionModel) -> list[int]:
    """Tensors inside element-wise chains: made by one op and read only by an element-wise op
    (same shape, every axis mapped to itself). Coarsening merges the two ops by eliminating the
    tensor between them first."""
    g = model.graph
    out = []
    for op in g.ops:
        edges = [e for e in model.edges[op.id] if not e.output]
        if len(edges) != 1 or len(op.outputs) != 1:
            continue
        x = g.tensors[edges[0].tensor]
        if (x.shape != g.tensors[op.outputs[0]].shape or x.is_output or len(x.consumers) != 1
                or x.producer is None):
            continue
        mapped = set()
        for dim in model.specs[op.id].dims:
            cut = dim.inputs[edges[0].position]
            if (dim.valid and not dim.inner and not dim.global_index and cut is not None
                    and not cut.halo and dim.outputs == [cut.axis]):
                mapped.add(cut.axis)
        if mapped == {a for a, n in enumerate(x.shape) if n > 1}:
            out.append(x.id)
    return out


class Searcher:
    """Solves one or more mesh levels of a `State` by variable elimination."""

    def __init__(self, model: PartitionModel, groups: Sequence[int],
                 fixed: dict[int, Sequence[int]] | None = None, max_table: int = 1 << 22,
                 coarsen: bool = True, fixed_ops: dict[int, Sequence[int]] | None = None):
        self.model = model
        self.fixed_ops = {o: tuple(s) for o, s in (fixed_ops or {}).items()}
        self.groups = list(groups)
        self.chains = chain_tensors(model) if coarsen else []
        self.members: dict[int, list[int]] = {}
        for t, gid in enumerate(self.groups):
            if gid >= 0:
                self.members.setdefault(gid, []).append(t)
        self.fixed = {}
        for t, layout in (fixed or {}).items():
            gid = self.groups[t]
            if gid >= 0:
                self.fixed[gid] = tuple(layout)
        self.max_table = max_table
        self._cache: dict = {}
        self.held: list[int] = []  # tie groups `solve_holding` fixed

    def solve_holding(self, state: State, levels: Sequence[int],
                      fallback: State | None = None) -> State:
        """`solve`; where an elimination table would exceed the limit, the tie groups read by
        the most ops (weights a model shares across its layers, which join every layer's
        factors into one table), the smallest first among equals, are held at their layout
        in `fallback` (replicated without one), twice as many each try, until it fits. The
        result's `held` lists their tensors."""
        model = self.model
        readers: dict[int, int] = {}
        while True:
            try:
                new = self.solve(state, levels)
                new.held = sorted({t for gid in self.held for t in self.members[gid]})
                return new
            except TableTooLarge:
                readers = readers or {
                    gid: len({op for t in ts for op in model.graph.tensors[t].consumers})
                    for gid, ts in self.members.items()}
                free = sorted((gid for gid in self.members if gid not in self.fixed),
                              key=lambda g: (-readers[g], int(sum(
                                  model.nbytes[t] for t in self.members[g]))))
                if not free or readers[free[0]] < 2:
                    raise
                for gid in free[:max(len(self.held), 1)]:
                    t = self.members[gid][0]
                    self.fixed[gid] = tuple(self._holding_layout(t, lvl, state, fallback)
                                            for lvl in range(model.levels))
                    self.held.append(gid)

    @staticmethod
    def _holding_layout(t: int, lvl: int, state: State, fallback: State | None) -> int:
        """Where `solve_holding` holds tensor `t` at level `lvl`: as decided already, else as
        in `fallback`, else replicated."""
        for source in (state, fallback):
            if source is not None and source.layout[t][lvl] is not None:
                return source.layout[t][lvl]
        return REP

    # ---------------------------------------------------------------- domains
    def domain(self, gid: int, levels: Sequence[int]) -> list[tuple[int, ...]]:
        shape_schemes = self.model.tensor_schemes[gid]
        per_level = []
        for lvl in levels:
            options = shape_schemes[lvl]
            if gid in self.fixed:
                options = [self.fixed[gid][lvl]]
            per_level.append(options)
        return list(itertools.product(*per_level))

    def strategies(self, op_id: int, levels: Sequence[int], state: State) -> list[tuple]:
        """Legal strategy tuples for `levels`; an op on the data path splits wherever it can."""
        model = self.model
        known = state.strategy[op_id]
        if op_id in self.fixed_ops:
            return [tuple(self.fixed_ops[op_id][lvl] for lvl in levels)]
        options = [model.op_dims[op_id][lvl] for lvl in levels]
        for must_split in (model.data_path[op_id], False):
            out = []
            per_level = [[d for d in dims if d != REP] or dims if must_split else dims
                         for dims in options]
            for combo in itertools.product(*per_level):
                full = list(known)
                for lvl, d in zip(levels, combo, strict=True):
                    full[lvl] = d
                if model.contiguous_ok(op_id, full):
                    out.append(combo)
            if out:
                return out
        return out

    # ---------------------------------------------------------------- one factor
    def _factor(self, op_id: int, levels: Sequence[int], state: State, var_of: dict,
                domains: dict):
        """(scope, table, strategies, c, per-edge cost matrices) of one operator."""
        model = self.model
        op = model.graph.ops[op_id]
        edges = model.edges[op_id]
        scope = []
        for e in edges:
            v = var_of[self.groups[e.tensor]]
            if v not in scope:
                scope.append(v)
        others = [m for m in range(model.levels) if m not in levels]
        key = (model.problem.op_spec[op_id], op.kind, op.flops, op.bytes_moved,
               tuple(levels), tuple(state.strategy[op_id][m] for m in others),
               tuple((model.nbytes[e.tensor], model.graph.tensors[e.tensor].shape, e.output,
                      e.position, scope.index(var_of[self.groups[e.tensor]]),
                      tuple(state.layout[e.tensor][m] for m in others)) for e in edges),
               tuple(tuple(domains[v]) for v in scope))
        hit = self._cache.get(key)
        if hit is not None:
            return (scope, *hit)
        strategies = self.strategies(op_id, levels, state)
        n_s = len(strategies)
        c = np.empty(n_s)
        full_strategies = []
        for i, s in enumerate(strategies):
            full = list(state.strategy[op_id])
            for lvl, d in zip(levels, s, strict=True):
                full[lvl] = d
            full_strategies.append(full)
            c[i] = model.op_cost(op_id, full)
        mats = [np.zeros((n_s, len(domains[v]))) for v in scope]
        for e in edges:
            j = scope.index(var_of[self.groups[e.tensor]])
            base = list(state.layout[e.tensor])
            for x, value in enumerate(domains[scope[j]]):
                layout = list(base)
                for lvl, sch in zip(levels, value, strict=True):
                    layout[lvl] = sch
                col = mats[j][:, x]
                for i, full in enumerate(full_strategies):
                    col[i] += model.edge_time(e, op_id, layout, full)
        table = None
        if len(scope) <= DENSE_TABLE_AXES and \
                n_s * int(np.prod([len(domains[v]) for v in scope])) <= DENSE_TABLE:
            total = c.reshape([n_s] + [1] * len(scope))
            for j, m in enumerate(mats):
                shape = [n_s] + [1] * len(scope)
                shape[j + 1] = m.shape[1]
                total = total + m.reshape(shape)
            table = total.min(axis=0)
        result = (table, strategies, c, mats)
        self._cache[key] = result
        return (scope, *result)

    # ---------------------------------------------------------------- solve
    def solve(self, state: State, levels: Sequence[int]) -> State:
        """Decide `levels` for every tensor and op, the other levels as `state` has them."""
        model = self.model
        levels = list(levels)
        gids = sorted(self.members)
        var_of = {gid: i for i, gid in enumerate(gids)}
        domains = {var_of[gid]: self.domain(gid, levels) for gid in gids}
        factors = []
        op_factors = []
        sizes = [len(domains[var_of[gid]]) for gid in gids]
        op_var: dict[int, int] = {}
        for op in model.graph.ops:
            scope, table, strategies, c, mats = self._factor(op.id, levels, state, var_of,
                                                             domains)
            op_factors.append((scope, strategies, c, mats))
            if table is not None:
                if scope:
                    factors.append((scope, table))
            else:  # a star: the op's strategy is a variable, each edge a pairwise factor
                op_var[op.id] = len(sizes)
                sizes.append(len(strategies))
                factors.append(([op_var[op.id]], c))
                factors += [([op_var[op.id], v], m) for v, m in zip(scope, mats, strict=True)]
        for gid in gids:  # bytes stored (a tie-break unless memory_weight is raised)
            v = var_of[gid]
            cost = np.zeros(len(domains[v]))
            for x, value in enumerate(domains[v]):
                for t in self.members[gid]:
                    layout = list(state.layout[t])
                    for lvl, sch in zip(levels, value, strict=True):
                        layout[lvl] = sch
                    cost[x] += model.memory_weight * model.stored_bytes(t, layout)
            factors.append(([v], cost))
        first = [var_of[self.groups[t]] for t in self.chains if self.groups[t] >= 0]
        values, self.value = minimize(sizes, factors, self.max_table, first)
        new = state.copy()
        for gid in gids:
            value = domains[var_of[gid]][values[var_of[gid]]]
            for t in self.members[gid]:
                for lvl, sch in zip(levels, value, strict=True):
                    new.layout[t][lvl] = sch
        for op, (scope, strategies, c, mats) in zip(model.graph.ops, op_factors, strict=True):
            if op.id in op_var:
                best = strategies[values[op_var[op.id]]]
            else:
                total = c.copy()
                for j, v in enumerate(scope):
                    total += mats[j][:, values[v]]
                best = strategies[int(np.argmin(total))]
            for lvl, d in zip(levels, best, strict=True):
                new.strategy[op.id][lvl] = d
        return new


def objective(model: PartitionModel, state: State) -> float:
    """The objective of a complete assignment (communication time and the tie-breaks)."""
    total = 0.0
    for op in model.graph.ops:
        strategy = state.strategy[op.id]
        total += model.op_cost(op.id, strategy)
        for e in model.edges[op.id]:
            total += model.edge_time(e, op.id, state.layout[e.tensor], strategy)
    for t in range(len(model.graph.tensors)):
        if not model.free[t]:
            total += model.memory_weight * model.stored_bytes(t, state.layout[t])
    return total


def search(model: PartitionModel, fixed: dict[int, Sequence[int]] | None = None,
           coarsen: bool = True, seeds: Sequence[State] = (), refine_rounds: int = 4,
           joint_budget: int = 300_000, max_table: int = 1 << 22) -> State:
    """Top-down, level by level; then refinement under the exact costs: each level, and each
    pair of adjacent levels jointly when that costs at most `joint_budget` edge evaluations,
    re-solved with the others fixed, until nothing improves. Complete `seeds` (a textbook plan)
    that start below the result are refined the same way; the best result wins. A level
    whose elimination needs a table above `max_table` entries holds its most shared tensors
    at the first seed's layouts (`Searcher.solve_holding`)."""
    searcher = Searcher(model, tie_groups(model), fixed, max_table, coarsen=coarsen)
    state = State(model)
    for level in range(model.levels):
        state = searcher.solve_holding(state, [level], seeds[0] if seeds else None)
    if model.levels == 1:
        return state
    windows = [[lvl] for lvl in range(model.levels)]
    windows += [[lvl, lvl + 1] for lvl in range(model.levels - 1)
                if work(model, [lvl, lvl + 1]) <= joint_budget]
    # The deepest level was solved last with every other level known: nothing to redo there
    # until another level changes.
    fresh = [w != [model.levels - 1] for w in windows]
    best, value = _refine(searcher, state, searcher.value, windows, refine_rounds, fresh)
    for seed in seeds:  # worth refining only if it starts below what we have
        start = objective(model, seed)
        if start < value:
            candidate, cost = _refine(searcher, seed, start, windows, refine_rounds,
                                      [True] * len(windows))
            if cost < value:
                best, value = candidate, cost
    return best


def _refine(searcher, state, value, windows, rounds, todo):
    """Re-solve the windows of levels whose context changed since they were last solved."""
    for _ in range(rounds):
        improved = False
        for i, levels in enumerate(windows):
            if not todo[i]:
                continue
            try:
                candidate = searcher.solve(state, levels)
            except TableTooLarge:
                continue
            todo[i] = False
            if searcher.value < value - 1e-12 * abs(value):
                state, value, improved = candidate, searcher.value, True
                todo = [j != i for j in range(len(windows))]
        if not improved:
            break
    return state, value


def work(model: PartitionModel, levels: Sequence[int]) -> int:
    """Edge evaluations a solve of `levels` needs (strategies x layouts, summed over edges)."""
    total = 0
    for op in model.graph.ops:
        n_s = int(np.prod([len(model.op_dims[op.id][lvl]) for lvl in levels]))
        for e in model.edges[op.id]:
            total += n_s * int(np.prod([len(model.tensor_schemes[e.tensor][lvl])
                                        for lvl in levels]))
    return total


def solve_exact(model: PartitionModel, max_table: int = 1 << 22, max_work: int = 20_000_000,
                fixed: dict[int, Sequence[int]] | None = None) -> State:
    """The optimum over all levels jointly, without coarsening. Raises `TableTooLarge` when
    the problem is too big for it (more than `max_work` edge evaluations, or an elimination
    table above `max_table` entries)."""
    needed = work(model, range(model.levels))
    if needed > max_work:
        raise TableTooLarge(f"the joint problem needs {needed} edge evaluations (limit "
                            f"{max_work})")
    searcher = Searcher(model, tie_groups(model), fixed, max_table, coarsen=False)
    return searcher.solve(State(model), list(range(model.levels)))
