"""`mg-train --load` of a checkpoint that does not fit the run: one line, exit 2.

Were `RuntimeError` tracebacks from `load_state_dict` (one line per tensor, on
every rank) or from the quantized linears of an mg-quantize output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fault_helpers import exit_code, train_argv, tree_digest


def _wider(argv: list[str]) -> list[str]:
    """The same run with --hidden-size 64 instead of the saved 32."""
    argv = list(argv)
    argv[argv.index("--hidden-size") + 1] = "64"
    return argv


def _one_line(err: str) -> str:
    assert "Traceback" not in err and "RuntimeError" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_torch_format_resume_with_another_model_shape(artifacts, tmp_path, capsys) -> None:
    from mg.trainer.cli import main

    load = artifacts / "torch"
    before = tree_digest(load)
    argv = _wider(train_argv(tmp_path / "cache", "--load", str(load), "--ckpt-format", "torch"))
    argv += ["--save", str(tmp_path / "new")]
    capsys.readouterr()

    assert exit_code(lambda: main(argv)) == 2

    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"mg-train: error: {load}"), line
    assert "do not fit this run's model" in line and "--use-checkpoint-args" in line, line
    assert "(32,) in the checkpoint, (64,) in the model" in line or "32) in the checkpoint" in line
    assert tree_digest(load) == before


def test_quantized_checkpoint_into_mg_train(artifacts, tmp_path, capsys) -> None:
    quantize = pytest.importorskip("mg.quantize_export.cli", reason="mg-quantize not installed")
    from mg.trainer.cli import main

    quantized = tmp_path / "int8"
    assert exit_code(
        lambda: quantize.main(
            ["--no-progress", "--load", str(artifacts / "torch"), "--save", str(quantized)]
            + ["--recipe", "int8_wo"]
        )
    ) in (0, None)
    argv = train_argv(tmp_path / "cache", "--load", str(quantized), "--save", str(tmp_path / "t"))
    capsys.readouterr()

    assert exit_code(lambda: main(argv)) == 2

    line = _one_line(capsys.readouterr().err)
    assert str(quantized) in line and "quantized" in line and "int8_wo" in line, line
    assert "--load the checkpoint it was quantized from" in line, line


_RUN = "import sys\nfrom mg.trainer.cli import main\nsys.exit(main(sys.argv[1:]))\n"


@pytest.mark.slow
def test_tp2_resume_with_another_model_shape_is_one_line_on_every_rank(tmp_path) -> None:
    from mg.core.testing.launch import launch_workers, run_ranks

    script = tmp_path / "mg_train.py"
    script.write_text(_RUN)
    tp2 = ["--ckpt-format", "torch", "--tensor-model-parallel-size", "2"]
    save = train_argv(tmp_path / "cache", "--save", str(tmp_path / "ckpt"), *tp2)
    launch_workers(str(script), 2, save)
    resume = _wider(train_argv(tmp_path / "cache", "--load", str(tmp_path / "ckpt"), *tp2))

    outcomes = run_ranks(str(script), 2, resume)

    assert [o.returncode for o in outcomes] == [2, 2], [o.log[-2000:] for o in outcomes]
    lines = [
        [line for line in o.log.splitlines() if line.startswith("mg-train: error")]
        for o in outcomes
    ]
    for outcome, errors in zip(outcomes, lines, strict=True):
        assert "Traceback" not in outcome.log and "size mismatch" not in outcome.log, outcome.log
        assert len(errors) == 1, outcome.log
    assert lines[0] == lines[1]
    assert str(Path(tmp_path / "ckpt")) in lines[0][0] and "do not fit" in lines[0][0]
