"""One 50 MB document: `mg-prep tokenize` stays under 1.5 GB for the whole process tree.

The case that took 9.5 GB: GPT-2 merges with a vocabulary whose ids do not
follow them (a trained one), so that Hugging Face `tokenizers` runs instead of
tiktoken and, encoding the whole document at once, kept ~330 bytes a token.
The RSS of mg-prep and its worker is sampled from /proc every 50 ms.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mg.core.fixtures import fixture_dir, fixture_path

LIMIT = 1.5 * (1 << 30)


def tree_rss(root: int) -> int:
    """Sum of VmRSS (bytes) over `root` and its descendants."""
    parents, rss = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                rss[int(entry)] = int(line.split()[1]) * 1024
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    return sum(rss.get(pid, 0) for pid in tree)


def trained_gpt2_vocab(folder: Path) -> Path:
    """OpenAI's GPT-2 vocab.json with two ids swapped: the `tokenizers` engine runs it."""
    vocab = json.loads(fixture_path("gpt2-bpe", "vocab.json").read_text("utf-8"))
    vocab["Ġthe"], vocab["Ġand"] = vocab["Ġand"], vocab["Ġthe"]
    path = folder / "vocab.json"
    path.write_text(json.dumps(vocab), encoding="utf-8")
    return path


def one_document(path: Path, megabytes: int) -> Path:
    texts = [fixture_path("botchan", "botchan.txt").read_text("utf-8")]
    texts += [p.read_text("utf-8") for p in sorted(fixture_dir("shakespeare").glob("*.txt"))]
    block = "\n\n".join(texts)
    text = block * (megabytes * (1 << 20) // len(block) + 1)
    path.write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
    return path


def tokenize_argv(corpus: Path, vocab: Path, output: Path) -> list[str]:
    return [
        sys.executable, "-m", "mg.corpus_prep", "tokenize", "--input", str(corpus),
        "--output-prefix", str(output), "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", str(vocab), "--merge-file", str(fixture_path("gpt2-bpe", "merges.txt")),
        "--workers", "1", "--append-eod",
    ]  # fmt: skip


def test_sigterm_during_a_huge_document_stops_at_once(tmp_path) -> None:
    """The worker is stopped, not waited for: encoding 30 MB takes it tens of seconds."""
    corpus = one_document(tmp_path / "one.jsonl", 30)
    argv = tokenize_argv(corpus, trained_gpt2_vocab(tmp_path), tmp_path / "out")
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(4)  # the worker has the document
    assert process.poll() is None, process.communicate()[0]
    sent = time.perf_counter()
    process.send_signal(signal.SIGTERM)
    log, _ = process.communicate(timeout=120)
    assert time.perf_counter() - sent < 5, log
    assert process.returncode == 128 + signal.SIGTERM, log
    assert "interrupted (SIGTERM); nothing was published." in log
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.jsonl", "vocab.json"]


@pytest.mark.slow
def test_a_50_mb_document_with_a_trained_gpt2_vocabulary_stays_under_1_5_gb(tmp_path) -> None:
    corpus = one_document(tmp_path / "one.jsonl", 50)
    argv = tokenize_argv(corpus, trained_gpt2_vocab(tmp_path), tmp_path / "out")
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], tree_rss(process.pid))
            done.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    log, _ = process.communicate(timeout=1800)
    done.set()
    sampler.join()
    assert process.returncode == 0, log[-2000:]
    assert "wrote " in log
    assert peak[0] < LIMIT, f"peak RSS {peak[0] / (1 << 20):,.0f} MB"
