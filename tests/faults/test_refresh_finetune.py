"""The cron refresh feeds training: `mg-prep refresh` publishes OUT/blend.txt and the
justfile's `finetune-refresh` recipe trains on it; a shard too small for the --split is
named, with the split and the fix, before the checkpoint is loaded or a model built."""

from __future__ import annotations

import json
import random
import shlex
from pathlib import Path

import pytest
from fault_helpers import exit_code

from mg.corpus_prep.cli import main as prep
from mg.trainer.cli import main as train

JUSTFILE = Path(__file__).resolve().parents[2] / "justfile"


def recipe_argv(name: str, **values: str) -> list[str]:
    """The mg-train arguments of a justfile recipe's command, its {{parameters}} filled in."""
    lines = JUSTFILE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{name} "))
    body = []
    for line in lines[start + 1 :]:
        if not line.startswith("    "):
            break
        body.append(line.strip().removesuffix("\\"))
    command = " ".join(body)
    for key, value in values.items():
        command = command.replace("{{" + key + "}}", value)
    words = shlex.split(command)
    launcher = (
        ["exec", "bin/mg-train"] if words[0] == "exec" else ["uv", "run", "--frozen", "mg-train"]
    )
    assert words[: len(launcher)] == launcher, words
    assert "{{" not in command, command
    return words[len(launcher) :]


@pytest.fixture()
def refresh_out(tmp_path: Path) -> Path:
    """A fresh input folder of two small JSONL files (ids for the 127-id NullTokenizer the
    fault checkpoints use), refreshed into shards + blend.txt."""
    rng = random.Random(0)
    inputs = tmp_path / "incoming"
    inputs.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        docs = [" ".join(str(rng.randint(1, 120)) for _ in range(60)) for _ in range(20)]
        (inputs / name).write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "refresh-out"
    argv = ["refresh", "--input-dir", str(inputs), "--output-dir", str(out)]
    argv += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--append-eod"]
    assert exit_code(lambda: prep([*argv, "--workers", "0"])) == 0
    assert len((out / "blend.txt").read_text().splitlines()) == 2
    return out


def test_small_shard_and_split_named_before_the_checkpoint_loads(
    artifacts, refresh_out, tmp_path, capsys, monkeypatch
) -> None:
    from mg.trainer import stages

    def never(*_args, **_kwargs):
        raise AssertionError("the checkpoint was loaded or the model built before the data check")

    monkeypatch.setattr(stages, "load_state", never)
    monkeypatch.setattr(stages, "build_model", never)
    argv = recipe_argv(
        "finetune-refresh",
        load=str(artifacts / "dist"),
        save=str(tmp_path / "ft"),
        refresh_dir=str(refresh_out),
        args="--split 969,30,1",  # Megatron's default: 0.1% of 20 documents is none
    )
    capsys.readouterr()
    assert exit_code(lambda: train(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    shard = next((refresh_out / "shards").glob("a.jsonl-*.idx")).with_suffix("")
    assert f"--data-args-path {shard}: --split 969,30,1 gives its test split" in err, err
    assert "none of its 20 sequences" in err
    assert "give test no share (--split 969,30,0)" in err, err
    assert not (tmp_path / "ft").exists()


def test_blend_file_or_refresh_folder_as_data_path_names_data_args_path(
    refresh_out, capsys
) -> None:
    base = ["gpt", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4"]
    base += ["--seq-length", "32", "--max-position-embeddings", "32", "--lr", "1e-3"]
    base += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--train-iters", "1"]
    base += ["--micro-batch-size", "2"]
    blend = refresh_out / "blend.txt"
    for given in (blend, refresh_out):
        capsys.readouterr()
        assert exit_code(lambda g=given: train([*base, "--data-path", str(g)])) == 2
        err = capsys.readouterr().err
        assert f"--data-args-path {blend}" in err, err
    assert exit_code(lambda: train([*base, "--data-args-path", str(refresh_out)])) == 2
    assert f"pass the blend file in it (mg-prep refresh writes {blend})" in capsys.readouterr().err


def test_refresh_output_finetunes_with_the_recipe(artifacts, refresh_out, tmp_path, capsys) -> None:
    save = tmp_path / "ft"
    argv = recipe_argv(
        "finetune-refresh",
        load=str(artifacts / "dist"),
        save=str(save),
        refresh_dir=str(refresh_out),
        args=f"--train-iters 3 --eval-interval 3 --eval-iters 1 --data-cache-path {tmp_path}/c",
    )
    capsys.readouterr()
    assert exit_code(lambda: train(argv)) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "validation loss at iteration 3" in out, out
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
