"""scripts/compile.py's implementation: arguments (`args`), the compile job (`job`) with its
swapped (`swapped`) and partitioned (`partitioned`) variants, checks (`check`) and the report
(`report`)."""

from __future__ import annotations

from .args import arch_problem, build_parser, refuse_idle_options
from .main import main

__all__ = ["arch_problem", "build_parser", "main", "refuse_idle_options"]
