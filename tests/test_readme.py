"""README.md's examples work as written: every ```python block runs, and every
`scripts/compile.py` and `scripts/gpu_bundle.py` command shown parses (and passes the CLI's
option checks)."""

from __future__ import annotations

import os
import re
import shlex

import pytest

from tvm_ext.cli import build_parser, gpu_bundle, main, refuse_idle_options

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _text() -> str:
    with open(README) as f:
        return f.read()


def _code_blocks(language: str | None = None) -> list[str]:
    """Fenced blocks, all of them or those of one language."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", _text(), re.S | re.M)
    return [body for lang, body in blocks if language is None or lang == language]


def _commands(script: str = "compile.py") -> list[list[str]]:
    """The arguments of each `python scripts/<script> ...` command in a code block (the
    usage synopsis, with its [OPTIONAL] brackets, is checked separately)."""
    commands = []
    for block in _code_blocks():
        for line in block.splitlines():
            for part in line.split("&&"):
                part = part.split("#")[0]
                match = re.search(rf"python3?\s+scripts/{re.escape(script)}\s*(.*)$",
                                  part.strip())
                if match and "[" not in match.group(1):
                    commands.append(shlex.split(match.group(1)))
    return commands


PYTHON_BLOCKS = _code_blocks("python")
COMMANDS = _commands()
BUNDLE_COMMANDS = _commands("gpu_bundle.py")


def test_readme_has_examples():
    assert PYTHON_BLOCKS and len(COMMANDS) >= 2 and BUNDLE_COMMANDS


@pytest.mark.parametrize("code", PYTHON_BLOCKS, ids=[f"block{i}" for i in
                                                      range(len(PYTHON_BLOCKS))])
def test_python_block_runs(code):
    exec(compile(code, f"{README} (python block)", "exec"), {"__name__": "readme_example"})


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(c) for c in COMMANDS])
def test_command_parses(argv):
    parser = build_parser()
    refuse_idle_options(parser, parser.parse_args(argv))


@pytest.mark.parametrize("argv", BUNDLE_COMMANDS, ids=[" ".join(c) for c in BUNDLE_COMMANDS])
def test_bundle_command_parses(argv):
    assert gpu_bundle.option_problem(gpu_bundle.build_parser().parse_args(argv)) is None


def test_synopsis_names_only_real_options():
    synopsis = next(b for b in _code_blocks("") if "scripts/compile.py MODEL" in b)
    known = set(build_parser()._option_string_actions)
    named = set(re.findall(r"(--[a-z][a-z-]*)", synopsis))
    assert named and named <= known, sorted(named - known)


def test_quick_start_command_runs(capsys):
    """The first command of the README, run as shown (the heavier swap example is covered by
    tests/test_cli.py)."""
    argv = COMMANDS[0]
    assert argv[:1] == ["gpt"] and "--check" in argv
    assert main(argv) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("check"))
    # A relative error past rtol (an element near zero) is said to pass on atol.
    rel, rtol = re.search(r"max rel error (\S+?)[,; ].*rtol (\S+?),", line).groups()
    assert line.startswith("check   OK") and \
        (float(rel) <= float(rtol) or "pass on atol" in line), line


def _runs_as_program(path: str) -> bool:
    with open(path) as f:
        return 'if __name__ == "__main__":' in f.read()


def test_every_benchmark_has_its_section():
    """benchmarks/README.md holds every benchmark's table: one section per script (a file run
    as a program; the modules a benchmark imports are its parts), named in its heading, and
    README.md points there."""
    folder = os.path.join(os.path.dirname(README), "benchmarks")
    with open(os.path.join(folder, "README.md")) as f:
        headings = re.findall(r"^## .*\(`benchmarks/(\w+)\.py`\)$", f.read(), re.M)
    scripts = sorted(name[:-3] for name in os.listdir(folder) if name.endswith(".py")
                     and _runs_as_program(os.path.join(folder, name)))
    assert sorted(headings) == scripts
    assert "benchmarks/README.md" in _text()
