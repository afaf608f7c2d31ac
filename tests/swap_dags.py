"""Random swap problems on small DAGs, and a hand-made plan with known times, for the swap
planner tests (no TVM involved)."""

from __future__ import annotations

import numpy as np

from tvm_ext.swap import Residency, SwapIn, SwapOut, SwapPlan, SwapProblem
from tvm_ext.swap.alignment import align


def random_problem(seed: int, num_ops: int = 8, num_args: int = 3, budget_frac: float = 0.5,
                   bandwidth: float = 1e3, training: bool = False) -> SwapProblem:
    """A DAG of `num_ops` ops, each making one tensor from up to three earlier tensors or
    arguments; budget = min + budget_frac * (no-swap peak - min). Sizes in 256-byte units,
    op durations around 1 s, links of `bandwidth` bytes/s."""
    rng = np.random.default_rng(seed)
    sizes = [align(int(rng.integers(1, 5)) * 256) for _ in range(num_args)]
    kinds = ["parameter"] * num_args
    producers = [-1] * num_args
    op_inputs, op_outputs, op_deps = [], [], []
    for op in range(num_ops):
        avail = list(range(len(sizes)))
        k = int(rng.integers(1, min(3, len(avail)) + 1))
        ins = sorted(set(int(x) for x in rng.choice(avail, size=k, replace=False)))
        out = len(sizes)
        sizes.append(int(rng.integers(1, 5)) * 256)
        kinds.append("activation")
        producers.append(op)
        op_inputs.append(ins)
        op_outputs.append([out])
        op_deps.append(sorted({producers[t] for t in ins if producers[t] >= 0}))
    n_t = len(sizes)
    phases = ["forward"] * num_ops
    if training:
        phases = ["forward"] * (num_ops // 2) + ["backward"] * (num_ops - num_ops // 2)
    used = {t for ins in op_inputs for t in ins}
    outputs = [t for t in range(num_args, n_t) if t not in used] or [n_t - 1]
    host_start = np.array([k == "parameter" for k in kinds])
    problem = SwapProblem(
        op_names=[f"op{i}" for i in range(num_ops)],
        durations=rng.uniform(0.5, 1.5, size=num_ops), op_deps=op_deps, op_inputs=op_inputs,
        op_outputs=op_outputs, op_scratch=[[] for _ in range(num_ops)], op_phases=phases,
        tensor_names=[f"t{i}" for i in range(n_t)], sizes=sizes, tensor_kinds=kinds,
        producers=producers, host_start=host_start, pinned=np.zeros(n_t, dtype=bool),
        outputs=outputs, budget=1 << 40, h2d_bandwidth=bandwidth, h2d_latency=0.01,
        d2h_bandwidth=bandwidth, d2h_latency=0.01, name=f"dag{seed}")
    low = problem.min_budget()[0]
    high = problem.no_swap_peak()
    return problem.with_budget(int(low + budget_frac * max(high - low, 0)))


def hand_problem_and_plan(copy_issue: float = 0.0, sync: float = 0.0):
    """y = x + 1, z = 2x, w = y + z; each op 1 s, each copy 1 s (256 bytes at 256 B/s).

    y is swapped out after op 0 and back in (to another window) for op 2; z overwrites y's
    window, so op 1 waits for y's swap-out, and so does the swap-in of y's own data.
    """
    problem = SwapProblem(
        op_names=["add_one", "double", "add"], durations=[1.0, 1.0, 1.0],
        op_deps=[[], [], [0, 1]], op_inputs=[[0], [0], [1, 2]], op_outputs=[[1], [2], [3]],
        op_scratch=[[], [], []], op_phases=["forward"] * 3, tensor_names=["x", "y", "z", "w"],
        sizes=[256] * 4, tensor_kinds=["input", "activation", "activation", "activation"],
        producers=[-1, 0, 1, 2], host_start=[True, False, False, False], pinned=[False] * 4,
        outputs=[3], budget=1024, h2d_bandwidth=256.0, h2d_latency=0.0, d2h_bandwidth=256.0,
        d2h_latency=0.0, copy_issue=copy_issue, sync_latency=sync)
    plan = SwapPlan(
        planner="hand", budget=1024, schedule=[0, 1, 2], pools=[768], size_classes=[],
        pinned=[0], host_start=[], outputs_on_host=[],
        residencies=[Residency(1, 0, 0, 256, 0, 0, "produced"),
                     Residency(2, 0, 0, 256, 1, 2, "produced", wait_swap_out=0),
                     Residency(1, 0, 256, 256, 1, 2, "swap_in", swap_in=0, wait_swap_out=0),
                     Residency(3, 0, 512, 256, 2, 2, "produced")],
        swap_outs=[SwapOut(1, 0, 256)], swap_ins=[SwapIn(1, 0, 2, 256, 2, wait_swap_out=0)],
        predicted_time=0.0, predicted_peak=1024)
    return problem, plan


def step_problem(names: list[str], ops: list[tuple], args: set[str], outputs: list[str],
                 kinds: list[str], phases: list[str], budget: int = 1 << 20,
                 sizes: list[int] | None = None) -> SwapProblem:
    """A hand-made step: `ops` as (name, inputs, outputs, tensors written in place) by tensor
    name, each op after the producers of its inputs and, where it writes a tensor in place,
    after every other reader of it; ops take 1 s, tensors 256 B unless `sizes` says, links
    move 256 B/s with no latency; `args` start on the host."""
    t = {n: i for i, n in enumerate(names)}
    producer = {o: i for i, (_, _, outs, _) in enumerate(ops) for o in outs}
    readers: dict[str, list[int]] = {}
    for i, (_, ins, _, _) in enumerate(ops):
        for x in ins:
            readers.setdefault(x, []).append(i)
    deps = [sorted({producer[x] for x in ins if x in producer}
                   | {r for w in writes for r in readers[w] if r != i})
            for i, (_, ins, _, writes) in enumerate(ops)]
    return SwapProblem(
        op_names=[o[0] for o in ops], durations=[1.0] * len(ops), op_deps=deps,
        op_inputs=[[t[x] for x in o[1]] for o in ops],
        op_outputs=[[t[x] for x in o[2]] for o in ops], op_scratch=[[] for _ in ops],
        op_phases=phases, tensor_names=names, sizes=sizes or [256] * len(names),
        tensor_kinds=kinds, producers=[producer.get(n, -1) for n in names],
        host_start=[n in args for n in names], pinned=[False] * len(names),
        outputs=[t[n] for n in outputs], budget=budget, h2d_bandwidth=256.0, h2d_latency=0.0,
        d2h_bandwidth=256.0, d2h_latency=0.0, op_writes=[[t[x] for x in o[3]] for o in ops])
