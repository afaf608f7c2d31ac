"""An ONNX model run by ONNX Runtime: the source framework's answer for `--check` of a .onnx
file, as PyTorch eager is for a .pt2 (`reference.py`).

Two TVM builds of one imported module share the frontend's reading of the file, so a
frontend that reads an operator wrongly passes a check between them; ONNX Runtime, the
standard's reference runtime, reads the file itself. Graph optimizations are off, so it
computes each node as the standard defines it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def onnx_reference(path: str, inputs: Sequence[np.ndarray], params: Sequence[np.ndarray] = (),
                   param_names: Sequence[str] = ()) -> list[np.ndarray]:
    """Outputs of the ONNX model in `path` on `inputs` (its graph inputs in order), with
    `params` in place of the initializers of the same names (the frontend names each weight
    after its initializer)."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    from .onnx_files import with_perms_in_range

    proto, _ = with_perms_in_range(onnx.load(path))  # as the import reads them
    given = dict(zip(param_names, params, strict=True))
    initializers = set()
    for init in proto.graph.initializer:
        initializers.add(init.name)
        if init.name in given:
            init.CopyFrom(numpy_helper.from_array(np.asarray(given[init.name]), init.name))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(proto.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    # Older files list their initializers among the graph inputs too.
    names = [i.name for i in session.get_inputs() if i.name not in initializers]
    if len(names) != len(inputs):
        raise ValueError(f"the model has {len(names)} inputs, {len(inputs)} were given")
    feeds = {n: np.asarray(x) for n, x in zip(names, inputs, strict=True)}  # 0-d too
    return [np.asarray(o) for o in session.run(None, feeds)]
