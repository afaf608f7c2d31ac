"""Cost models: hardware presets, roofline durations, measured kernel times."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tvm_ext.cost import HARDWARE, get_hardware, op_time, op_times
from tvm_ext.cost.calibration import calibrate, compare, op_times_measured
from tvm_ext.cost.hardware import Hardware
from tvm_ext.driver import fused_graph, resolve_target
from tvm_ext.driver.measure_kernels import measure_kernels
from tvm_ext.models import get_model


def test_presets_cover_the_swapadvisor_hardware():
    for name, gen_bw in (("gtx1080ti", 15.75e9), ("a100", 31.5e9), ("h100", 63e9)):
        hw = HARDWARE[name]
        assert hw.host_to_device.bandwidth < gen_bw  # derated PCIe x16 per direction
        assert hw.host_to_device.bandwidth > 0.5 * gen_bw
        assert hw.peak_flops > 1e12 and hw.mem_bandwidth > 1e11
    assert HARDWARE["h100"].peak_flops > HARDWARE["a100"].peak_flops > \
        HARDWARE["gtx1080ti"].peak_flops
    with pytest.raises(ValueError, match="presets"):
        get_hardware("tpu")


def test_every_preset_streams_near_its_memory_bandwidth():
    """A streaming kernel reaches a good part of the preset's bandwidth, and a tiny kernel takes
    microseconds on every preset: the CPU stand-in's fields once shifted by one (its bandwidth
    efficiency read 2e-6, its kernels took seconds)."""
    for name, hw in HARDWARE.items():
        assert 0.3 <= hw.bandwidth_efficiency <= 1.0, name
        assert 0.0 < hw.compute_efficiency <= hw.library_efficiency <= 1.0, name
        assert op_time(8192.0, 32832, hw) < 1e-4, name


def test_low_precision_library_gemms_run_at_the_tensor_core_peak():
    """A bf16 GEMM in cuBLAS runs at the dense BF16 peak where the GPU has one (14.8x the
    FP32 rate on an H100), at the FP32 rate on a GTX 1080 Ti (no such tensor cores); generated
    kernels and FP32 GEMMs are priced as before."""
    flops, nbytes = 2 * 8192**3, 3 * 8192**2 * 2
    h100, pascal = HARDWARE["h100"], HARDWARE["gtx1080ti"]
    low = op_time(flops, nbytes, h100, library=True, low_precision=True)
    fp32 = op_time(flops, nbytes, h100, library=True)
    assert (fp32 - h100.launch_overhead) / (low - h100.launch_overhead) == \
        pytest.approx(989 / 67)
    assert op_time(flops, nbytes, h100, low_precision=True) == op_time(flops, nbytes, h100)
    assert op_time(flops, nbytes, pascal, library=True, low_precision=True) == \
        op_time(flops, nbytes, pascal, library=True)


def test_a_bf16_steps_library_kernels_are_low_precision(zoo_cache):
    from tvm_ext import driver
    from tvm_ext.models.mixed_precision import low_precision_step

    llvm = driver.resolve_target("llvm")
    step = zoo_cache("mlp", training=True)
    fp32 = [op for op in driver.fused_graph(step, llvm).ops if op.library]
    bf16 = [op for op in driver.fused_graph(low_precision_step(step, "bf16"), llvm).ops
            if op.library]
    assert fp32 and not any(op.low_precision for op in fp32)
    assert bf16 and all(op.low_precision for op in bf16)


def test_roofline_is_the_slower_of_compute_and_memory():
    hw = HARDWARE["gtx1080ti"]
    flops, nbytes = 2 * 1024**3, 12 * 1024**2  # a 1024^3 GEMM: compute-bound
    expected = flops / (hw.peak_flops * hw.compute_efficiency) + hw.launch_overhead
    assert op_time(flops, nbytes, hw) == pytest.approx(expected)
    nbytes = 4 * 1024**3  # a large copy: memory-bound
    expected = nbytes / (hw.mem_bandwidth * hw.bandwidth_efficiency) + hw.launch_overhead
    assert op_time(1e6, nbytes, hw) == pytest.approx(expected)
    assert op_time(flops, nbytes, hw, kind="view") == 0.0


def test_measured_kernel_times_on_a_tiny_model():
    target = resolve_target("llvm")
    model = get_model("mlp", "tiny", training=True)
    graph = fused_graph(model, target)
    timings = measure_kernels(model, target, graph, number=2, repeat=2)
    kernels = {op.kernel for op in graph.ops if op.kind == "kernel"}
    assert set(timings) == kernels
    assert all(k.seconds > 0 for k in timings.values())
    times = op_times_measured(graph, timings)
    assert times.shape == (graph.num_ops,) and np.all(times[[op.id for op in graph.ops
                                                            if op.kind == "kernel"]] > 0)
    rows = compare(timings, "cpu")
    assert len(rows) == len(kernels) and rows[0]["measured_s"] >= rows[-1]["measured_s"]
    fitted = calibrate(timings, "cpu")
    assert fitted.compute_efficiency > 0 and fitted.bandwidth_efficiency > 0
    # Calibration brings the modelled iteration to the measured one.
    measured = times.sum()
    calibrated = op_times(graph, fitted).sum()
    before = op_times(graph, "cpu").sum()
    assert abs(np.log(calibrated / measured)) <= abs(np.log(before / measured)) + 0.05
    assert abs(np.log(calibrated / measured)) < np.log(2.0)


def test_scaled_link_keeps_the_presets_compute_to_link_ratio():
    """A graph this CPU runs 40x slower than the H100 preset gets the H100's PCIe link 40x
    slower: every copy takes 40x longer, as the compute does in total."""
    from tvm_ext.cost.emulation import scaled_link, time_scale

    h100 = get_hardware("h100")
    scale = time_scale([0.3, 0.1], [0.004, 0.006])
    assert scale == pytest.approx(40.0)
    link = scaled_link(h100.host_to_device, scale)
    assert link.bandwidth == pytest.approx(h100.host_to_device.bandwidth / 40)
    assert link.latency == pytest.approx(h100.host_to_device.latency * 40)
    for nbytes in (256, 1 << 20, 1 << 30):
        assert link.transfer_time(nbytes) == pytest.approx(
            40 * h100.host_to_device.transfer_time(nbytes))
    with pytest.raises(ValueError, match="positive compute times"):
        time_scale([0.0], [1.0])


def test_stand_in_hardware_carries_the_link_and_the_runtime_costs():
    from tvm_ext.cost.emulation import RuntimeCosts, fixed_link, stand_in_hardware

    link = fixed_link(2.0, 50.0)
    assert (link.bandwidth, link.latency) == (2e9, pytest.approx(50e-6))
    wake = ((1e-5, 3e-5, 1e-5), (1e-3, 6e-5, 4e-5))
    hw = stand_in_hardware(link, costs=RuntimeCosts(copy_issue=3e-5, sync=1e-5,
                                                    overshoot=2e-5, wake=wake))
    assert hw.copy_wake == wake
    assert Hardware.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw
    cpu = get_hardware("cpu")
    assert hw.peak_flops == cpu.peak_flops
    for direction in (hw.host_to_device, hw.device_to_host):
        assert direction.bandwidth == 2e9
        assert direction.latency == pytest.approx(70e-6)  # + the pacing overshoot
    assert (hw.copy_issue_overhead, hw.sync_overhead) == (3e-5, 1e-5)
    with pytest.raises(ValueError, match="GB/s > 0"):
        fixed_link(0.0)
    # The presets have no runtime costs: GPU plans are scored as before.
    assert all(h.copy_issue_overhead == h.sync_overhead == 0.0 for h in HARDWARE.values())


def test_dispatch_overhead_spreads_the_unexplained_time_over_kernels():
    from tvm_ext.cost.calibration import dispatch_overhead, op_kernels, with_dispatch_overhead

    graph = fused_graph(get_model("mlp", "tiny"), resolve_target("llvm"))
    kernels = sum(op.kind == "kernel" for op in graph.ops)
    times = np.full(graph.num_ops, 1e-4)
    overhead = dispatch_overhead(op_kernels(graph), times, times.sum() + kernels * 2e-6)
    assert overhead == pytest.approx(2e-6)
    assert with_dispatch_overhead(op_kernels(graph), times, overhead).sum() == pytest.approx(
        times.sum() + kernels * 2e-6)
    assert dispatch_overhead(op_kernels(graph), times, times.sum() / 2) == 0.0


def test_op_times_fit_a_measured_run_faster_or_slower_than_their_sum():
    """Slower: the difference is dispatch overhead on every kernel op; faster: the kernel ops
    are scaled down to the run, the others kept; either way the sum is the run's."""
    from tvm_ext.cost.calibration import fit_to_iteration

    kernels = ["k0", None, "k1", "k2"]
    times = np.array([4e-4, 1e-4, 2e-4, 2e-4])
    slower, overhead, scale = fit_to_iteration(kernels, times, 1.2e-3)
    assert (overhead, scale) == (pytest.approx(1e-4), 1.0)
    np.testing.assert_allclose(slower, [5e-4, 1e-4, 3e-4, 3e-4])
    faster, overhead, scale = fit_to_iteration(kernels, times, 5e-4)
    assert (overhead, scale) == (0.0, pytest.approx(0.5))
    np.testing.assert_allclose(faster, [2e-4, 1e-4, 1e-4, 1e-4])
    assert faster.sum() == pytest.approx(5e-4)
    same, overhead, scale = fit_to_iteration([None] * 4, times, 1e-4)  # no kernel to fit
    assert (overhead, scale) == (0.0, 1.0)
    np.testing.assert_array_equal(same, times)
