"""`clean`/`dedup --engine ray`: the local engine's kept documents, bytes and summary.

The corpus has planted duplicates: case/spacing copies (exact), copies with a few
words changed placed before and after their original (near), and chains of
copies of copies. The quick tests run the shard step and the bucketed LSH in
this process; the Ray tests (slow: a local cluster) run the commands.
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mg.core.fixtures import fixture_path
from mg.corpus_prep.cleaning import Cleaner, CleanOptions
from mg.corpus_prep.cli import main
from mg.corpus_prep.ray_clean import SHARD_BITS, CleanShardJob, clean_shard
from mg.corpus_prep.ray_dedup import find_duplicates, lsh_shape, resolve
from mg.corpus_prep.reader import find_sources, split_segments


def mutate(text: str, fraction: float, seed: int) -> str:
    """Replace `fraction` of the words with a made-up one."""
    rng = random.Random(seed)
    words = text.split()
    for i in rng.sample(range(len(words)), int(len(words) * fraction)):
        words[i] = f"zq{rng.randrange(10**6)}"
    return " ".join(words)


def planted_documents() -> list[dict[str, object]]:
    lines = fixture_path("botchan", "botchan.txt").read_text(encoding="utf-8").splitlines()
    passages = [" ".join(" ".join(lines[i : i + 12]).split()) for i in range(300, 2100, 12)]
    rng = random.Random(7)
    texts: list[str] = []
    for i, passage in enumerate(passages):
        texts.append(passage)
        if i % 3 == 0:  # a near copy after its original
            texts.append(mutate(passage, 0.02, seed=i))
        if i % 4 == 1:  # a near copy placed earlier than its original
            texts.insert(rng.randrange(len(texts)), mutate(passage, 0.03, seed=1000 + i))
        if i % 5 == 2:  # an exact copy (case and spacing changed) somewhere
            texts.insert(rng.randrange(len(texts)), "  " + passage.upper().replace(" ", "  "))
        if i % 7 == 3:  # a chain: copy of a copy of a copy
            copy = passage
            for step in range(3):
                copy = mutate(copy, 0.03, seed=2000 + 10 * i + step)
                texts.append(copy)
    texts.insert(5, "")  # an empty document
    return [{"id": n, "text": text, "meta": {"n": n / 3}} for n, text in enumerate(texts)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dedup") / "planted.jsonl"
    with open(path, "w", encoding="utf-8") as out:
        for document in planted_documents():
            out.write(json.dumps(document) + "\n")
    return path


def local_reasons(options: CleanOptions) -> list[str | None]:
    """The local engine's verdict on each document, in order."""
    cleaner = Cleaner(options)
    return [cleaner.clean_fields([str(d["text"])]).reason for d in planted_documents()]


@pytest.mark.parametrize("mode", ["exact", "near"])
def test_shards_and_bucketed_lsh_drop_what_the_local_engine_drops(corpus, tmp_path, mode):
    options = CleanOptions(dedup=mode, min_words=3)
    expected = local_reasons(options)
    assert expected.count("exact_duplicate") >= 10
    if mode == "near":
        assert expected.count("near_duplicate") >= 30
    groups = split_segments(find_sources([str(corpus)]), 5)
    orders, digests, signatures, filtered = [], [], [], []
    for i, segments in enumerate(groups):
        job = CleanShardJob(i, segments, ("text",), options, "fail", str(tmp_path / f"s{i}"))
        kind, counts = clean_shard(job)
        assert kind == "done"
        filtered.extend(r for r, n in counts.dropped.items() for _ in range(n))
        with np.load(job.prefix + ".npz") as meta:
            orders.append(meta["order"])
            digests.extend(row.tobytes() for row in meta["digest"])
            if mode == "near":
                signatures.append(meta["signature"])
    order = np.concatenate(orders)
    reasons = find_duplicates(
        order, digests, np.concatenate(signatures) if signatures else None, 0.8, 128
    )
    # the documents that passed the filters, in input order, and what became of them
    passed = [r for r in expected if r in (None, "exact_duplicate", "near_duplicate")]
    assert [reasons.get(int(o)) for o in order] == passed
    assert sorted(filtered) == sorted(r for r in expected if r not in passed + [None])
    assert int(order[-1]) >> SHARD_BITS == 4


def test_resolve_keeps_a_copy_of_a_dropped_copy():
    # 2 is like 1 only, and 1 was dropped as a copy of 0: 2 is kept (the local rule)
    assert resolve([(1, 0), (2, 1)]) == {1}
    assert resolve([(1, 0), (2, 1), (2, 0)]) == {1, 2}
    assert lsh_shape(0.8, 128) == (14, 9)  # datasketch's bands for 0.7 (see dedup.py)


def test_a_completed_shard_is_reused(corpus, tmp_path):
    [segments] = split_segments(find_sources([str(corpus)]), 1)
    job = CleanShardJob(0, segments, ("text",), CleanOptions(), "fail", str(tmp_path / "s0"))
    _, first = clean_shard(job)
    written = Path(job.prefix + ".jsonl").stat().st_mtime_ns
    time.sleep(0.01)
    _, again = clean_shard(job)
    assert again == first and Path(job.prefix + ".jsonl").stat().st_mtime_ns == written
    other = CleanShardJob(0, segments, ("text",), CleanOptions(min_words=150), "fail", job.prefix)
    _, redone = clean_shard(other)
    assert redone.dropped["too_few_words"] > 0  # other settings: done again


def test_a_bad_line_in_a_shard_is_the_local_message(tmp_path):
    from mg.corpus_prep.corpus_texts import BadLine, iter_documents

    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('{"text": "ok"}\n{"text": "fine"}\n{"text": 42}\n')
    with pytest.raises(BadLine) as local:
        list(iter_documents([str(corpus)], ["text"]))
    [segments] = split_segments(find_sources([str(corpus)]), 1)
    job = CleanShardJob(0, segments, ("text",), CleanOptions(), "fail", str(tmp_path / "s"))
    assert clean_shard(job) == ("error", str(local.value))
    skipping = CleanShardJob(0, segments, ("text",), CleanOptions(), "skip", job.prefix)
    kind, counts = clean_shard(skipping)
    assert kind == "done" and counts.skipped == 1 and counts.passed == 2
    assert counts.skip_messages == [str(local.value)]


def prep(*args: object) -> int:
    try:
        main([str(a) for a in args])
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return 0


def test_ray_flags_are_refused_where_they_would_do_nothing(corpus, tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    assert prep("dedup", "--input", corpus, "--output", out, "--ray-address", "auto") == 2
    assert "--ray-address auto: only with --engine ray" in capsys.readouterr().err
    code = prep("clean", "--input", corpus, "--output", out, "--engine", "ray",
                "--ray-connect-timeout", 5)  # fmt: skip
    assert code == 2
    assert "--ray-connect-timeout 5: only with --ray-address" in capsys.readouterr().err
    code = prep("dedup", "--input", corpus, "--output", out, "--engine", "ray",
                "--ray-address", "nowhere")  # fmt: skip
    assert code == 2
    assert "--ray-address nowhere: not an address" in capsys.readouterr().err
    assert not out.exists()


def dedup_joining(corpus: Path, out: Path, address: str, *flags: str):
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "mg.corpus_prep", "dedup", "--input", str(corpus),
         "--output", str(out), "--engine", "ray", "--ray-address", address, *flags],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return result, time.monotonic() - started


def test_nothing_listening_at_the_ray_address_is_one_line_and_exit_2(corpus, tmp_path):
    with socket.socket() as free:  # a port nobody listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    result, seconds = dedup_joining(corpus, tmp_path / "o.jsonl", f"127.0.0.1:{port}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert f"--ray-address 127.0.0.1:{port}: no Ray cluster answers there" in result.stderr
    assert seconds < 120  # the time to import ray on a loaded machine, then at once
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.slow
def test_a_silent_ray_address_gives_up_after_the_connect_timeout(corpus, tmp_path):
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        result, seconds = dedup_joining(
            corpus, tmp_path / "o.jsonl", address, "--ray-connect-timeout", "3"
        )
    assert result.returncode == 2, result.stderr
    first = result.stderr.splitlines()[0]  # Ray's C++ client may add a warning of its own
    assert first.startswith(f"mg-prep dedup: error: --ray-address {address}: "), first
    assert seconds < 120 and "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("command", "flags"),
    [
        ("clean", ["--dedup", "near", "--min-words", "3"]),
        ("dedup", ["--dedup", "near"]),
        ("dedup", ["--dedup", "exact", "--minhash-threshold", "0.9"]),
    ],
)
def test_on_ray_the_same_bytes_and_summary_as_local(ray_cluster, corpus, tmp_path, command, flags):
    outputs = {}
    for engine in ("local", "ray"):
        out = tmp_path / f"{engine}.jsonl.zst"  # (gzip's header would hold the file's name)
        summary = tmp_path / f"{engine}.json"
        extra = ["--engine", "ray", "--partitions", 6] if engine == "ray" else []
        code = prep(command, "--input", corpus, "--output", out, "--summary-json", summary,
                    *flags, *extra)  # fmt: skip
        assert code == 0
        report = json.loads(summary.read_text())
        report.pop("seconds"), report.pop("output")
        outputs[engine] = (out.read_bytes(), report)
    assert outputs["ray"] == outputs["local"]
    assert outputs["ray"][1]["documents_dropped"] >= 10
    assert not (tmp_path / "ray.jsonl.zst.ray-shards").exists()


def test_help_imports_neither_ray_nor_gigatoken_nor_datasketch():
    probe = (
        "import sys\nfrom mg.corpus_prep.cli import main\n"
        "for argv in ([], ['--help'], ['dedup', '--help'], ['clean', '--help'],\n"
        "             ['tokenize', '--help']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "print(sorted(m for m in ('ray', 'gigatoken', 'datasketch', 'numpy') "
        "if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "--ray-connect-timeout" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "[]"
