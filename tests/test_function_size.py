"""No function of the package, the passes, the schedules, the scripts or the benchmarks is
longer than MAX_LINES lines, unless a `# long: <why>` comment right above its `def` says why
(ruff's PLR0915 bounds the statements; this bounds what a reader has to hold at once)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = ("tvm_ext", "passes", "schedules", "scripts", "benchmarks")
MAX_LINES = 80


def _long_functions(path: pathlib.Path) -> list[str]:
    lines = path.read_text().split("\n")
    out = []
    for node in ast.walk(ast.parse("\n".join(lines))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        length = node.end_lineno - node.lineno + 1
        reason = lines[first - 2].strip() if first >= 2 else ""
        if length > MAX_LINES and not (reason.startswith("# long:") and len(reason) > 12):
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            out.append(f"{where}:{node.lineno} {node.name}: {length} lines")
    return out


def test_no_function_is_too_long_without_a_reason():
    found = [f for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))
             for f in _long_functions(p)]
    assert not found, "\n".join(found)


def test_the_rule_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    path = tmp_path / "example.py"
    path.write_text(f"def f():\n{body}\n\n\n# long: a reason\ndef g():\n{body}\n")
    assert [line.split()[1] for line in _long_functions(path)] == ["f:"]
