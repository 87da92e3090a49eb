"""`mg-prep <preprocess_data.py's arguments>`: Megatron's command lines, unchanged.

The argument lists in data/preprocess_data_lines.json are copied from
Megatron-LM's docs, examples and tests; only the file paths differ.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mg.core.fixtures import fixture_dir
from mg.corpus_prep.cli import build_parser, main, with_subcommand
from mg.corpus_prep.sample_corpus import real_corpus, write_jsonl

DATA = json.loads((Path(__file__).parent / "data" / "preprocess_data_lines.json").read_text())


def mg_prep(*args: object) -> int:
    try:
        main([str(a) for a in args])
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return 0


def tokenize_option_strings() -> set[str]:
    parser = build_parser("tokenize")
    tokenize = parser._subparsers._group_actions[0].choices["tokenize"]
    return {s for action in tokenize._actions for s in action.option_strings}


def test_every_preprocess_data_flag_and_tokenizer_type_is_recognised():
    assert set(DATA["flags"]) <= tokenize_option_strings()
    for kind in DATA["tokenizer_types"]:
        args = build_parser("tokenize").parse_args(
            with_subcommand(["--input", "c", "--output-prefix", "o", "--tokenizer-type", kind])
        )
        assert args.tokenizer_type == kind


@pytest.mark.parametrize("name", sorted(DATA["lines"]))
def test_megatron_command_lines_parse_as_tokenize(name):
    line = DATA["lines"][name]
    args = build_parser("tokenize").parse_args(with_subcommand(line))
    assert args.command == "tokenize"
    assert args.input == [line[line.index("--input") + 1]]
    assert args.output_prefix == line[line.index("--output-prefix") + 1]
    assert args.split_sentences == ("--split-sentences" in line)
    assert args.append_eod == ("--append-eod" in line)


def test_no_subcommand_is_tokenize_and_help_still_lists_commands(capsys):
    assert with_subcommand(["--input", "c.jsonl"]) == ["tokenize", "--input", "c.jsonl"]
    assert with_subcommand(["merge", "--input", "d"]) == ["merge", "--input", "d"]
    assert mg_prep("--help") == 0
    out = capsys.readouterr().out
    assert "COMMAND" in out and "tokenize" in out and "merge" in out


def test_a_preprocess_data_line_writes_what_mg_prep_tokenize_writes(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(corpus, real_corpus(wikipedia_pages=2))
    vocab = fixture_dir("minilm-bert") / "vocab.txt"
    line = [
        "--input", corpus, "--output-prefix", tmp_path / "plain",
        "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab,
        "--workers", "2", "--append-eod", "--split-sentences", "--keep-newlines",
        "--json-keys", "text", "--partitions", "2", "--log-interval", "100",
    ]  # fmt: skip
    assert mg_prep(*line) == 0
    line[line.index("--output-prefix") + 1] = tmp_path / "sub"
    assert mg_prep("tokenize", *line, "--partitions", "1", "--workers", "1") == 0
    for suffix in (".bin", ".idx"):
        plain = (tmp_path / f"plain_text_sentence{suffix}").read_bytes()
        assert plain == (tmp_path / f"sub_text_sentence{suffix}").read_bytes()
        assert len(plain) > 1000


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--tokenizer-type", "SFTTokenizer"], "--tokenizer-type SFTTokenizer"),
        (["--tokenizer-type", "MultimodalTokenizer"], "--tokenizer-type MultimodalTokenizer"),
        (["--tokenizer-metadata", "meta.json"], "--tokenizer-metadata"),
        (["--trust-remote-code"], "--trust-remote-code"),
        (["--tokenizer-sentencepiece-legacy"], "--tokenizer-sentencepiece-legacy"),
        (["--tokenizer-hf-include-special-tokens"], "--tokenizer-hf-include-special-tokens"),
    ],
)
def test_refused_tokenizer_flags_are_one_line_naming_the_flag(tmp_path, capsys, flags, named):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "x"}\n')
    vocab = fixture_dir("minilm-bert") / "vocab.txt"
    line = ["--input", corpus, "--output-prefix", tmp_path / "o", "--workers", "1"]
    if "--tokenizer-type" not in flags:
        line += ["--tokenizer-type", "BertWordPieceLowerCase"]
    assert mg_prep(*line, "--vocab-file", vocab, *flags) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and named in err and "not supported by mg-prep" in err
    assert not list(tmp_path.glob("o_*"))
