"""MetaSchedule's XGBoost cost model, kept beside the tuning records (`cost_model.tar`) so that
a later tuning run of the same work dir starts from what earlier runs learned.

`XGBCostModel` is MetaSchedule's `XGBModel` with its prediction fixed for candidates that have
no feature rows (a kernel whose scheduled form has no blocks the feature extractor reads, such
as some reshapes): MetaSchedule packs the rows of a batch of candidates and sums the
predictions per candidate with `np.bincount`, which fails when no candidate of the batch has a
row (the ids array is then float64) and returns too few scores when the last candidates have
none. Here every candidate gets a score, 0 for one without rows.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.utils import cpu_count

COST_MODEL_FILE = "cost_model.tar"


@derived_object
class XGBCostModel(ms.cost_model.XGBModel._cls):
    """MetaSchedule's XGBModel, scoring every candidate (see the module docstring)."""

    def _predict(self, xs: list[np.ndarray]) -> np.ndarray:
        import xgboost as xgb

        rows = [x.shape[0] for x in xs]
        if sum(rows) == 0:
            return np.zeros(len(xs), dtype=np.float64)
        pred = self.booster.predict(xgb.DMatrix(data=np.concatenate(xs, axis=0)))
        ids = np.repeat(np.arange(len(xs), dtype=np.int64), rows)
        return np.bincount(ids, weights=pred, minlength=len(xs))


def load_cost_model(db_dir: str) -> XGBCostModel:
    """The cost model saved in `db_dir`, or a new one when there is none."""
    model = XGBCostModel(num_tuning_cores=cpu_count(logical=False), adaptive_training=True,
                         tree_method="auto")
    path = os.path.join(db_dir, COST_MODEL_FILE)
    if os.path.isfile(path):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # xgboost guessing the file format it wrote
            model.load(path)
    return model


def save_cost_model(model: XGBCostModel, db_dir: str) -> None:
    """Saved only once trained: XGBModel.load cannot read a model saved without a booster."""
    if model.booster is not None:
        path = os.path.join(db_dir, COST_MODEL_FILE)
        temp = f"{path}.{os.getpid()}.tmp"  # renamed whole into place: a run ended mid-save
        with warnings.catch_warnings():  # leaves the previous model readable
            warnings.simplefilter("ignore")  # xgboost's note on its default file format
            model.save(temp)
        os.replace(temp, path)
