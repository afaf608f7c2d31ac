"""The XGBoost cost model: every candidate of a batch gets a score, including candidates whose
scheduled form has no feature rows (MetaSchedule's own packing fails or drops them)."""

import numpy as np
import pytest
from tvm.s_tir.meta_schedule.cost_model.xgb_model import PackSum

from tvm_ext.schedules.cost_model import XGBCostModel, load_cost_model, save_cost_model

FEATURES = 8


def _trained(seed: int = 0) -> XGBCostModel:
    rng = np.random.default_rng(seed)
    model = XGBCostModel(num_tuning_cores=1)
    xs = [rng.random((int(rng.integers(1, 4)), FEATURES)).astype("float32") for _ in range(32)]
    model._train(xs=xs, ys=rng.random(len(xs)))
    return model


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((n, FEATURES)).astype("float32")


def test_meta_schedule_packing_fails_without_rows():
    """The failure the subclass exists for (if MetaSchedule fixes it, this test says so)."""
    pack = PackSum(xs=[np.zeros((0, FEATURES), "float32")] * 3, ys=None)
    with pytest.raises(TypeError):
        pack.predict_with_score(np.zeros(0))


def test_every_candidate_is_scored():
    model = _trained()
    empty = np.zeros((0, FEATURES), "float32")
    assert model._predict([empty, empty, empty]).tolist() == [0.0, 0.0, 0.0]
    xs = [_rows(2, 1), empty, _rows(3, 2), empty]
    scores = model._predict(xs)
    assert scores.shape == (4,)
    assert scores[1] == 0.0 and scores[3] == 0.0
    # A candidate's score is the sum of its rows' predictions, as MetaSchedule's packing has it.
    alone = model._predict([xs[2]])
    assert scores[2] == pytest.approx(alone[0])
    assert scores[0] == pytest.approx(PackSum(xs=xs[:1], ys=None).predict_with_score(
        model.booster.predict(PackSum(xs=xs[:1], ys=None).dmatrix))[0])


def test_saved_and_loaded(tmp_path):
    assert load_cost_model(str(tmp_path)).booster is None
    save_cost_model(load_cost_model(str(tmp_path)), str(tmp_path))  # untrained: not written
    assert not list(tmp_path.iterdir())
    model = _trained()
    save_cost_model(model, str(tmp_path))
    again = load_cost_model(str(tmp_path))
    x = [_rows(2, 5)]
    assert again._predict(x) == pytest.approx(model._predict(x))
