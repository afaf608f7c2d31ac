"""A partitioned module on a Disco session with the suite's collective backend (NCCL on the
GPU, tvm_ext's cpu backend on the stand-in), against the outputs of the single-device CPU
build."""

from __future__ import annotations

from .. import distributed
from .report import Failed, Skip
from .suite import SuiteRun, compare_expected

REPEAT = 3


def check_partitioned(suite: SuiteRun, entry: dict) -> dict:
    if suite.backend == "nccl":
        if not suite.spec.get("nccl", {}).get("built"):
            raise Skip("the bundle has no NCCL backend: "
                       + suite.spec.get("nccl", {}).get("reason", "not built"))
        try:
            distributed.load_nccl_backend()
        except distributed.NcclUnavailableError as err:
            raise Failed(f"the bundle's NCCL backend does not load: {err}") from None
    args = suite.arrays(entry["arguments"])
    expected = suite.arrays(entry["expected"])
    k = int(entry["devices"])
    with distributed.Session(k, suite.backend) as sess:
        result = distributed.run_exported(sess, suite.bundle.path(entry["module"]), args,
                                          repeat=REPEAT)
    latencies = sorted(result.latencies_ms)
    data = {"backend": suite.backend, "workers": k, "peak_bytes": result.peak_bytes,
            "latency_ms": latencies[len(latencies) // 2] if latencies else None,
            "reference": entry["reference"]}
    return {**data, **compare_expected(result.outputs, expected, entry["tolerances"], data,
                                       entry["reference"])}
