"""No tool deletes or writes into its own input: an output that is, contains or lies
inside an input is refused in one line naming both flags, exit status 2, before a byte
is written (mg-quantize's own cases, the float checkpoint deleted by
`--save == --load --overwrite`, are in its package's tests)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from fault_helpers import exit_code, tree_digest


def _refused(capsys, call: Callable[[], int | None], *says: str) -> str:
    code = exit_code(call)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for text in says:
        assert text in err, err
    return err


@pytest.fixture
def work(artifacts: Path, tmp_path: Path) -> Path:
    """Copies of the fault artifacts (tools here must not touch them, but a failing case
    must not spoil the session's)."""
    for name in ("dist", "torch", "hf"):
        shutil.copytree(artifacts / name, tmp_path / "ckpts" / name)
    for suffix in (".bin", ".idx"):
        shutil.copy(artifacts / f"data_text_document{suffix}", tmp_path / f"data{suffix}")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text('{"text": "one two three"}\n{"text": "four five"}\n')
    return tmp_path


@pytest.mark.parametrize(
    "argv, says",
    [
        (["export-hf", "--load", "{c}/dist", "--save", "{c}/dist"], "--save {c}/dist is the input"),
        (["export-hf", "--load", "{c}/dist", "--save", "{c}"], "--save {c} contains the input"),
        (
            ["export-hf", "--load", "{c}/dist", "--save", "{c}", "--overwrite"],
            "--save {c} contains the input --load {c}/dist",
        ),
        (
            ["import-hf", "{c}/hf", "--save", "{c}/hf/mg"],
            "--save {c}/hf/mg lies inside the input SRC",
        ),
        (
            ["format", "--to", "torch_dist", "--load", "{c}/torch", "--save", "{c}/torch"],
            "--save {c}/torch is the input --load {c}/torch",
        ),
        (
            ["reshard", "--load", "{c}/torch", "--save", "{c}/torch/tp1"],
            "--save {c}/torch/tp1 lies inside the input --load",
        ),
        (
            ["import-megatron", "--load", "{c}/torch", "--save", "{c}"],
            "--save {c} contains the input --load {c}/torch",
        ),
        (
            ["export-megatron", "--load", "{c}/torch", "--save", "{c}/torch"],
            "--save {c}/torch is the input",
        ),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else None,
)
def test_convert_refuses_its_input_as_output(work, argv, says, capsys) -> None:
    from mg.ckpt_convert.cli import main

    ckpts = str(work / "ckpts")
    before = tree_digest(work / "ckpts")
    argv = [a.format(c=ckpts) for a in argv]
    _refused(capsys, lambda: main(argv), says.format(c=ckpts), "choose a --save outside")
    assert tree_digest(work / "ckpts") == before


def test_prep_refuses_its_input_as_output(work, capsys) -> None:
    from mg.corpus_prep.cli import main

    corpus, data = work / "corpus", str(work / "data")
    before = tree_digest(work)
    tokenizer = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "127"]
    _refused(
        capsys,
        lambda: main(
            ["tokenize", "--input", str(corpus), "--output-prefix", f"{corpus}/tok", *tokenizer]
        ),  # fmt: skip
        f"--output-prefix {corpus}/tok_text_document.bin lies inside the input --input {corpus}",
    )
    _refused(
        capsys,
        lambda: main(["clean", "--input", f"{corpus}/*.jsonl", "--output", f"{corpus}/a.jsonl"]),
        f"--output {corpus}/a.jsonl is the input --input {corpus}/*.jsonl ({corpus}/a.jsonl)",
    )
    _refused(
        capsys,
        lambda: main(
            [
                "clean",
                "--input",
                str(corpus),
                "--output",
                str(work / "clean.jsonl"),
                "--summary-json",
                str(corpus / "summary.json"),
            ]
        ),  # fmt: skip
        f"--summary-json {corpus}/summary.json lies inside the input --input {corpus}",
    )
    _refused(
        capsys,
        lambda: main(["merge", "--input", data, "--output-prefix", data]),
        f"--output-prefix {data}.bin is the input --input {data}.bin",
    )
    _refused(
        capsys,
        lambda: main(
            ["refresh", "--input-dir", str(corpus), "--output-dir", f"{corpus}/shards", *tokenizer]
        ),  # fmt: skip
        f"--output-dir {corpus}/shards lies inside the input --input-dir {corpus}",
    )
    train = ["train-tokenizer", "--type", "byte-level-bpe", "--vocab-size", "300"]
    _refused(
        capsys,
        lambda: main([*train, "--input", str(corpus), "--output-dir", str(corpus)]),
        f"--output-dir {corpus} is the input --input {corpus}",
    )
    assert tree_digest(work) == before


def test_eval_report_never_lands_on_its_input(work, capsys) -> None:
    from mg.evaluate.cli import main

    lambada = work / "corpus" / "a.jsonl"
    before = tree_digest(work)
    load = str(work / "ckpts" / "dist")
    _refused(
        capsys,
        lambda: main(
            ["lambada", "--load", load, "--valid-data", str(lambada), "--report", str(lambada)]
        ),  # fmt: skip
        f"--report {lambada} is the input --valid-data {lambada}",
    )
    _refused(
        capsys,
        lambda: main(
            [
                "ppl",
                "--load",
                load,
                "--data-path",
                str(work / "data"),
                "--report",
                str(work / "data.idx"),
            ]
        ),  # fmt: skip
        f"--report {work / 'data.idx'} is the input --data-path {work / 'data.idx'}",
    )
    _refused(
        capsys,
        lambda: main(
            [
                "ppl",
                "--load",
                load,
                "--data-path",
                str(work / "data"),
                "--report",
                f"{load}/report.jsonl",
            ]
        ),  # fmt: skip
        f"--report {load}/report.jsonl lies inside the input --load {load}",
    )
    assert tree_digest(work) == before
