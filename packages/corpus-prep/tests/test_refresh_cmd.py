"""`mg-prep refresh` with a real tokenizer (GPT-2 BPE from the fixture), in and out of process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from mg.core.fixtures import fixture_path
from mg.corpus_prep.cli import main
from mg.corpus_prep.refresh_manifest import load_manifest
from mg.indexed_dataset.format import IndexedDataset


@pytest.fixture(scope="module")
def gpt2_flags() -> list[str]:
    return [
        "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", str(fixture_path("gpt2-bpe", "vocab.json")),
        "--merge-file", str(fixture_path("gpt2-bpe", "merges.txt")),
        "--workers", "0",
    ]  # fmt: skip


def run_cli(*argv: str) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main([*map(str, argv)])
    return exit_info.value.code


def refresh_cli(tmp_path, flags, *extra) -> int:
    inputs = ["--input-dir", tmp_path / "in", "--output-dir", tmp_path / "out"]
    return run_cli("refresh", *inputs, *flags, *extra)


def add_file(tmp_path, name: str, texts: list[str]) -> None:
    path = tmp_path / "in" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def blend(tmp_path) -> list[tuple[int, str]]:
    lines = (tmp_path / "out" / "blend.txt").read_text().splitlines()
    return [(int(w), p) for w, p in (line.split() for line in lines)]


def test_shards_are_what_tokenize_writes_and_only_new_files_run(tmp_path, gpt2_flags, capsys):
    add_file(tmp_path, "a.jsonl", ["Hello world.", "A second document."])
    assert refresh_cli(tmp_path, gpt2_flags, "--append-eod") == 0
    (weight, prefix), = blend(tmp_path)  # fmt: skip

    # byte-identical to `mg-prep tokenize` on the same file
    reference = tmp_path / "ref" / "a"
    status = run_cli(
        "tokenize", "--input", tmp_path / "in" / "a.jsonl", "--output-prefix", reference,
        *gpt2_flags, "--append-eod",
    )  # fmt: skip
    assert status == 0
    for extension in (".bin", ".idx"):
        with (
            open(prefix + extension, "rb") as ours,
            open(f"{reference}_text_document{extension}", "rb") as ref,
        ):
            assert ours.read() == ref.read()
    with IndexedDataset(prefix) as data:
        assert weight == data.num_tokens == 3 + 1 + 4 + 1  # "Hello world." + eod, ...
        assert data[0].tolist() == [15496, 995, 13, 50256]

    capsys.readouterr()
    add_file(tmp_path, "b.jsonl", ["New data arrives."])
    assert refresh_cli(tmp_path, gpt2_flags, "--append-eod") == 0
    log = capsys.readouterr().out
    assert "b.jsonl: tokenizing" in log and "a.jsonl: tokenizing" not in log
    manifest = load_manifest(tmp_path / "out")
    assert manifest.generation == 2 and sorted(manifest.inputs) == ["a.jsonl", "b.jsonl"]
    assert [p for _, p in blend(tmp_path)][0] == prefix


def test_output_flags_change_the_fingerprint_speed_flags_do_not(tmp_path, gpt2_flags, capsys):
    add_file(tmp_path, "a.jsonl", ["Hello world."])
    add_file(tmp_path, "b.jsonl", ["Hello again."])
    assert refresh_cli(tmp_path, gpt2_flags) == 0
    first = load_manifest(tmp_path / "out").fingerprint
    capsys.readouterr()

    faster = [*gpt2_flags[:-2], "--workers", "2", "--log-interval", "5"]
    assert refresh_cli(tmp_path, faster) == 0
    assert "nothing new" in capsys.readouterr().out
    assert load_manifest(tmp_path / "out").fingerprint == first

    assert refresh_cli(tmp_path, gpt2_flags, "--append-eod") == 0
    log = capsys.readouterr().out
    assert "process a.jsonl (options changed)" in log and "process b.jsonl (options changed)" in log
    assert [w for w, _ in blend(tmp_path)] == [4, 4]


def test_dry_run_and_changed_file(tmp_path, gpt2_flags, capsys):
    add_file(tmp_path, "a.jsonl", ["Hello world."])
    assert refresh_cli(tmp_path, gpt2_flags) == 0
    add_file(tmp_path, "a.jsonl", ["Hello world, changed."])
    before = (tmp_path / "out" / "manifest.json").read_bytes()
    capsys.readouterr()
    assert refresh_cli(tmp_path, gpt2_flags, "--dry-run") == 0
    assert "would process a.jsonl (changed)" in capsys.readouterr().out
    assert (tmp_path / "out" / "manifest.json").read_bytes() == before
    assert refresh_cli(tmp_path, gpt2_flags, "--prune") == 0
    assert [w for w, _ in blend(tmp_path)] == [5]
    assert len(os.listdir(tmp_path / "out" / "shards")) == 2  # the old shard was pruned


def test_bad_line_fails_and_publishes_nothing(tmp_path, gpt2_flags, capsys):
    add_file(tmp_path, "a.jsonl", ["Hello world."])
    assert refresh_cli(tmp_path, gpt2_flags) == 0
    before = (tmp_path / "out" / "blend.txt").read_bytes()
    (tmp_path / "in" / "b.jsonl").write_text('{"text": "ok"}\n{"oops": 1}\n')
    assert refresh_cli(tmp_path, gpt2_flags) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'in' / 'b.jsonl'}:2" in err and "unchanged" in err
    assert (tmp_path / "out" / "blend.txt").read_bytes() == before
    # and with --on-error skip the good line goes in
    assert refresh_cli(tmp_path, gpt2_flags, "--on-error", "skip") == 0
    assert [w for w, _ in blend(tmp_path)] == [3, 1]


def cli_process(tmp_path, flags, *extra, **env) -> subprocess.Popen:
    argv = ["refresh", "--input-dir", str(tmp_path / "in"), "--output-dir", str(tmp_path / "out")]
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from mg.corpus_prep.cli import main; main()",
            *argv,
            *flags,
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


def wait_for_pause(process: subprocess.Popen, stage: str) -> None:
    for line in process.stderr:
        if line.strip() == f"refresh: paused at {stage}":
            return
    raise AssertionError(f"the refresh never paused at {stage}")


def test_kill_9_then_concurrent_runs_through_the_command(tmp_path, gpt2_flags):
    add_file(tmp_path, "a.jsonl", ["Hello world."])
    assert refresh_cli(tmp_path, gpt2_flags) == 0
    published = {n: (tmp_path / "out" / n).read_bytes() for n in ("blend.txt", "manifest.json")}
    add_file(tmp_path, "b.jsonl", ["More text to tokenize."])

    victim = cli_process(tmp_path, gpt2_flags, MG_REFRESH_PAUSE_AT="shards-moved")
    wait_for_pause(victim, "shards-moved")
    # while it holds the lock, a second run gives up after its timeout, with status 0
    second = cli_process(tmp_path, gpt2_flags, "--lock-timeout", "0.5")
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 0 and "another refresh is running" in out
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert {n: (tmp_path / "out" / n).read_bytes() for n in published} == published
    with IndexedDataset(blend(tmp_path)[0][1]) as data:
        assert data.num_tokens == 3

    survivor = cli_process(tmp_path, gpt2_flags, "--lock-timeout", "60")
    out, err = survivor.communicate(timeout=120)
    assert survivor.returncode == 0, err
    assert "b.jsonl: re-using shards built by an interrupted run" in out
    assert [w for w, _ in blend(tmp_path)] == [3, 6]  # More| text| to| token|ize|.
    assert load_manifest(tmp_path / "out").generation == 2
