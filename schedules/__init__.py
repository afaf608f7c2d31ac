"""tvm_ext.schedules: kernel tuning with MetaSchedule and its XGBoost cost model."""

__all__: list[str] = []
