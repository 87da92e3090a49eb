"""Megatron-LM's own example scripts and docs recipes, flag for flag, through mg-train.

`data/megatron_example_flags.yaml` holds the flag lists of core_v0.16.1's
examples/ (gpt3 175B and the README's 345M, llama3 8B fp8, mixtral 8x7B, bert,
t5, mamba) and of the docs' training recipes. Every flag must be recognised (no
argparse "unrecognized arguments"); a list mg-train cannot run is refused in one
line that starts with the flag at fault, in-process and through `mg-train`
itself (exit 2). Where Megatron refuses a list too the YAML names the flag, and
its smallest fix must then pass `--dry-run`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from mg.trainer.arguments import ArgumentError, build_parser, parse_args
from mg.trainer.cli import main

CASES: dict[str, dict[str, Any]] = yaml.safe_load(
    (Path(__file__).parent / "data" / "megatron_example_flags.yaml").read_text("utf-8")
)
FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The YAML's placeholders: a tiny indexed dataset, real tokenizer files, folders."""
    from mg.core.fixtures import fixture_path
    from mg.indexed_dataset import IndexedDatasetBuilder

    folder = tmp_path_factory.mktemp("megatron_examples")
    prefix = str(folder / "corpus_text_document")
    with IndexedDatasetBuilder(prefix + ".bin", np.uint16) as builder:
        for doc in range(8):
            builder.add_document([doc + 1] * 5, [5])
        builder.finalize(prefix + ".idx")
    return {
        "data": prefix,
        "gpt2_vocab": str(fixture_path("gpt2-bpe", "vocab.json")),
        "gpt2_merges": str(fixture_path("gpt2-bpe", "merges.txt")),
        "bert_vocab": str(fixture_path("minilm-bert", "vocab.txt")),
        "spm_model": str(fixture_path("mistral-spm", "tokenizer.model")),
        "ckpt": str(folder / "ckpt"),
        "tensorboard": str(folder / "tensorboard"),
        "cache": str(folder / "cache"),
    }


def _argv(case: dict[str, Any], paths: dict[str, str], flags: list[str] | None = None) -> list:
    return [case["family"], *(str(a).format(**paths) for a in flags or case["argv"])]


def _fixed(case: dict[str, Any]) -> list[str]:
    """The case's flags with `fix` applied: dropped flags lose their values too."""
    fix, out, skipping = case["fix"], [], False
    for token in map(str, case["argv"]):
        if token.startswith("--"):
            skipping = token in fix.get("drop", [])
        if not skipping:
            out.append(token)
    return out + [str(a) for a in fix.get("add", [])]


def _check_refusal(message: str, argv: list[str]) -> None:
    """One line, naming a flag of the list, or a flag the list lacks (--tokenizer-type)."""
    assert "\n" not in message, message
    named = FLAG.match(message) or FLAG.search(message)
    assert named, f"the refusal names no flag: {message}"
    known = {option for action in build_parser()._actions for option in action.option_strings}
    assert named.group(0) in {*argv, *known}, f"{named.group(0)} is no mg-train flag: {message}"


@pytest.mark.parametrize("name", CASES)
def test_every_flag_is_recognised(name: str, paths: dict[str, str]) -> None:
    case = CASES[name]
    argv = _argv(case, paths)
    known = {option for action in build_parser()._actions for option in action.option_strings}
    assert [a for a in argv if a.startswith("--") and a not in known] == []
    build_parser().parse_args(argv)  # values too: choices, nargs, types


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
@pytest.mark.parametrize("name", CASES)
def test_each_refusal_is_one_line_naming_its_flag(
    name: str, dry_run: bool, paths: dict[str, str]
) -> None:
    case = CASES[name]
    argv = _argv(case, paths) + (["--dry-run"] if dry_run else [])
    try:
        args = parse_args(argv, world_size=case["world_size"])
        if dry_run:  # the plan itself: tokenizer, config, memory, meta-device model
            from mg.trainer.dry_run import report

            assert report(args).startswith(f"mg-train dry run: {case['family']}")
    except ArgumentError as error:
        _check_refusal(str(error), argv)
        if "refused" in case:
            assert str(error).startswith(case["refused"]), str(error)
    else:
        assert "refused" not in case, f"Megatron refuses {name} ({case['refused']}); mg did not"


@pytest.mark.parametrize("name", [n for n in CASES if "refused" in CASES[n]])
def test_refusal_through_the_command_line(
    name: str, paths: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    case = CASES[name]
    monkeypatch.setenv("WORLD_SIZE", str(case["world_size"]))
    assert main([*_argv(case, paths), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mg-train: error: {case['refused']}"), err
    assert "unrecognized arguments" not in err[0]


@pytest.mark.parametrize("name", [n for n in CASES if "fix" in CASES[n]])
def test_fixed_list_passes_dry_run(
    name: str, paths: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    case = CASES[name]
    monkeypatch.setenv("WORLD_SIZE", str(case["world_size"]))
    assert main([*_argv(case, paths, _fixed(case)), "--dry-run"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.startswith(f"mg-train dry run: {case['family']}"), out
    assert f"world {case['world_size']} =" in out, out
