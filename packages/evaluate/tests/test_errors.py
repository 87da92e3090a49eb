"""Bad input ends in one clear line, `mg-eval <task>: error: FILE:LINE: ...`, no traceback."""

import json
import subprocess
import sys

import pytest

from mg.evaluate.cli import main


def error_of(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip()


def test_wikitext_refuses_json_lines(zero_ckpt, tmp_path, capsys) -> None:
    data = tmp_path / "lambada.jsonl"
    data.write_text('\n{"text": "a b c"}\n')
    err = error_of(capsys, "wikitext", "--load", str(zero_ckpt), "--valid-data", str(data))
    assert err.startswith(f"mg-eval wikitext: error: {data}:2: this looks like JSON lines")


def test_binary_file(zero_ckpt, tmp_path, capsys) -> None:
    data = tmp_path / "corpus.bin"
    data.write_bytes(b"abc\ndef\x00\x01\x02")
    err = error_of(capsys, "wikitext", "--load", str(zero_ckpt), "--valid-data", str(data))
    assert err.startswith(f"mg-eval wikitext: error: {data}:2: binary data")
    data.write_bytes(b"ok\n\xff\xfe")
    err = error_of(capsys, "lambada", "--load", str(zero_ckpt), "--valid-data", str(data))
    assert err.startswith(f"mg-eval lambada: error: {data}:2: not UTF-8 text")


@pytest.mark.parametrize("task", ["wikitext", "lambada"])
def test_empty_file(zero_ckpt, tmp_path, capsys, task) -> None:
    data = tmp_path / "empty.txt"
    data.write_text("\n  \n")
    err = error_of(capsys, task, "--load", str(zero_ckpt), "--valid-data", str(data))
    assert (
        err == f"mg-eval {task}: error: {data}: the file is empty; {task} has nothing to evaluate"
    )


def test_lambada_line_without_text(zero_ckpt, tmp_path, capsys) -> None:
    data = tmp_path / "l.jsonl"
    data.write_text(json.dumps({"text": "a b c"}) + "\n" + json.dumps({"sentence": "x y"}) + "\n")
    err = error_of(capsys, "lambada", "--load", str(zero_ckpt), "--valid-data", str(data))
    assert err == f"mg-eval lambada: error: {data}:2: no \"text\" field (got ['sentence'])"


def test_lambada_line_not_json(zero_ckpt, tmp_path, capsys) -> None:
    data = tmp_path / "wiki.tokens"
    data.write_text(" = Title = \n")
    err = error_of(capsys, "lambada", "--load", str(zero_ckpt), "--valid-data", str(data))
    assert err.startswith(f"mg-eval lambada: error: {data}:1: not JSON")


def test_lambada_line_longer_than_the_context(zero_ckpt, tmp_path, capsys) -> None:
    data = tmp_path / "l.jsonl"
    lines = [{"text": "short and fine"}, {"text": " ".join(["word"] * 80)}]
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    err = error_of(capsys, "lambada", "--load", str(zero_ckpt), "--valid-data", str(data))
    assert err.startswith(f"mg-eval lambada: error: {data}:2: context + target are 79 + 1 tokens")
    assert "--seq-length 64" in err


def test_flags_and_checkpoint(zero_ckpt, tmp_path, capsys) -> None:
    data = tmp_path / "w.tokens"
    data.write_text(" a b c . \n")
    err = error_of(capsys, "wikitext", "--load", str(tmp_path / "nope"), "--valid-data", str(data))
    assert "no such checkpoint folder" in err
    err = error_of(
        capsys,
        "wikitext",
        "--load",
        str(zero_ckpt),
        "--valid-data",
        str(data),
        "--seq-length",
        "65",
    )
    assert "exceeds the model's max_position_embeddings 64" in err
    err = error_of(
        capsys, "wikitext", "--load", str(zero_ckpt), "--valid-data", str(data),
        "--overlapping-eval", "100",
    )  # fmt: skip
    assert "--overlapping-eval 100 must be between 1 and --seq-length 64" in err
    err = error_of(capsys, "ppl", "--load", str(zero_ckpt), "--data-path", str(tmp_path / "none"))
    assert err.startswith("mg-eval ppl: error: --data-path")


def test_console_entry_point_prints_no_traceback(tmp_path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mg.evaluate",
            "lambada",
            "--load",
            str(tmp_path),
            "--valid-data",
            "x",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("mg-eval lambada: error: ")
    assert "Traceback" not in result.stderr
