"""Cost models: hardware presets, roofline durations, measured kernel times."""

from __future__ import annotations

import numpy as np
import pytest

from tvm_ext.cost import HARDWARE, get_hardware, op_time, op_times
from tvm_ext.cost.calibration import calibrate, compare, op_times_measured
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
