"""TVM's C++ log stays out of scripts/compile.py's output and shows with --verbose
(tvm_ext/cli/tvm_log.py); the quick start's model makes TVM log nothing at all."""

from __future__ import annotations

import re
import textwrap

from tvm_ext.cli import main

# TVM's C++ log lines: "[10:00:18] /project/include/tvm/topi/transform.h:1261: Warning: ..."
TVM_LOG_LINE = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+:\d+: ", re.M)

# A take in TVM's "fast" mode: legalizing it makes TVM log a warning.
FAST_TAKE = textwrap.dedent("""
    from tvm import relax

    def get_model():
        bb = relax.BlockBuilder()
        table = relax.Var("table", relax.TensorType((16, 4), "float32"))
        ids = relax.Var("ids", relax.TensorType((3,), "int32"))
        with bb.function("main", [table, ids]):
            with bb.dataflow():
                out = bb.emit_output(relax.op.take(table, ids, axis=0, mode="fast"))
            bb.emit_func_output(out)
        return bb.get()
""")


def test_tvm_log_is_kept_out_and_shown_with_verbose(tmp_path, capfd):
    model = tmp_path / "fast_take.py"
    model.write_text(FAST_TAKE)
    assert main([str(model), "--target", "llvm"]) == 0
    quiet = capfd.readouterr()
    assert "compile " in quiet.out
    assert not TVM_LOG_LINE.search(quiet.out + quiet.err), quiet.err
    assert main([str(model), "--target", "llvm", "--verbose"]) == 0
    shown = capfd.readouterr()
    assert re.search(TVM_LOG_LINE.pattern + r"Warning: Fast mode segfaults", shown.err, re.M)


def test_our_errors_still_reach_stderr_while_the_log_is_kept_out(tmp_path, capfd):
    model = tmp_path / "broken.py"
    model.write_text("def get_model():\n    raise ValueError('no such model here')\n")
    assert main([str(model), "--target", "llvm"]) == 2
    err = capfd.readouterr().err
    assert "error:" in err and "no such model here" in err


def test_the_quick_start_model_makes_tvm_log_nothing(capfd):
    """The zoo gpt's embeddings clip their ids (`models._nn.Embedding`): no TVM warning at
    the build or at the plain TVM build --check compares with."""
    assert main(["gpt", "--target", "llvm", "--check", "--repeat", "1", "--verbose"]) == 0
    captured = capfd.readouterr()
    assert "check   OK" in captured.out
    assert not TVM_LOG_LINE.search(captured.out + captured.err), captured.err
