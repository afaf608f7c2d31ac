"""PartitionPlan: closed-form bytes, JSON (and plans saved before), memory accounting,
entry-point errors."""

from __future__ import annotations

import json
import pathlib

import pytest

from tvm_ext.driver import partition_problem as analyze
from tvm_ext.models import get_model
from tvm_ext.partition import (
    NotApplicable,
    PartitionPlan,
    TableTooLarge,
    make_model,
    plan_partition,
)
from tvm_ext.partition.layout import Step
from tvm_ext.partition.plan import (
    InnerStep,
    InputConversion,
    OpPlacement,
    OutputConversion,
    TensorPlacement,
    layouts_of,
)

# A plan as `to_json` wrote it: mlp tiny inference (batch 8, widths 512), megatron over a
# 2 x 2 mesh (pcie, nvlink); it has inner allreduces and steps on both levels.
SAVED = pathlib.Path(__file__).parent / "data" / "partition_plan.json"


@pytest.fixture(scope="module")
def mlp():
    return analyze(get_model("mlp", "tiny", training=True, batch=8))


@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_data_parallel_bytes_closed_form(mlp, k):
    # Ring allreduce of every gradient, 2 (k-1)/k of its bytes per device, plus the three
    # scalars the loss and its gradient sum over the batch (two in nll_loss, one in its
    # backward): 2 (k-1)/k (sum of parameter bytes + 3 * 4).
    if 8 % k:
        with pytest.raises(NotApplicable, match="batch"):
            plan_partition(mlp, k, strategy="data_parallel")
        return
    params = sum(t.nbytes for t in mlp.graph.tensors if t.kind == "parameter")
    plan = plan_partition(mlp, k, strategy="data_parallel")
    assert plan.bytes_per_device == pytest.approx(2 * (k - 1) / k * (params + 3 * 4))
    assert set(plan.collectives) == {"allreduce"}


def test_steps_add_up_and_json_round_trips(mlp):
    plan = plan_partition(mlp, 4)
    steps = [s for o in plan.ops for e in [*o.inputs, *o.outputs] for s in e.steps]
    steps += [s for o in plan.ops for s in o.inner]
    assert sum(s.bytes for s in steps) == pytest.approx(plan.bytes_per_device)
    assert sum(s.time for s in steps) == pytest.approx(plan.comm_time)
    again = PartitionPlan.from_json(plan.to_json())
    assert again == plan
    assert again.to_dict() == json.loads(plan.to_json())
    assert again.to_json() == plan.to_json()
    assert again.summary()["bytes_per_device"] == plan.bytes_per_device
    # Every op of the plan names its dims and every tensor its per-level layout.
    assert all(len(o.strategy) == 2 == len(o.dims) for o in plan.ops)
    assert all(len(t.layout) == 2 for t in plan.tensors)


def test_memory_accounting(mlp):
    single = plan_partition(mlp, 1)
    assert single.bytes_per_device == 0 and single.peak_bytes_per_device == \
        single.single_device_peak
    for k in (2, 4):
        plan = plan_partition(mlp, k)
        assert plan.peak_bytes_per_device <= plan.memory_bound
        assert plan.memory_ratio <= 1.0
        assert plan.peak_bytes_per_device < plan.single_device_peak


def test_steps_run_in_phase_order(mlp):
    order = {"slice": 0, "reduce_scatter": 0, "all_to_all": 1, "allreduce": 1, "halo": 1,
             "allgather": 2}
    plan = plan_partition(mlp, 8)
    for o in plan.ops:
        for e in [*o.inputs, *o.outputs]:
            phases = [(order[s.kind], -s.level) for s in e.steps]
            assert phases == sorted(phases)


def test_topology_levels(mlp):
    model = make_model(mlp, 8, topology=[(2, "pcie"), (4, "nvlink")])
    assert model.mesh == [2, 2, 2]
    assert [link.name for link in model.links] == ["pcie4", "nvlink4", "nvlink4"]
    plan = plan_partition(mlp, 8, topology=[(2, "pcie"), (4, "nvlink")])
    assert plan.links == ["pcie4", "nvlink4", "nvlink4"]
    with pytest.raises(ValueError, match="devices"):
        make_model(mlp, 8, topology=[(2, "pcie"), (2, "nvlink")])


def test_entry_point_errors(mlp):
    with pytest.raises(ValueError, match="strategy"):
        plan_partition(mlp, 2, strategy="zero")
    with pytest.raises(ValueError, match="at least 1"):
        plan_partition(mlp, 0)
    with pytest.raises(TypeError, match="partition_problem"):
        plan_partition(mlp.graph, 2)
    gpt = analyze(get_model("gpt", "tiny", training=True))
    with pytest.raises(TableTooLarge):
        plan_partition(gpt, 8, strategy="exact")
    resnet = analyze(get_model("resnet", "tiny", training=True))
    with pytest.raises(NotApplicable, match="block"):
        plan_partition(resnet, 2, strategy="megatron")


def test_memory_weight_trades_traffic_for_memory():
    # Inference with replicated weights sends nothing; pricing stored bytes like sent ones
    # splits the weights (Megatron-like) at the cost of some traffic.
    problem = analyze(get_model("mlp", "tiny", batch=8, features=512, hidden=512, classes=512))
    free = plan_partition(problem, 2)
    assert free.bytes_per_device == 0
    dear = plan_partition(problem, 2, memory_weight=1 / 25e9)
    assert dear.peak_bytes_per_device < free.peak_bytes_per_device
    assert dear.bytes_per_device > 0


def test_disallowed_dims_are_never_split(mlp):
    """`disallow` restricts the plan to what a lowering expresses; the reasons show."""
    free = plan_partition(mlp, 2)
    split = {(mlp.op_spec[o.id], d) for o in free.ops for d in o.strategy if d >= 0}
    assert split
    disallow: dict = {}
    for key, d in split:
        disallow.setdefault(key, {})[d] = "not lowered here"
    plan = plan_partition(mlp, 2, disallow=disallow)
    assert not {(mlp.op_spec[o.id], d) for o in plan.ops for d in o.strategy
                if d >= 0} & split
    assert any("not lowered here" in reason for _, reason in plan.unsupported)


def test_memory_timeline_by_kind(mlp):
    plan = plan_partition(mlp, 4)
    everything = plan.memory_timeline(mlp.graph)
    assert int(everything.max()) == plan.peak_bytes_per_device
    tracked = plan.peak_memory(mlp.graph, ("parameter", "input", "activation", "gradient"))
    assert 0 < tracked <= plan.peak_bytes_per_device
    with pytest.raises(ValueError, match="graph"):
        plan.memory_timeline(analyze(get_model("gpt", "tiny")).graph)


def _keys(data):
    """The key structure of a JSON value, in key order."""
    if isinstance(data, dict):
        return [(k, _keys(v)) for k, v in data.items()]
    if isinstance(data, list):
        return [_keys(v) for v in data[:1]]
    return type(data).__name__


def test_saved_plan_loads_typed_and_writes_the_same_json():
    text = SAVED.read_text()
    plan = PartitionPlan.from_json(text)
    assert plan.to_json() == text
    assert PartitionPlan.from_dict(json.loads(text)).to_dict() == json.loads(text)
    older = json.loads(text)  # a plan written before plans named the tensors held
    del older["held"]
    assert PartitionPlan.from_dict(older).held == []
    assert all(isinstance(t, TensorPlacement) for t in plan.tensors)
    assert all(isinstance(o, OpPlacement) for o in plan.ops)
    op = next(o for o in plan.ops if o.inner)
    assert isinstance(op.inputs[0], InputConversion)
    assert isinstance(op.outputs[0], OutputConversion)
    assert isinstance(op.inner[0], InnerStep) and op.inner[0].buffer
    assert all(type(s) is Step for o in plan.ops for e in [*o.inputs, *o.outputs]
               for s in e.steps)
    assert plan.tensor_layouts()["layers.0.weight"] == [0, 0]
    assert plan.summary()["replicated_ops"] == sum(
        all(d < 0 for d in o["strategy"]) for o in json.loads(text)["ops"])


def test_today_plans_write_the_saved_format():
    """A plan made now has the saved plan's fields, in the same order, at every level."""
    saved = json.loads(SAVED.read_text())
    problem = analyze(get_model("mlp", "tiny", batch=8, features=512, hidden=512, classes=512))
    plan = plan_partition(problem, 4, strategy="megatron",
                          topology=[(2, "pcie"), (2, "nvlink")])
    data = json.loads(plan.to_json())
    assert _keys(data) == _keys(saved)
    assert layouts_of(plan, problem.graph) == layouts_of(PartitionPlan.from_dict(saved),
                                                          problem.graph)


def test_optional_record_fields_round_trip_as_written():
    """`materialized` is written only where set; a plan without `transient_bytes` loads (they
    count as 0) and is written back without them."""
    data = json.loads(SAVED.read_text())
    data["tensors"][5]["materialized"] = True
    for o in data["ops"]:
        del o["transient_bytes"]
    plan = PartitionPlan.from_dict(json.loads(json.dumps(data)))
    assert plan.tensors[5].materialized and not plan.tensors[4].materialized
    assert all(o.transient_bytes is None for o in plan.ops)
    assert plan.to_dict() == data
    graph = analyze(get_model("mlp", "tiny", batch=8, features=512, hidden=512,
                              classes=512)).graph
    assert plan.peak_memory(graph) > 0


def test_a_record_with_a_missing_or_unknown_field_is_refused():
    data = json.loads(SAVED.read_text())
    del data["ops"][0]["inputs"][0]["steps"]
    with pytest.raises(TypeError, match="steps"):
        PartitionPlan.from_dict(data)
    data = json.loads(SAVED.read_text())
    data["tensors"][0]["colour"] = "red"
    with pytest.raises(TypeError, match="colour"):
        PartitionPlan.from_dict(data)
