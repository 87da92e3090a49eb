"""mg-prep under output faults and signals: clean errors, no temp files, nothing published
after an interrupt, no orphan workers."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_helpers import exit_code, tree_digest

from mg.core.fixtures import fixture_path

GPT2 = [
    "--tokenizer-type",
    "GPT2BPETokenizer",
    "--vocab-file",
    str(fixture_path("gpt2-bpe", "vocab.json")),
    "--merge-file",
    str(fixture_path("gpt2-bpe", "merges.txt")),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Botchan, three lines a document, repeated: about 2 MB, some seconds to tokenize."""
    lines = [x for x in fixture_path("botchan", "botchan.txt").read_text().splitlines() if x]
    docs = [" ".join(lines[i : i + 3]) for i in range(0, len(lines), 3)]
    path = tmp_path_factory.mktemp("prep-corpus") / "corpus.jsonl"
    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(8):
            for doc in docs:
                handle.write(json.dumps({"text": doc}) + "\n")
    return path


@pytest.fixture(scope="module")
def small(corpus, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prep-small") / "small.jsonl"
    path.write_text("".join(corpus.read_text().splitlines(keepends=True)[:200]))
    return path


def prep(*argv: str) -> int:
    from mg.corpus_prep.cli import main

    return exit_code(lambda: main(["tokenize", *argv, *GPT2, "--no-progress-bar"]))


# --------------------------------------------------------------------------- output faults


def test_output_path_through_a_file(small, tmp_path, capsys) -> None:
    (tmp_path / "afile").write_text("x")
    assert prep("--input", str(small), "--output-prefix", str(tmp_path / "afile/c")) == 2
    err = capsys.readouterr().err
    assert "a part of the path is a file, not a folder" in err and "Traceback" not in err
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("fault", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_write_fault_leaves_no_temp_files(small, tmp_path, monkeypatch, capsys, fault) -> None:
    """Disk full / read-only / denied while the .bin is written (a patched writer: works as
    root and without a small tmpfs); earlier outputs in the folder stay byte-identical."""
    from mg.indexed_dataset import builder

    out = tmp_path / "out"
    out.mkdir()
    (out / "old_text_document.bin").write_bytes(b"earlier run")
    before = tree_digest(out)
    calls = {"n": 0}
    real = builder.IndexedDatasetBuilder._write

    def failing(self, tokens):
        calls["n"] += 1
        if calls["n"] > 50:
            raise OSError(fault, os.strerror(fault), self._bin_temporary)
        return real(self, tokens)

    monkeypatch.setattr(builder.IndexedDatasetBuilder, "_write", failing)
    code = prep("--input", str(small), "--output-prefix", str(out / "c"), "--workers", "0")
    err = capsys.readouterr().err
    assert code == 2, err
    assert os.strerror(fault) in err and "nothing was published" in err, err
    assert tree_digest(out) == before  # no temp file, no half dataset


def test_workers_capped(small, tmp_path, capsys, monkeypatch) -> None:
    from mg.corpus_prep import tokenize_cmd

    monkeypatch.setattr(tokenize_cmd, "default_workers", lambda: 1)
    code = prep("--input", str(small), "--output-prefix", str(tmp_path / "c"), "--workers", "1000")
    err = capsys.readouterr().err
    assert code == 0, err
    assert "--workers 1000 is more than this machine can use (1 CPUs); using 4" in err
    assert "4 worker(s)" in err


def test_zero_documents_warns(tmp_path, capsys) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert prep("--input", str(empty), "--output-prefix", str(tmp_path / "c")) == 0
    assert "the dataset holds 0 documents" in capsys.readouterr().err


def test_signal_while_publishing_completes_the_files_and_exits_nonzero(
    small, tmp_path, monkeypatch, capsys
) -> None:
    from mg.corpus_prep import writer

    real = writer.DatasetWriter.finalize

    def interrupted(self):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives between the renames
        return real(self)

    monkeypatch.setattr(writer.DatasetWriter, "finalize", interrupted)
    try:
        code = prep("--input", str(small), "--output-prefix", str(tmp_path / "c"))
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGTERM, err
    assert "interrupted (SIGTERM) while publishing" in err
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("c_"))
    assert names == ["c_text_document.bin", "c_text_document.idx"]  # a whole pair, no .tmp


def test_signal_just_before_publishing_publishes_nothing(
    small, tmp_path, monkeypatch, capsys
) -> None:
    """An interrupt that some library swallowed still stops the publish."""
    from mg.corpus_prep import interrupts, pipeline

    real = pipeline.tokenize_segments

    def swallowed(*args, **kwargs):
        stats = real(*args, **kwargs)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
        except KeyboardInterrupt:
            pass  # e.g. a thread pool's wait loop
        return stats

    monkeypatch.setattr(pipeline, "tokenize_segments", swallowed)
    try:
        code = prep("--input", str(small), "--output-prefix", str(tmp_path / "c"))
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert code == 130, capsys.readouterr().err
    assert interrupts.received() == signal.SIGINT
    assert not list(tmp_path.glob("c_*"))


# --------------------------------------------------------------------------- real signals


def _start(corpus: Path, out: Path, workers: int = 2) -> subprocess.Popen:
    argv = [sys.executable, "-m", "mg.corpus_prep", "tokenize", "--input", str(corpus)]
    argv += ["--output-prefix", str(out / "c"), *GPT2, "--workers", str(workers)]
    argv += ["--no-progress-bar", "--log-interval", "200"]
    return subprocess.Popen(
        argv, stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=out.parent
    )


def _wait_for_progress(process: subprocess.Popen) -> str:
    seen = ""
    while "Processed" not in seen:
        line = process.stderr.readline()
        assert line, f"mg-prep ended before any progress: {seen}"
        seen += line
    return seen


def _children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(x) for x in found.stdout.split()]


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


@pytest.mark.slow
@pytest.mark.parametrize(
    ("phase", "signum", "whole_group"),
    [
        ("start-up", signal.SIGINT, True),
        ("start-up", signal.SIGTERM, False),
        ("run", signal.SIGINT, True),  # Ctrl-C in a terminal reaches the workers too
        ("run", signal.SIGTERM, False),
    ],
)
def test_signal_interrupts_and_publishes_nothing(corpus, tmp_path, phase, signum, whole_group):
    out = tmp_path / "out"
    out.mkdir()
    process = _start(corpus, out)
    if phase == "start-up":
        time.sleep(0.3)
    else:
        _wait_for_progress(process)
    workers = _children(process.pid)
    if whole_group:
        os.killpg(process.pid, signum)
    else:
        process.send_signal(signum)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signum, err
    assert f"interrupted ({signal.Signals(signum).name}); nothing was published" in err, err
    assert "Traceback" not in err, err
    assert list(out.iterdir()) == []  # no dataset, no temp file
    time.sleep(0.5)
    assert _alive(workers) == []


@pytest.mark.slow
def test_kill_9_leaves_no_orphan_workers(corpus, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    process = _start(corpus, out)
    _wait_for_progress(process)
    workers = _children(process.pid)
    assert len(workers) >= 2
    process.kill()
    process.wait(timeout=30)
    deadline = time.time() + 10
    while _alive(workers) and time.time() < deadline:
        time.sleep(0.1)
    assert _alive(workers) == []
