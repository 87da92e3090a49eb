"""Progress output: a tqdm bar on a terminal only; plain lines (no carriage returns) in logs."""

from __future__ import annotations

import io
import json
import subprocess
import sys

from mg.core.fixtures import fixture_path
from mg.corpus_prep.progress import MIB, Progress


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
