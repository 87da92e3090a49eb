"""mg-convert: a model whose weights hold NaN/Inf is imported with a warning naming them."""

from __future__ import annotations

import shutil

from fault_helpers import exit_code
from safetensors.torch import load_file, save_file

from mg.ckpt_convert.cli import main


def test_nonfinite_weights_warn_on_import(artifacts, tmp_path, capsys) -> None:
    source = tmp_path / "hf"
    shutil.copytree(artifacts / "hf", source)
    state = load_file(source / "model.safetensors")
    name = next(n for n in state if n.endswith("mlp.c_fc.weight"))
    state[name][0, :3] = float("nan")
    state[name][1, 0] = float("inf")
    save_file(state, source / "model.safetensors", metadata={"format": "pt"})
    assert exit_code(lambda: main(["import-hf", str(source), "--save", str(tmp_path / "ck")])) == 0
    err = capsys.readouterr().err
    assert "1 weight tensor(s) hold NaN or Inf" in err, err
    assert "(4 values)" in err and "check the source files" in err


def test_finite_weights_import_quietly(artifacts, tmp_path, capsys) -> None:
    out = tmp_path / "ck"
    assert exit_code(lambda: main(["import-hf", str(artifacts / "hf"), "--save", str(out)])) == 0
    assert "NaN" not in capsys.readouterr().err
