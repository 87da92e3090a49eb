"""Progress output: a tqdm bar on a terminal only; plain lines (no carriage returns) in logs."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys

import pytest

from mg.core.fixtures import fixture_path
from mg.corpus_prep.progress import MIB, Progress, eta_seconds, format_eta


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_with_rates_and_eta_when_not_a_terminal() -> None:
    log = io.StringIO()
    progress = Progress(10 * MIB, log_interval=0, stream=log, plain_every=0.0)
    progress.update(documents=100, nbytes=MIB, tokens=250_000)
    progress.update(documents=100, nbytes=MIB, tokens=250_000)
    progress.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert len(lines) == 2
    assert lines[1].startswith("tokenize: 2.0 of 10.0 MB (20%), 200 documents (")
    for part in ("docs/s", "MB/s", "tokens/s)", "; ETA 0:"):
        assert part in lines[1], lines[1]


def test_plain_lines_are_periodic_and_off_with_no_progress_bar() -> None:
    log = io.StringIO()
    progress = Progress(None, log_interval=0, stream=log, plain_every=3600.0)
    progress.update(1, 100, 10)
    assert log.getvalue() == ""  # not before the period is over
    quiet = io.StringIO()
    progress = Progress(MIB, log_interval=0, show_bar=False, stream=quiet, plain_every=0.0)
    progress.update(1, 100, 10)
    progress.close()
    assert quiet.getvalue() == ""


def test_a_terminal_gets_the_bar_not_plain_lines() -> None:
    tty = Terminal()
    progress = Progress(MIB, log_interval=0, stream=tty, plain_every=0.0)
    progress.update(1, 100, 10)
    progress.close()
    assert "\r" in tty.getvalue() and "tokenize: 0.0 of" not in tty.getvalue()


def test_a_logged_run_has_no_carriage_returns(tmp_path) -> None:
    corpus = tmp_path / "c.jsonl"
    text = fixture_path("botchan", "botchan.txt").read_text("utf-8")[:20000]
    corpus.write_text("".join(json.dumps({"text": p}) + "\n" for p in text.splitlines() if p))
    vocab = fixture_path("gpt2-bpe", "vocab.json")
    result = subprocess.run(
        [sys.executable, "-m", "mg.corpus_prep", "tokenize", "--input", str(corpus),
         "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "GPT2BPETokenizer",
         "--vocab-file", str(vocab), "--merge-file", str(vocab.with_name("merges.txt")),
         "--workers", "1", "--log-interval", "10"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr
    assert "Processed 256 documents (" in result.stderr  # per chunk of 256 lines


class FakeClock:
    """Seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_eta_is_the_bytes_left_at_the_rate_so_far() -> None:
    assert eta_seconds(25, 100, 10.0) == 30.0  # 2.5 B/s, 75 B left
    assert eta_seconds(100, 100, 10.0) == 0.0
    assert eta_seconds(120, 100, 10.0) == 0.0  # never negative
    assert eta_seconds(0, 100, 10.0) is None  # no rate yet
    assert eta_seconds(10, None, 10.0) is None  # compressed inputs: no total
    assert format_eta(3725.4) == "1:02:05"
    assert format_eta(None) == "?"


def test_progress_lines_with_a_fake_clock() -> None:
    clock, log = FakeClock(), io.StringIO()
    progress = Progress(4 * MIB, log_interval=100, stream=log, plain_every=0.0, clock=clock)
    clock.now += 2.0
    progress.update(documents=100, nbytes=MIB, tokens=1000)
    clock.now += 2.0
    progress.update(documents=100, nbytes=MIB, tokens=1000)
    lines = log.getvalue().splitlines()
    assert (
        lines[0] == "Processed 100 documents (50.00 docs/s, 0.50 MB/s, 500 tokens/s, ETA 0:00:06)."
    )
    assert lines[1] == (
        "tokenize: 1.0 of 4.0 MB (25%), 100 documents (50 docs/s, 0.50 MB/s, 500 tokens/s); "
        "ETA 0:00:06"
    )
    # twice the input in twice the time: the same rate, half of it left
    assert lines[2].startswith("Processed 200 documents (50.00 docs/s, 0.50 MB/s, 500 tokens/s, ")
    assert lines[2].endswith("ETA 0:00:04).")
    assert lines[3].endswith("; ETA 0:00:04")
    clock.now += 1.5
    assert progress.close() == 5.5


def test_progress_of_shards_without_tokens() -> None:
    clock, log = FakeClock(), io.StringIO()
    progress = Progress(
        10 * MIB, 0, stream=log, plain_every=0.0, clock=clock, label="clean", counts_tokens=False
    )
    clock.now += 10.0
    progress.update(documents=500, nbytes=5 * MIB, tokens=0)
    assert log.getvalue() == (
        "clean: 5.0 of 10.0 MB (50%), 500 documents (50 docs/s, 0.50 MB/s); ETA 0:00:10\n"
    )


@pytest.mark.parametrize("backend", ["classic", "gigatoken"])
def test_every_backend_logs_rates_and_the_eta(tmp_path, backend) -> None:
    if backend == "gigatoken":
        pytest.importorskip("gigatoken")
    corpus = tmp_path / "c.jsonl"
    text = fixture_path("botchan", "botchan.txt").read_text("utf-8")[:20000]
    corpus.write_text("".join(json.dumps({"text": p}) + "\n" for p in text.splitlines() if p))
    vocab = fixture_path("gpt2-bpe", "vocab.json")
    result = subprocess.run(
        [sys.executable, "-m", "mg.corpus_prep", "tokenize", "--input", str(corpus),
         "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "GPT2BPETokenizer",
         "--vocab-file", str(vocab), "--merge-file", str(vocab.with_name("merges.txt")),
         "--workers", "1", "--log-interval", "10", "--tokenizer-backend", backend],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = re.findall(
        r"Processed \d+ documents \([\d.]+ docs/s, [\d.]+ MB/s, [\d,]+ tokens/s, "
        r"ETA (\d+:\d\d:\d\d)\)\.",
        result.stderr,
    )
    assert lines and lines[-1] == "0:00:00", result.stderr
