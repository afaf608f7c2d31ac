"""Swap planning from a model to a plan: the plans of fixed models, budgets and seeds equal, byte
for byte, those recorded in tests/data/swap_planning.json.

Each case plans as one of the callers does: the driver (the CLI, benchmarks/swap_offload.py),
SwapOffload planning on its own inside the pipeline (`pass`), and the GPU bundle (measured
kernel times are of the fused kernels, so no fission: `no_fission`). The record holds the plan
(all but its wall-clock planning time), the fissioned kernels, the sidecar, and digests of the
swap problem and of the module SwapOffload makes of the plan. The searches run to their
generation and convergence stops (a time budget far beyond them), so a seed gives one plan.

`python tests/test_swap_planning.py` writes the records again: only where a change of plans is
meant, and said so in the commit.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import tvm
from one_op import decoder_module

from tvm_ext import driver, pipeline
from tvm_ext.ir.pass_records import SWAP_PLAN_ATTR
from tvm_ext.models import get_model
from tvm_ext.models.optimizer import Optimizer, make_optimizer_step
from tvm_ext.passes import SwapOffload

LLVM = tvm.target.Target("llvm")
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "swap_planning.json")
SEARCH_S = 600.0  # never reached on these models: the search ends by its own stops

# name: (model, budget, hardware, planner, seed, reserved bytes, ways of planning)
CASES = {
    "mlp-tiny-50%": ("mlp-tiny", "50%", "h100", "swapadvisor", 0, 0,
                     ("driver", "pass")),
    "mlp-tiny-cpu-reserved": ("mlp-tiny", 6144, "cpu", "swapadvisor", 2, 1024, ("driver",)),
    "mlp-small-train-25%-lru": ("mlp-small-train", "25%", "h100", "lru", 0, 0, ("driver",)),
    "gpt-tiny-train-25%": ("gpt-tiny-train", "25%", "h100", "swapadvisor", 2, 0, ("driver",)),
    "gpt-tiny-train-min-checkpoint": ("gpt-tiny-train", "min", "cpu", "checkpoint", 0, 0,
                                      ("pass",)),
    "mlp-adamw-min": ("mlp-adamw", "min", "h100", "swapadvisor", 0, 0, ("driver",)),
    "decoder-min": ("decoder", "min", "cpu", "swapadvisor", 0, 0,
                    ("driver", "pass", "no_fission")),
    "decoder-below-fused-vdnn": ("decoder", 7167, "cpu", "vdnn", 0, 0, ("driver",)),
}


def _model(name: str):
    if name == "decoder":
        return decoder_module()
    if name == "mlp-adamw":
        return make_optimizer_step(get_model("mlp", "tiny", training=True), Optimizer("adamw"))
    model, size, *train = name.split("-")
    return get_model(model, size, training=bool(train))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _plan_record(plan) -> dict:
    data = plan.to_dict()
    del data["planning_time"]  # wall clock
    return data


def _sidecar(planning) -> dict:
    """The sidecar, its plan checked to be the plan and left out of the record."""
    data = planning.sidecar
    assert data.pop("plan") == planning.plan.to_dict()
    return data


def _swapped(fused: tvm.IRModule, swap: SwapOffload) -> str:
    """The module SwapOffload makes, as text, without the wall-clock planning time."""
    with LLVM:
        mod = swap(fused)
    main = mod["main"]
    summary = json.loads(main.attrs[SWAP_PLAN_ATTR])
    del summary["planning_time"]
    mod.update_func(mod.get_global_var("main"), main.with_attr(
        SWAP_PLAN_ATTR, json.dumps(summary, sort_keys=True)))
    return mod.script()


def _by_driver(model, budget, hardware, planner, seed, reserved) -> dict:
    planning = driver.plan_swap(model, LLVM, budget, hardware=hardware, planner=planner,
                                seed=seed, time_budget_s=SEARCH_S, reserved=reserved)
    fused = pipeline.fuse(model if isinstance(model, tvm.IRModule) else model.mod, LLVM)
    return {"plan": _plan_record(planning.plan), "fissioned": planning.fissioned,
            "sidecar": _sidecar(planning),
            "problem": _digest(json.dumps(planning.problem.to_dict(), sort_keys=True)),
            "module": _digest(_swapped(fused, SwapOffload(plan=planning.plan)))}


def _by_pass(model, budget, hardware, planner, seed, reserved) -> dict:
    fused = pipeline.fuse(model if isinstance(model, tvm.IRModule) else model.mod, LLVM)
    return {"module": _digest(_swapped(fused, SwapOffload(
        budget, hardware=hardware, planner=planner, time_budget_s=SEARCH_S, seed=seed,
        reserved_bytes=reserved)))}


def _without_fission(model, budget, hardware, planner, seed, reserved) -> dict:
    planning = driver.plan_swap(model, LLVM, budget, hardware=hardware, planner=planner,
                                seed=seed, time_budget_s=SEARCH_S, reserved=reserved,
                                fission=False, graph=driver.fused_graph(model, LLVM))
    return {"plan": _plan_record(planning.plan), "sidecar": _sidecar(planning),
            "problem": _digest(json.dumps(planning.problem.to_dict(), sort_keys=True))}


WAYS = {"driver": _by_driver, "pass": _by_pass, "no_fission": _without_fission}


def _record(case: str) -> dict:
    name, budget, hardware, planner, seed, reserved, ways = CASES[case]
    model = _model(name)
    return {way: WAYS[way](model, budget, hardware, planner, seed, reserved) for way in ways}


def _text(records: dict) -> str:
    return json.dumps(records, indent=1, sort_keys=True) + "\n"


def _recorded() -> dict:
    with open(DATA) as f:
        return json.load(f)


@pytest.mark.parametrize("case", sorted(CASES))
def test_plans_equal_the_recorded_ones(case):
    assert _text(_record(case)) == _text(_recorded()[case])


def test_the_cases_plan_what_they_are_for():
    """The records exercise what they stand for: a fissioned kernel, splits, recompute, an
    in-place update, swaps, a reserve taken off an absolute budget."""
    data = {case: ways.get("driver", {}).get("plan") for case, ways in _recorded().items()}
    fissioned = _recorded()["decoder-min"]
    assert fissioned["driver"]["fissioned"] and data["decoder-below-fused-vdnn"]["fissioned"]
    # Without fission the smallest budget is the fused kernel's, above the parts'.
    assert fissioned["no_fission"]["plan"]["budget"] > data["decoder-min"]["budget"]
    assert data["decoder-min"]["splits"] and data["gpt-tiny-train-25%"]["swap_outs"]
    assert data["gpt-tiny-train-25%"]["info"]["recomputed"]
    assert data["mlp-adamw-min"]["host_start"]  # parameters and state updated from the host
    assert data["mlp-tiny-cpu-reserved"]["budget"] == 6144 - 1024


def test_a_given_graph_and_the_phases_of_the_search():
    """The fused graph the CLI has already read plans as the model does (the kernel fissioned
    included); a SwapAdvisor plan comes with its search's swap-only phase before it."""
    model = _model("decoder")
    planning = driver.plan_swap(model, LLVM, "min", hardware="cpu", time_budget_s=SEARCH_S,
                                graph=driver.fused_graph(model, LLVM))
    recorded = _recorded()["decoder-min"]["driver"]
    assert _plan_record(planning.plan) == recorded["plan"]
    assert planning.fissioned == recorded["fissioned"]
    assert [p.planner for p in planning.phases] == ["swap_only", "swapadvisor"]
    assert planning.phases[-1] is planning.plan
    assert planning.ideal_time() <= planning.plan.predicted_time


if __name__ == "__main__":
    records = {case: _record(case) for case in sorted(CASES)}
    tmp = DATA + ".tmp"
    with open(tmp, "w") as f:
        f.write(_text(records))
    os.replace(tmp, DATA)
    print(f"wrote {DATA}")
