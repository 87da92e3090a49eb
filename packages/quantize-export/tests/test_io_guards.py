"""mg-quantize never deletes or writes into what it reads, refuses an export it cannot
write before doing any work, and speaks mg-prep's --no-progress-bar."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mg.core.checkpoint import load_model, save_model
from mg.core.models import GPTModel
from mg.core.models.presets import tiny_llama
from mg.quantize_export import cli


def _digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _run(capsys, *argv: str) -> tuple[int, str]:
    try:
        cli.main(["--no-progress-bar", "--recipe", "int8_wo", *argv])
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A tiny float Llama checkpoint at tmp_path/runs/ckpt, with calibration data beside it."""
    torch.manual_seed(0)
    config = tiny_llama()
    folder = tmp_path / "runs" / "ckpt"
    save_model(folder, GPTModel(config), config, None)
    return folder


@pytest.mark.parametrize(
    "save, says",
    [
        (lambda c: c, "is the input --load"),
        (lambda c: c.parent, "contains the input --load"),
        (lambda c: c.parent.parent, "contains the input --load"),
        (lambda c: c / "int8", "lies inside the input --load"),
    ],
    ids=["same", "parent", "grandparent", "inside"],
)
def test_save_over_load_is_refused_and_the_checkpoint_kept(ckpt, save, says, capsys) -> None:
    before = _digest(ckpt.parent.parent)
    target = save(ckpt)
    code, err = _run(capsys, "--load", str(ckpt), "--save", str(target), "--overwrite")
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"--save {target} {says} {ckpt}" in err, err
    assert "choose a --save outside --load" in err
    assert _digest(ckpt.parent.parent) == before  # not a byte changed, nothing added


def test_save_through_a_symbolic_link_is_refused(ckpt, tmp_path, capsys) -> None:
    (tmp_path / "alias").symlink_to(ckpt.parent)
    before = _digest(ckpt)
    code, err = _run(capsys, "--load", str(ckpt), "--save", str(tmp_path / "alias"), "--overwrite")
    assert code == 2 and "contains the input --load" in err, err
    assert _digest(ckpt) == before


def test_save_over_calibration_data_and_report_over_load_are_refused(ckpt, capsys) -> None:
    save = ckpt.parent.parent / "data"
    save.mkdir()
    data = save / "calib"
    for suffix in (".bin", ".idx"):
        Path(f"{data}{suffix}").write_bytes(b"data")
    code, err = _run(
        capsys, "--load", str(ckpt), "--save", str(save), "--overwrite", "--recipe", "fp8",
        "--calib-data-path", str(data),
    )  # fmt: skip
    assert code == 2 and f"--save {save} contains the input --calib-data-path {data}.bin" in err
    assert (save / "calib.bin").read_bytes() == b"data"
    report = ckpt / "latest_checkpointed_iteration.txt"
    before = report.read_bytes()
    code, err = _run(
        capsys, "--load", str(ckpt), "--save", str(ckpt.parent / "q"), "--report", str(report)
    )
    assert code == 2 and f"--report {report} lies inside the input --load {ckpt}" in err, err
    assert report.read_bytes() == before
    code, err = _run(
        capsys, "--load", str(ckpt), "--save", str(ckpt.parent / "q"), "--report",
        str(ckpt.parent / "q"),
    )  # fmt: skip
    assert code == 2 and "--report" in err and "name a file" in err


def test_report_inside_save_arrives_with_the_output(ckpt, tmp_path, capsys) -> None:
    save = tmp_path / "q"
    code, err = _run(capsys, "--load", str(ckpt), "--save", str(save), "--report",
                     str(save / "reports" / "quantize.json"))  # fmt: skip
    assert code == 0, err
    assert (save / "reports" / "quantize.json").is_file()
    assert load_model(save)[0] is not None


@pytest.mark.parametrize("fmt", ["gguf", "hf", "trtllm"])
def test_export_of_an_moe_model_is_refused_by_name_before_work(fmt, tmp_path, capsys) -> None:
    """Each exporter writes dense MLPs only; it used to crash on the MoELayer (GGUF) or on
    the experts' names (hf, trtllm) after calibrating and quantizing."""
    torch.manual_seed(0)
    config = tiny_llama(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
    folder = tmp_path / "moe"
    save_model(folder, GPTModel(config), config, None)
    code, err = _run(capsys, "--load", str(folder), "--save", str(tmp_path / "q"),
                     "--export-format", fmt)  # fmt: skip
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"--export-format {fmt}: decoder.layers.0.mlp (MoELayer) cannot be written" in err
    assert not (tmp_path / "q").exists()
    assert not list(tmp_path.glob(".q.*"))


def test_no_progress_bar_is_the_name_and_no_progress_its_alias() -> None:
    parser = cli.build_parser()
    base = ["--load", "a", "--save", "b", "--recipe", "int8_wo"]
    assert parser.parse_args([*base, "--no-progress-bar"]).no_progress is True
    assert parser.parse_args([*base, "--no-progress"]).no_progress is True
    assert parser.parse_args(base).no_progress is False
    text = subprocess.run(
        [sys.executable, "-m", "mg.quantize_export.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--no-progress-bar, --no-progress" in text
    assert "--no-progress is an alias" in " ".join(text.split())
    (overwrite,) = [a for a in parser._actions if a.option_strings == ["--overwrite"]]
    assert "--overwrite-checkpoints" in overwrite.help
