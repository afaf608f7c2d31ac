"""tvm_ext.passes: Relax passes, one per file, each consuming a plan made by a planner."""

__all__: list[str] = []
