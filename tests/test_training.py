"""tvm_ext.driver.training: a compiled optimizer step run for N steps equals N steps of
torch.optim (zoo models with TVM's gradients, a third-party .pt2 with torch.autograd's), keeps
its parameters and state in place, and needs no second copy of them."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import tvm

from tvm_ext import driver
from tvm_ext.driver import training
from tvm_ext.errors import CheckError, InputError
from tvm_ext.models.optimizer import Optimizer, make_optimizer_step
from tvm_ext.swap.exactness import inexact_splits

torch = pytest.importorskip("torch")

STEPS = 5
OPTIMIZERS = [
    Optimizer("sgd", lr=0.1, weight_decay=0.01),
    Optimizer("momentum", lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    Optimizer("adam", lr=0.01, weight_decay=0.01),
    Optimizer("adamw", lr=0.01, weight_decay=0.1),
]


@pytest.fixture(scope="module")
def target():
    return driver.resolve_target("llvm")


def _train(step, target, batches, **kwargs):
    session = driver.TrainingSession(driver.build(step, target), step, tvm.cpu(), **kwargs)
    return session, session.run(batches)


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.kind)
def test_steps_equal_torch_optim_on_a_zoo_mlp(opt, zoo_cache, target):
    grad_step = zoo_cache("mlp", True)
    step = make_optimizer_step(grad_step, opt)
    batches = [step.random_inputs(seed) for seed in range(STEPS)]  # a new batch each step
    session, results = _train(step, target, batches)
    ref = training.reference_steps(step, training.tvm_gradient(grad_step, target), batches,
                                   grad_step.random_params(0))
    check = training.compare_training([r.loss for r in results], session.parameters(),
                                      session.state(), ref, opt)
    assert check.max_param_error < 1e-6 and check.noise_elements == 0
    assert len(session.state()) == len(step.config["state"])
    if opt.counts_steps:  # the step count is state
        assert float(session.state()[-1]) == STEPS


@pytest.fixture(scope="module")
def gpt_adamw(zoo_cache, target):
    step = make_optimizer_step(zoo_cache("gpt", True), Optimizer("adamw", lr=0.01))
    return step, driver.build(step, target)


def test_state_persists_and_the_loss_falls(gpt_adamw):
    """Parameters and state stay where they were placed: a second run goes on from the
    first, and on a fixed batch the loss falls step after step."""
    step, ex = gpt_adamw
    batch = step.random_inputs(0)
    session = driver.TrainingSession(ex, step, tvm.cpu())
    first = session.run([batch] * 3)
    second = session.run([batch] * 2)
    losses = [r.loss for r in [*first, *second]]
    assert all(b < a for a, b in itertools.pairwise(losses))
    again = driver.TrainingSession(ex, step, tvm.cpu())
    results = again.run([batch] * 5)
    np.testing.assert_allclose([r.loss for r in results], losses, rtol=1e-6)
    for a, b in zip(session.parameters(), again.parameters(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert float(session.state()[-1]) == 5


def test_a_session_resumes_from_its_checkpoint(gpt_adamw, tmp_path):
    """Three steps, saved; two more from the file in a new session: the same losses, parameters
    and state (the step count too) as five steps in one session."""
    step, ex = gpt_adamw
    batches = [step.random_inputs(seed) for seed in range(5)]
    whole = driver.TrainingSession(ex, step, tvm.cpu())
    losses = [r.loss for r in whole.run(batches)]
    first = driver.TrainingSession(ex, step, tvm.cpu())
    first.run(batches[:3])
    path = first.save(str(tmp_path / "ckpt.npz"))
    resumed = driver.TrainingSession(ex, step, tvm.cpu(), checkpoint=path)
    assert [r.loss for r in resumed.run(batches[3:])] == losses[3:]
    for a, b in zip([*resumed.parameters(), *resumed.state()],
                    [*whole.parameters(), *whole.state()], strict=True):
        np.testing.assert_array_equal(a, b)
    assert float(resumed.state()[-1]) == 5


def test_a_checkpoint_of_another_step_is_refused(gpt_adamw, zoo_cache, target, tmp_path):
    step, ex = gpt_adamw
    path = driver.TrainingSession(ex, step, tvm.cpu()).save(str(tmp_path / "gpt.npz"))
    other = make_optimizer_step(zoo_cache("gpt", True), Optimizer("adam", lr=0.01))
    with pytest.raises(InputError, match="optimizer"):
        driver.TrainingSession(ex, other, tvm.cpu(), checkpoint=path)
    mlp = make_optimizer_step(zoo_cache("mlp", True), Optimizer("adamw", lr=0.01))
    with pytest.raises(InputError, match="another step"):
        driver.TrainingSession(driver.build(mlp, target), mlp, tvm.cpu(), checkpoint=path)
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(InputError, match="not a tvm_ext training checkpoint"):
        driver.TrainingSession(ex, step, tvm.cpu(), checkpoint=str(garbage))
    with pytest.raises(InputError, match="not both"):
        driver.TrainingSession(ex, step, tvm.cpu(), checkpoint=path, state=[])


def test_no_second_copy_of_parameters_or_state(gpt_adamw, zoo_cache, target):
    """The device peak of a step, less the parameters, state and batch it holds, is below
    the bytes of what it updates (so no second copy of them is ever allocated) and no more
    than what the gradient step (which returns the gradients) allocates itself."""
    grad_step = zoo_cache("gpt", True)
    step, ex = gpt_adamw
    batch = step.random_inputs(0)
    session = driver.TrainingSession(ex, step, tvm.cpu())
    results = session.run([batch] * 3)
    placed = session.placed_bytes[0] + sum(a.nbytes for a in batch)
    own = max(r.peak_bytes for r in results) - placed
    updated = sum(s.nbytes for s in step.params)
    plain = driver.run(driver.build(grad_step, target), grad_step.random_arguments(0),
                       tvm.cpu(), repeat=0)
    assert own < updated and own <= plain.peak_vm_bytes
    assert len({r.peak_bytes for r in results[1:]}) == 1  # the same every step


def test_bad_session_input(zoo_cache, target):
    step = make_optimizer_step(zoo_cache("mlp", True), Optimizer("sgd"))
    ex = driver.build(step, target)
    with pytest.raises(InputError, match="parameters given"):
        driver.TrainingSession(ex, step, tvm.cpu(), params=[np.zeros(1)])
    session = driver.TrainingSession(ex, step, tvm.cpu())
    with pytest.raises(InputError, match="batch"):
        session.step(step.random_inputs(0)[:1])
    with pytest.raises(InputError, match="not an optimizer step"):
        driver.TrainingSession(ex, zoo_cache("mlp", True), tvm.cpu())


def test_compare_training_catches_a_wrong_step(zoo_cache, target):
    grad_step = zoo_cache("mlp", True)
    opt = Optimizer("sgd", lr=0.1)
    step = make_optimizer_step(grad_step, opt)
    batches = [step.random_inputs(0)]  # one step: the same loss, other parameters
    session, results = _train(step, target, batches)
    wrong = Optimizer("sgd", lr=0.11)
    ref = training.reference_steps(make_optimizer_step(grad_step, wrong),
                                   training.tvm_gradient(grad_step, target), batches,
                                   grad_step.random_params(0))
    with pytest.raises(CheckError, match="parameter"):
        training.compare_training([r.loss for r in results], session.parameters(),
                                  session.state(), ref, opt)


def test_compare_training_refuses_a_loss_that_is_not_finite(zoo_cache, target):
    """A NaN step equals a NaN reference (both read the same gradient), which is no evidence:
    the check fails and says why."""
    grad_step = zoo_cache("mlp", True)
    opt = Optimizer("sgd", lr=0.1)
    step = make_optimizer_step(grad_step, opt)
    batches = [step.random_inputs(0)] * 2
    session, results = _train(step, target, batches)
    ref = training.reference_steps(step, training.tvm_gradient(grad_step, target), batches,
                                   grad_step.random_params(0))
    losses = [r.loss for r in results]
    training.compare_training(losses, session.parameters(), session.state(), ref, opt)
    ref.losses[1] = float("nan")
    with pytest.raises(CheckError, match="not finite from step 2 on"):
        training.compare_training([losses[0], float("nan")], session.parameters(),
                                  session.state(), ref, opt)


@pytest.fixture(scope="module")
def corpus_resnet(tmp_path_factory):
    corpus = pytest.importorskip("corpus")
    pytest.importorskip("transformers")
    path, _ = corpus.export(corpus.BY_NAME["resnet"], str(tmp_path_factory.mktemp("corpus")))
    return path


def test_third_party_pt2_equals_torch_optim(corpus_resnet, target):
    """A transformers ResNet (BatchNorm with running statistics, exported in eval mode):
    5 steps equal 5 steps of torch.optim with torch.autograd's gradients."""
    from tvm_ext.models import load_model

    grad_step = load_model(corpus_resnet, training=True)
    opt = Optimizer("adamw", lr=0.01, weight_decay=0.01)
    step = make_optimizer_step(grad_step, opt)
    batches = [step.random_inputs(seed) for seed in range(STEPS)]
    session, results = _train(step, target, batches)
    ref = training.reference_steps(step, training.torch_gradient(corpus_resnet, grad_step),
                                   batches, grad_step.random_params(0))
    check = training.compare_training([r.loss for r in results], session.parameters(),
                                      session.state(), ref, opt)
    assert check.max_loss_error < 1e-5


# --------------------------------------------------------------------------------------------
# Composition: swapped (SwapOffload) and partitioned (PartitionOperators) steps
# --------------------------------------------------------------------------------------------

def _swapped(step, target, budget: str):
    from tvm_ext.ir.targets import vm_devices
    from tvm_ext.swap import plan_swaps
    from tvm_ext.swap.placement import argument_devices
    from tvm_ext.swap.problem import problem_for_budget

    graph = driver.fused_graph(step, target)
    plan = plan_swaps(problem_for_budget(graph, budget, "h100"), "swapadvisor",
                      time_budget_s=1.0)
    device, host = vm_devices(target)
    ex = driver.build(step, target, swap_plan=plan)
    return driver.TrainingSession(ex, step, device, host=host,
                                  arg_devices=argument_devices(graph, plan)), plan, graph


@pytest.mark.parametrize("name, budget", [("mlp", "min"), ("mlp", "5000"), ("gpt", "25%")])
def test_swapped_steps_equal_plain_and_stay_within_budget(name, budget, zoo_cache, target):
    """A steady state: every step within the budget (parameters and state included), host
    memory the same after every step, and the same losses, parameters and state as the
    unswapped step: exactly (the same kernels, in place; an update split in time runs its
    elementwise chunks), or within float32 tolerance where a kernel that reduces runs in
    chunks (`swap.exactness`). At 5000 B the mlp's largest update (a weight, its gradient and
    two moments: 8448 B) runs in chunks, streamed from and back into its host buffers."""
    step = make_optimizer_step(zoo_cache(name, True), Optimizer("adamw", lr=0.01))
    batches = [step.random_inputs(seed) for seed in range(STEPS)]
    session, plan, graph = _swapped(step, target, budget)
    results = session.run(batches)
    assert plan.host_start and plan.swap_outs  # arguments live on the host between steps
    constants = graph.bytes_of_kind("constant")
    assert all(r.peak_bytes + constants <= plan.budget for r in results)
    assert len({r.host_bytes for r in results}) == 1
    updates = [s for s in plan.splits if graph.ops[plan.schedule[s.position]].phase == "update"]
    if budget == "5000":
        assert updates and all(set(s.cut_outputs) <= set(s.cut_inputs) for s in updates)
    exact = not inexact_splits(graph, plan)  # kernels that reduce, run in chunks
    plain, expected = _train(step, target, batches)
    check = np.testing.assert_array_equal if exact else \
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    check([r.loss for r in results], [r.loss for r in expected])
    for a, b in zip([*session.parameters(), *session.state()],
                    [*plain.parameters(), *plain.state()], strict=True):
        check(a, b)


@pytest.mark.parametrize("k, budget", [(2, None), (4, None), (2, "50%")])
def test_partitioned_steps_equal_torch_optim(k, budget, zoo_cache, target):
    """Partitioned over k workers (and swapped per device): each worker holds its pieces of
    the parameters and state across steps; 5 steps equal torch.optim's."""
    from tvm_ext.runtime import distributed

    grad_step = zoo_cache("mlp", True)
    opt = Optimizer("adam", lr=0.01, weight_decay=0.01)
    step = make_optimizer_step(grad_step, opt)
    build = driver.build_partitioned(step, target, k, hardware="h100", device_memory=budget)
    batches = [step.random_inputs(seed) for seed in range(STEPS)]
    with distributed.Session(k) as sess:
        session = driver.PartitionedTrainingSession(sess, build, step)
        results = session.run(batches)
        params, state = session.parameters(), session.state()
    assert all(len(r.peak_bytes) == k for r in results)
    if budget is not None:
        assert all(max(r.peak_bytes) <= build.swap_plan.budget for r in results)
        assert len({tuple(r.host_bytes) for r in results}) == 1
    ref = training.reference_steps(step, training.tvm_gradient(grad_step, target), batches,
                                   grad_step.random_params(0))
    training.compare_training([r.loss for r in results], params, state, ref, opt)
