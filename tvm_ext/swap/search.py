"""The SwapAdvisor search: a genetic algorithm over (schedule, memory-policy knobs).

An individual is a topological op order, a memory layout, the knobs of the swap derivation
(`Knobs`: how evictions weigh link time, stalls and next-use distance, how much of the
budget small arguments kept on the device may hold and how much those whose copies no
schedule hides, and whether an argument updated in place is written back right after its
update) and a recompute choice: which candidate tensors
are dropped after their early uses and made again before their late ones (`recompute.py`)
instead of being kept or swapped. Its fitness is the simulated iteration
time of the plan the derivation gives it (`derive.Evaluator`). The layout is either
SwapAdvisor's, the object count of each size class (`counts`; a tensor occupies one object of
its class), or one arena carved per tensor at any aligned offset (`counts` None). Size classes
cannot reach budgets near the smallest feasible one (an op's tensors of one class need that
many objects at once, whatever the other classes hold), and the arena wins on every benchmark
case; both are searched and the faster plan is returned.

* Seeds: the IR's order, a memory-aware greedy order and an as-late-as-possible order, with a
  spread of knobs (a training step's also with its backward run as late as its uses allow,
  an optimizer step's with its updates run right after their gradients, both also with the
  arguments whose copies no schedule hides kept on the device, and the IR's with its
  write-backs held to the end), and
  size-class counts in proportion to each class's peak demand; no recompute, the tensors
  cheaper to recompute than to copy out and back, and sqrt(n) checkpointing, with their
  chain links (`recompute.py`).
* Crossover: order-preserving on the schedule (a prefix of parent A, then the remaining ops in
  parent B's order: the child stays topological), uniform on the knobs and recompute choices.
* Mutation: move an op to a legal slot (after its last producer, before its first consumer:
  the earliest, the latest or a random one), half of the time an op that stalled in the
  simulation (picked in proportion to its stall); perturb a knob multiplicatively, or
  redraw it (flip the write-back); move objects from one size class to another (repaired to
  each class's minimum and to the budget); flip a few recompute choices (favouring the
  tensors that free most bytes per second of recompute); a tensor turned on brings its chain
  links, and half of the time its inputs as big and cheaper to make again than to copy in.
* Elitism keeps the best individuals; every generation a few mutations of the best are tried
  and kept when better (local search).
* Stops at the generation limit, the time budget, or after `patience` generations without a
  relative improvement of 1e-4. Seeded and deterministic when the generation limit, not the
  clock, ends the search.
* A generation's children are scored on `workers` threads (the compiled derivation and
  simulation release the GIL), and an individual scored before (a clone, a crossover of a
  parent with itself) is not scored again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import _core
from .baselines import KEEP_CHOICES as BASELINE_KEEPS
from .derive import Evaluator, Knobs
from .orders import (
    as_late_as_possible_order,
    early_update_order,
    late_backward_order,
    memory_aware_order,
    successors,
)
from .plan import SwapPlan
from .problem import SwapProblem
from .recompute import MAX_CHAIN, candidates, chain_links, cheapest_sets, checkpoint_set
from .repeats import repeat_groups

_KEEP_CHOICES = (0.0, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
_EXPOSED_CHOICES = (0.0, 0.1, 0.25, 0.4, 0.5, 0.75)
_KNOB_RANGE = {"beta": (0.0, 3.0), "gamma": (0.0, 10.0), "delta": (0.0, 3.0)}


@dataclasses.dataclass
class SearchConfig:
    recompute: bool = True  # also choose tensors to make again (False: swap only)
    population: int = 16
    generations: int = 200
    time_budget_s: float = 30.0
    patience: int = 40
    elite: int = 2
    local_steps: int = 2  # mutations of the best tried per generation
    crossover_rate: float = 0.7
    order_mutation_rate: float = 0.3
    knob_mutation_rate: float = 0.8
    recompute_mutation_rate: float = 0.3
    # Of the order and recompute mutations, the share applied to every repeat of the op or
    # tensor mutated (`repeats.py`: the same op in each layer) rather than to it alone.
    tie_repeats: float = 0.0
    max_evaluations: int | None = None  # per phase; None: no limit
    workers: int | None = None  # threads scoring a generation; None: one per CPU, at most 8


@dataclasses.dataclass
class Individual:
    order: np.ndarray
    knobs: Knobs
    counts: np.ndarray | None = None  # objects per size class; None: one arena
    recompute: np.ndarray | None = None  # per candidate of the search: made again or not
    fitness: float = math.inf
    stalls: np.ndarray | None = None  # simulated wait before each position's op


# The share of a two-phase search's time budget its first (swap-only) phase takes.
FIRST_PHASE_SHARE = 0.3
# The share of the time budget left unsearched, so that the whole search ends within it.
RESERVE_SHARE = 0.03


def _workers(config: SearchConfig) -> int:
    if config.workers is not None:
        return max(int(config.workers), 1)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(min(cpus or 1, 8), 1)


class GeneticSearch:
    """The GA of the module docstring, for one problem."""

    def __init__(self, problem: SwapProblem, config: SearchConfig | None = None, seed: int = 0,
                 evaluator: Evaluator | None = None):
        self.problem = problem
        self.config = config or SearchConfig()
        self.rng = np.random.default_rng(seed)
        self.evaluator = evaluator or Evaluator(problem, "swapadvisor")
        self.population: list[Individual] = []
        self.preds = [np.array(sorted(set(d)), dtype=np.int64) for d in problem.op_deps]
        self.succs = [np.array(s, dtype=np.int64) for s in successors(problem)]
        self.history: list[float] = []
        # Best time found with each memory layout (inf: the layout cannot fit the budget).
        self.best_by_layout: dict[str, float] = {}
        self.workers = _workers(self.config)
        self._scored: dict[tuple, tuple[float, np.ndarray | None]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._deadline = math.inf
        self._first = 0  # evaluations before this run
        ir = np.asarray(problem.order, dtype=np.int64)
        self.candidates = candidates(problem, ir) if self.config.recompute else \
            np.zeros(0, dtype=np.int64)
        # Chain links are chosen with the second runs that read them, never on their own.
        self.links = chain_links(problem, ir, self.candidates)
        # Mutations favour candidates that free many bytes per second of recompute.
        value = problem.sizes[self.candidates] / np.maximum(
            problem.durations[np.asarray(problem.producers)[self.candidates]], 1e-12)
        value[self.links] = 0.0
        self.candidate_weights = value / value.sum() if value.sum() > 0 else value
        # Per candidate, among its producer's inputs: its chain links (made again with it or
        # kept for it), and the candidates at least half its size that are cheaper to make
        # again than to copy in (a tensor made again from an input as big as itself that must
        # be swapped in saves little link time; with that input made again too it does).
        index = {int(t): k for k, t in enumerate(self.candidates)}
        producers = np.asarray(problem.producers, dtype=np.int64)
        inputs = [[index[x] for x in problem.op_inputs[producers[t]] if x in index]
                  for t in self.candidates]
        self.link_inputs = [[x for x in xs if self.links[x]] for xs in inputs]
        cheap = problem.durations[producers[self.candidates]] < np.array(
            [problem.transfer_time(b, "h2d") for b in problem.sizes[self.candidates]])
        self.big_inputs = [
            [x for x in xs if not self.links[x] and cheap[x] and
             2 * problem.sizes[self.candidates[x]] >= problem.sizes[t]]
            for t, xs in zip(self.candidates, inputs, strict=True)]
        # The repeats of each op, and of each candidate (those its producer's repeats make).
        self.repeats = repeat_groups(problem)
        role = np.array([int(g[0]) for g in self.repeats], dtype=np.int64)
        cand_role = role[producers[self.candidates]] if len(self.candidates) else \
            np.zeros(0, dtype=np.int64)
        by_role: dict[int, list[int]] = {}
        for k, r in enumerate(cand_role.tolist()):
            by_role.setdefault(r, []).append(k)
        self.candidate_repeats = [np.asarray(by_role[r], dtype=np.int64)
                                  for r in cand_role.tolist()]

    def recomputed(self, ind: Individual) -> np.ndarray | None:
        """The tensors `ind` makes again."""
        return None if ind.recompute is None else self.candidates[ind.recompute]

    # ---------------------------------------------------------------- scoring
    def _evaluate(self, ind: Individual) -> Individual:
        return self._evaluate_all([ind])[0]

    def _evaluate_all(self, inds: list[Individual], until_spent: bool = False
                      ) -> list[Individual]:
        """Score `inds` in place on the thread pool; with `until_spent` those that would start
        once the run's time or evaluations are spent are left unscored (the first `workers`
        are scored in any case). Returns those scored, in order. Individuals alike (their
        `_prepare` keys) are scored once."""
        keys = [self._prepare(ind) for ind in inds]
        todo = list({key: (k, ind) for k, (key, ind) in enumerate(zip(keys, inds, strict=True))
                     if key is not None and key not in self._scored}.items())
        jobs = [(key, ind, until_spent and k >= self.workers) for key, (k, ind) in todo]
        if len(jobs) > 1 and self._pool is not None:
            list(self._pool.map(self._score, jobs))
        else:
            for job in jobs:
                self._score(job)
        done = []
        for key, ind in zip(keys, inds, strict=True):
            if key is not None:
                if key not in self._scored:
                    continue  # the budget ran out before it
                ind.fitness, ind.stalls = self._scored[key]
                layout = "arena" if ind.counts is None else "size_classes"
                self.best_by_layout[layout] = min(self.best_by_layout.get(layout, math.inf),
                                                  ind.fitness)
            done.append(ind)
        return done

    def _prepare(self, ind: Individual) -> tuple | None:
        """Repair `ind`'s size classes; its key, or None where it cannot be scored (its
        fitness then infinite)."""
        keep = (ind.knobs.keep, ind.knobs.keep_exposed)
        if ind.counts is not None and self.evaluator.splits(*keep).choice:
            ind.fitness = math.inf  # size classes hold no chunk buffers of split ops
            return None
        if ind.counts is not None:
            ind.counts = self.evaluator.repair(ind.counts, *keep)
            if ind.counts is None:  # this keep leaves too little room for size classes
                ind.fitness = math.inf
                return None
        return (ind.order.tobytes(), dataclasses.astuple(ind.knobs),
                None if ind.counts is None else np.asarray(ind.counts).tobytes(),
                None if ind.recompute is None else np.packbits(ind.recompute).tobytes())

    def _score(self, job: tuple[tuple, Individual, bool]) -> None:
        """Score one individual, unless `optional` and the run is spent."""
        key, ind, optional = job
        if optional and self._spent():
            return
        self._scored[key] = self.evaluator.score_with_stalls(ind.order, ind.knobs, ind.counts,
                                                             self.recomputed(ind))

    def _spent(self) -> bool:
        c = self.config
        return time.perf_counter() > self._deadline or (
            c.max_evaluations is not None and
            self.evaluator.evaluations - self._first >= c.max_evaluations)

    # ---------------------------------------------------------------- operators

    def _mutate_counts(self, counts: np.ndarray) -> np.ndarray:
        """Move memory between size classes: drop objects of one class, add objects of
        another with the bytes freed (`repair` restores the minimum and the budget)."""
        counts = counts.copy()
        sizes = self.evaluator.class_sizes
        a, b = self.rng.choice(len(counts), size=2, replace=len(counts) < 2)
        drop = int(self.rng.integers(1, max(int(counts[a]) // 4, 1) + 1))
        drop = min(drop, int(counts[a]))
        counts[a] -= drop
        counts[b] += drop * int(sizes[a]) // int(sizes[b])
        return counts

    def _mutate_recompute(self, mask: np.ndarray | None, tied: bool = False
                          ) -> np.ndarray | None:
        """Flip one to three candidates other than chain links, half of the time drawn by
        the bytes they free per second of recompute (`tied`: each with its repeats, set as
        it is set); a candidate turned on brings its chain (`close_chains`)."""
        own = np.nonzero(~self.links)[0]
        if not len(own):
            return mask
        mask = np.zeros(len(self.candidates), dtype=bool) if mask is None else mask.copy()
        flips = int(self.rng.integers(1, 4))
        weights = self.candidate_weights[own] if self.rng.random() < 0.5 else None
        picks = own[self.rng.choice(len(own), size=min(flips, len(own)), replace=False,
                                    p=weights)]
        if tied:
            for k in picks:
                mask[self.candidate_repeats[k]] = not mask[k]
            picks = np.unique(np.concatenate([self.candidate_repeats[k] for k in picks]))
        else:
            mask[picks] = ~mask[picks]
        return self.close_chains(mask, picks[mask[picks]], self.rng.random() < 0.5)

    def close_chains(self, mask: np.ndarray, roots=None, big: bool = False) -> np.ndarray:
        """`mask` with the chain links of its chosen candidates (or of `roots` only) chosen
        too, and with `big` their big cheap inputs (`big_inputs`), `MAX_CHAIN` levels deep."""
        mask = mask.copy()
        frontier = np.nonzero(mask)[0] if roots is None else np.asarray(roots, dtype=np.int64)
        for _ in range(MAX_CHAIN):
            grown = [x for k in frontier for x in (*self.link_inputs[k],
                                                   *(self.big_inputs[k] if big else ()))
                     if not mask[x]]
            if not grown:
                break
            mask[grown] = True
            frontier = np.unique(grown)
        return mask

    def _random_knobs(self) -> Knobs:
        r = self.rng
        return Knobs(beta=float(r.uniform(*_KNOB_RANGE["beta"])),
                     gamma=float(r.uniform(*_KNOB_RANGE["gamma"])),
                     delta=float(r.uniform(*_KNOB_RANGE["delta"])) * float(r.random() < 0.7),
                     keep=float(r.choice(_KEEP_CHOICES)), write_back=bool(r.random() < 0.75),
                     keep_exposed=float(r.choice(_EXPOSED_CHOICES)) * float(r.random() < 0.5))

    def _mutate_knobs(self, k: Knobs) -> Knobs:
        r = self.rng
        values = dataclasses.asdict(k)
        name = str(r.choice(["beta", "gamma", "delta", "keep", "write_back", "keep_exposed"]))
        if name == "write_back":
            values["write_back"] = not values["write_back"]
        elif name == "keep":
            values["keep"] = float(r.choice(_KEEP_CHOICES))
        elif name == "keep_exposed":
            values["keep_exposed"] = float(r.choice(_EXPOSED_CHOICES))
        elif r.random() < 0.15:
            values[name] = 0.0 if r.random() < 0.5 else float(r.uniform(*_KNOB_RANGE[name]))
        else:
            lo, hi = _KNOB_RANGE[name]
            base = values[name] if values[name] > 0 else 0.05 * hi
            values[name] = float(np.clip(base * math.exp(r.normal(0, 0.5)), lo, hi))
        return Knobs(**values)

    def _mutate_order(self, order: np.ndarray, stalls: np.ndarray | None = None,
                      tied: bool = False) -> np.ndarray:
        """Move one op to a slot between its last producer and first consumer (`tied`: each
        of its repeats too, to the same place in its own range)."""
        n = len(order)
        if n < 2:
            return order
        pos = np.empty(n, dtype=np.int64)
        pos[order] = np.arange(n)
        guided = stalls is not None and stalls.sum() > 0 and self.rng.random() < 0.5
        for _ in range(8):
            if guided:
                k = int(self.rng.choice(n, p=stalls / stalls.sum()))
            else:
                k = int(self.rng.integers(n))
            op = order[k]
            lo, hi = self._slots(pos, op, n)
            if hi > lo:
                break
        else:
            return order
        # As early as possible, as late as possible, or anywhere in between: the extremes
        # move e.g. a weight's transpose far from its use, to be swapped out and prefetched.
        roll = self.rng.random()
        target = lo if roll < 1 / 3 else hi if roll < 2 / 3 else int(self.rng.integers(lo, hi + 1))
        if not tied:
            return self._move(order, k, target)
        share = (target - lo) / (hi - lo)
        for other in self.repeats[op]:
            k = int(pos[other])
            lo, hi = self._slots(pos, other, n)
            if hi > lo:
                order = self._move(order, k, lo + round(share * (hi - lo)))
                pos[order] = np.arange(n)
        return order

    def _slots(self, pos: np.ndarray, op: int, n: int) -> tuple[int, int]:
        """The first and last positions `op` may move to (after its last producer, before
        its first consumer)."""
        lo = int(pos[self.preds[op]].max()) + 1 if len(self.preds[op]) else 0
        hi = int(pos[self.succs[op]].min()) - 1 if len(self.succs[op]) else n - 1
        return lo, hi

    @staticmethod
    def _move(order: np.ndarray, k: int, target: int) -> np.ndarray:
        """`order` with the op at position k moved to position `target`."""
        if target == k:
            return order
        return np.insert(np.delete(order, k), target, order[k]).astype(np.int64)

    def _crossover(self, a: Individual, b: Individual) -> Individual:
        n = len(a.order)
        cut = int(self.rng.integers(1, n)) if n > 1 else 0
        taken = np.zeros(n, dtype=bool)
        taken[a.order[:cut]] = True
        order = np.concatenate([a.order[:cut], b.order[~taken[b.order]]]).astype(np.int64)
        ka, kb = dataclasses.asdict(a.knobs), dataclasses.asdict(b.knobs)
        knobs = Knobs(**{f: (ka[f] if self.rng.random() < 0.5 else kb[f]) for f in ka})
        counts = a.counts
        if a.counts is not None and b.counts is not None:
            pick = self.rng.random(len(a.counts)) < 0.5
            counts = np.where(pick, a.counts, b.counts)
        masks = [m for m in (a.recompute, b.recompute) if m is not None]
        mask = masks[0] if len(masks) == 1 else None
        if len(masks) == 2:
            mask = np.where(self.rng.random(len(masks[0])) < 0.5, *masks)
        return Individual(order, knobs, counts, mask)

    def _tied(self) -> bool:
        """Whether the next mutation applies to the repeats too (`tie_repeats`)."""
        return self.config.tie_repeats > 0 and self.rng.random() < self.config.tie_repeats

    def _tournament(self, pop: list[Individual]) -> Individual:
        picks = self.rng.choice(len(pop), size=min(3, len(pop)), replace=False)
        return min((pop[i] for i in picks), key=lambda ind: ind.fitness)

    def _child(self, pop: list[Individual]) -> Individual:
        c = self.config
        a = self._tournament(pop)
        if self.rng.random() < c.crossover_rate:
            child = self._crossover(a, self._tournament(pop))
        else:
            child = Individual(a.order, a.knobs, a.counts, a.recompute)
        if self.rng.random() < c.recompute_mutation_rate:
            child.recompute = self._mutate_recompute(child.recompute, self._tied())
        if self.rng.random() < c.order_mutation_rate:
            child.order = self._mutate_order(child.order, a.stalls if child.order is a.order
                                             else None, self._tied())
        if self.rng.random() < c.knob_mutation_rate:
            child.knobs = self._mutate_knobs(child.knobs)
        if child.counts is not None and self.rng.random() < c.knob_mutation_rate:
            child.counts = self._mutate_counts(child.counts)
        return child

    # ---------------------------------------------------------------- the loop
    def seeds(self) -> list[Individual]:
        ir = np.asarray(self.problem.order, dtype=np.int64)
        mem = np.asarray(memory_aware_order(self.problem), dtype=np.int64)
        grid = [Knobs(), Knobs(0.1, 1.0, 0.01, 0.05), Knobs(0.5, 2.0, 0.1, 0.02),
                Knobs(0.0, 3.0, 1.0, 0.02), Knobs(0.2, 1.0, 0.0, 0.0), Knobs(1.0, 0.5, 0.5, 0.1),
                Knobs(0.2, 1.0, 0.01, 0.5), Knobs(0.2, 1.0, 0.01, 1.0)]
        alap = np.asarray(as_late_as_possible_order(self.problem), dtype=np.int64)
        # Reordered seeds, each with the first three knob settings and with a quarter of the
        # budget for small arguments (norm weights, the step count: each fetch costs a
        # latency, and an optimizer step's updates fetch them all), where the order differs
        # from the one it is made from (in addition to the population's other seeds):
        # - a training step's backward run as late as its uses allow: what its IR makes at
        #   the top of the backward (remade activations, attention probabilities) is made
        #   where it is read instead of crossing the link to wait there;
        # - an optimizer step's updates right after their gradients, so a gradient need not
        #   cross the link to wait for an update at the end of the iteration.
        reordered = [(late_backward_order(self.problem, ir), ir)]
        reordered += [(early_update_order(self.problem, base), base) for base in (ir, alap)]
        early = []
        for order, base in reordered:
            order = np.asarray(order, dtype=np.int64)
            if not np.array_equal(order, base):
                early += [Individual(order, k) for k in grid[:3]]
                early.append(Individual(order, dataclasses.replace(grid[1], keep=0.25)))
                # Arguments whose copies nothing can hide kept on the device instead.
                early += [Individual(order, dataclasses.replace(grid[1], keep_exposed=share))
                          for share in (0.25, 0.5)]
        if any(self.problem.op_writes or ()):
            # Updated arguments written back when evicted or at the end (the d2h stream
            # left to activations while the updates run) as well as right after their update.
            early += [Individual(ir, dataclasses.replace(k, write_back=False)) for k in grid[:2]]
        pop = [Individual(ir, k) for k in grid]
        pop += [Individual(mem, k) for k in grid[:2]]
        pop += [Individual(alap, k) for k in grid[1:3]]
        # SwapAdvisor's own layout: objects per size class, in proportion to demand.
        for k, spread in ((grid[1], 1.0), (grid[2], 0.5), (grid[0], 1.0)):
            counts = self.evaluator.initial_counts(k.keep, spread)
            if counts is not None:
                pop.append(Individual(ir, k, counts))
        # Recompute: the cheapest tensors to make again, and sqrt(n) checkpointing.
        for mask in self._recompute_masks(ir):
            pop.append(Individual(ir, grid[1], None, mask))
        while len(pop) < self.config.population:
            pop.append(Individual(ir if len(pop) % 2 else mem, self._random_knobs()))
        return early + pop[: max(self.config.population, 2)]

    def _recompute_masks(self, order: np.ndarray) -> list[np.ndarray]:
        """Seed recompute choices: the cheapest tensors per byte freed up to a few fractions
        of the compute time, and sqrt(n) checkpointing (nonempty ones only), with their chain
        links; the cheapest also with their big cheap inputs."""
        own = self.candidates[~self.links]
        cheapest = [np.isin(self.candidates, s) for s in cheapest_sets(self.problem, own)]
        linked = [self.close_chains(m) for m in cheapest]
        masks = [*linked, self.close_chains(
            np.isin(self.candidates, checkpoint_set(self.problem, order, own)))]
        big = [self.close_chains(m, big=True) for m in cheapest]
        masks += [b for b, m in zip(big, linked, strict=True) if (b != m).any()]
        return [m for m in masks if m.any()]

    def recompute_seeds(self, population: list[Individual]) -> list[Individual]:
        """A swap-only search's final `population` (already scored), and its two best with
        each seed recompute choice added, and the checkpoint baseline's plans."""
        seeds = [dataclasses.replace(ind) for ind in population]
        for lead in sorted(population, key=lambda ind: ind.fitness)[:2]:
            for mask in self._recompute_masks(lead.order):
                seeds.append(Individual(lead.order, lead.knobs, lead.counts, mask))
        return seeds + self._checkpoint_seeds()

    def _checkpoint_seeds(self) -> list[Individual]:
        """The `checkpoint` baseline's plans as individuals (sqrt(n) checkpointing in the IR
        order, each initial-residency choice): the search starts no worse than it, which on a
        link-bound step the swap-only population's orders can be."""
        if not len(self.candidates):
            return []
        ir = np.asarray(self.problem.order, dtype=np.int64)
        mask = np.isin(self.candidates, checkpoint_set(self.problem, ir, self.candidates))
        if not mask.any():
            return []
        return [Individual(ir, Knobs(keep=keep), None, mask.copy()) for keep in BASELINE_KEEPS]

    def run(self, seeds: list[Individual] | None = None, deadline: float | None = None
            ) -> Individual:
        """The best individual, from `seeds` (default `self.seeds()`; those already scored
        are not scored again), by `deadline` (a `time.perf_counter()` time; default the
        config's time budget from the first evaluation, which compiles the core when its
        on-disk cache is cold); the last population is left in `self.population`."""
        with (ThreadPoolExecutor(self.workers) if self.workers > 1
              else contextlib.nullcontext()) as pool:
            self._pool = pool
            try:
                return self._run(seeds, deadline)
            finally:
                self._pool = None

    def _run(self, seeds: list[Individual] | None, deadline: float | None) -> Individual:
        c = self.config
        seeds = self.seeds() if seeds is None else seeds
        self._first = self.evaluator.evaluations
        self._deadline = math.inf
        pop = [seeds[0] if math.isfinite(seeds[0].fitness) else self._evaluate(seeds[0])]
        self._deadline = time.perf_counter() + c.time_budget_s if deadline is None else deadline
        # Those scored already, and as many others as the budget allows (one batch at least).
        known = [math.isfinite(ind.fitness) for ind in seeds[1:]]
        scored = {id(ind) for ind in self._evaluate_all(
            [ind for ind, k in zip(seeds[1:], known, strict=True) if not k], until_spent=True)}
        pop += [ind for ind, k in zip(seeds[1:], known, strict=True) if k or id(ind) in scored]
        pop.sort(key=lambda ind: ind.fitness)
        best = pop[0]
        self.history = [best.fitness]
        stale = 0
        self.generations = 0
        for _gen in range(c.generations):
            if self._spent():
                break
            children = [dataclasses.replace(ind) for ind in pop[: c.elite]]
            children += self._evaluate_all([self._child(pop) for _ in range(len(pop) -
                                                                               len(children))],
                                           until_spent=True)
            # Local search on the best: keep a mutation of it when it is better.
            children.sort(key=lambda ind: ind.fitness)
            for _ in range(c.local_steps):
                if self._spent():
                    break
                lead = children[0]
                trial = Individual(lead.order, lead.knobs, lead.counts, lead.recompute)
                roll = self.rng.random()
                if trial.counts is not None and roll < 0.3:
                    trial.counts = self._mutate_counts(trial.counts)
                elif len(self.candidates) and roll < 0.45:
                    trial.recompute = self._mutate_recompute(trial.recompute, self._tied())
                elif roll < 0.65:
                    trial.knobs = self._mutate_knobs(trial.knobs)
                else:
                    trial.order = self._mutate_order(trial.order, lead.stalls, self._tied())
                self._evaluate(trial)
                if trial.fitness < lead.fitness:
                    children[0] = trial
            pop = sorted(children, key=lambda ind: ind.fitness)
            self.generations += 1
            if pop[0].fitness < best.fitness * (1 - 1e-4):
                stale = 0
            else:
                stale += 1
            if pop[0].fitness < best.fitness:
                best = pop[0]
            self.history.append(best.fitness)
            if stale >= c.patience:
                break
        self.population = pop
        return best


def swapadvisor(problem: SwapProblem, time_budget_s: float = 30.0, seed: int = 0,
                config: SearchConfig | None = None, recompute: bool = True,
                planner: str = "swapadvisor") -> SwapPlan:
    """The SwapAdvisor plan of `problem` (GA search, see the module docstring). With
    `recompute`, a second search starts from the swap-only search's last population and
    chooses tensors to recompute too; elitism keeps its best, so it is never slower than the
    swap-only plan (the same search, seed and budget as `recompute=False`)."""
    return swapadvisor_phases(problem, time_budget_s, seed, config, recompute, planner)[-1]


def swapadvisor_phases(problem: SwapProblem, time_budget_s: float = 30.0, seed: int = 0,
                       config: SearchConfig | None = None, recompute: bool = True,
                       planner: str = "swapadvisor") -> list[SwapPlan]:
    """The plan of each phase of one search: the swap-only plan (planner "swap_only"), and
    with `recompute` the plan of the second phase (`planner`), which starts from the first's
    last population and so is never slower.

    `time_budget_s` bounds the whole search: both phases with their seeding, and deriving
    the plans; the first phase takes `FIRST_PHASE_SHARE` of it when a second follows. It
    counts from the call, or where the compiled core is not loaded yet in this process, from
    the first evaluation (which compiles or loads it). The clock ends each phase, so two
    separate searches differ run to run: compare the phases of one search. Each plan's
    `planning_time` is the wall time from the call to that plan."""
    start = time.perf_counter()
    cold = not _core.derive.signatures
    config = dataclasses.replace(config or SearchConfig(), time_budget_s=time_budget_s)
    search = GeneticSearch(problem, dataclasses.replace(config, recompute=False), seed)
    more = GeneticSearch(problem, dataclasses.replace(config, recompute=True), seed,
                         search.evaluator) if recompute else None
    two = more is not None and len(more.candidates) > 0
    seeds = search.seeds()
    clock = time.perf_counter()
    search._evaluate(seeds[0])
    now = time.perf_counter()
    deadline = (now if cold else start) + time_budget_s
    # Deriving a plan costs about two evaluations, and a search may finish an evaluation
    # begun right before its deadline: the last phase ends in time for both, with a margin
    # for a busy machine.
    one = 0.0 if cold else now - clock
    end = deadline - one * (1 + 2 * (2 if two else 1)) - RESERVE_SHARE * time_budget_s
    best = search.run(seeds, now + FIRST_PHASE_SHARE * (end - now) if two else end)
    by_layout = dict(search.best_by_layout)
    plans = [_plan(search, best, planner if not recompute else "swap_only",
                   time.perf_counter() - start, search.generations, by_layout, seed)]
    if not recompute:
        return plans
    generations = search.generations
    if two:
        best = more.run(more.recompute_seeds(search.population), end)
        generations += more.generations
        for layout, t in more.best_by_layout.items():
            by_layout[layout] = min(t, by_layout.get(layout, math.inf))
        search = more
    plans.append(_plan(search, best, planner, time.perf_counter() - start, generations,
                       by_layout, seed))
    return plans


def _plan(search: GeneticSearch, best: Individual, planner: str, elapsed: float,
          generations: int, by_layout: dict, seed: int) -> SwapPlan:
    return search.evaluator.plan(
        best.order, best.knobs, planner, planning_time=elapsed,
        info={"generations": generations,
              "evaluations": search.evaluator.evaluations, "seed": seed,
              "recompute_candidates": len(search.candidates),
              "best_by_layout": {k: (v if math.isfinite(v) else None)
                                 for k, v in by_layout.items()}},
        counts=best.counts, recompute=search.recomputed(best))


__all__ = ["GeneticSearch", "Individual", "SearchConfig", "as_late_as_possible_order",
           "early_update_order", "late_backward_order", "memory_aware_order", "swapadvisor",
           "swapadvisor_phases"]
