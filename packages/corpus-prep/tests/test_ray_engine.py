"""`--engine ray`: the local engine's bytes, from Ray actors on a local cluster the test starts."""

from __future__ import annotations

import os
import pickle
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from mg.core.fixtures import fixture_path
from mg.corpus_prep.cli import main
from mg.corpus_prep.sample_corpus import real_corpus, write_jsonl

ray = pytest.importorskip("ray")

GPT2 = [
    "--tokenizer-type", "GPT2BPETokenizer",
    "--vocab-file", fixture_path("gpt2-bpe", "vocab.json"),
    "--merge-file", fixture_path("gpt2-bpe", "merges.txt"),
]  # fmt: skip


def tokenize(*args: object) -> int:
    try:
        main(["tokenize", *(str(a) for a in args), "--no-progress-bar"])
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return 0


def dataset(prefix: Path) -> tuple[bytes, bytes]:
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """The package's local Ray instance (conftest.py), started once for all Ray tests."""
    return ray_cluster


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ray") / "corpus.jsonl"
    write_jsonl(path, real_corpus(wikipedia_pages=4))
    return path


def test_ray_engine_writes_the_local_bytes_and_skips_done_shards(cluster, corpus, tmp_path, capsys):
    common = [*GPT2, "--append-eod", "--json-keys", "text"]
    assert tokenize("--input", corpus, "--output-prefix", tmp_path / "local", *common) == 0
    ray_run = ["--engine", "ray", "--workers", 2, "--partitions", 5, "--log-interval", 1]
    capsys.readouterr()
    assert tokenize("--input", corpus, "--output-prefix", tmp_path / "ray", *common, *ray_run) == 0
    progress = re.findall(r"Processed \d+ documents \(.* tokens/s, ETA (\d+:\d\d:\d\d)\)\.",
                          capsys.readouterr().err)  # fmt: skip
    assert 2 <= len(progress) <= 5 and progress[-1] == "0:00:00"  # a line per shard done
    expected = dataset(tmp_path / "local_text_document")
    assert dataset(tmp_path / "ray_text_document") == expected
    assert not (tmp_path / "ray.ray-shards").exists()


def test_a_bad_line_on_ray_is_the_local_one_line_error(cluster, tmp_path, capsys):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_bytes(b'{"text": "ok"}\n' * 20 + b'{"text": 42}\n')
    ray_run = ["--engine", "ray", "--workers", 2, "--partitions", 3]
    assert tokenize("--input", corpus, "--output-prefix", tmp_path / "o", *GPT2, *ray_run) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:21: the value of 'text' is a JSON number" in err and "Traceback" not in err
    assert not list(tmp_path.glob("o_*"))


def test_a_completed_shard_is_reused_and_a_stale_one_redone(corpus, tmp_path):
    from mg.core.tokenizers import TokenizerConfig
    from mg.corpus_prep.encoder import EncoderSpec
    from mg.corpus_prep.ray_engine import ShardJob, run_shard, shard_done
    from mg.corpus_prep.reader import Segment, find_sources
    from mg.corpus_prep.splitter import SplitterSpec

    config = TokenizerConfig("GPT2BPETokenizer", str(GPT2[3]), str(GPT2[5]))
    spec = EncoderSpec(("text",), True, config, SplitterSpec("none"), "uint16")
    [source] = find_sources([str(corpus)])
    job = ShardJob(
        0, [Segment(source)], spec, str(tmp_path / "shard0"), "document", "uint16", "fail"
    )
    assert shard_done(job) is None
    kind, stats = run_shard(job)
    assert kind == "done" and shard_done(job) == stats
    record = pickle.loads(Path(job.done_path).read_bytes())
    assert record["fingerprint"] == job.fingerprint()
    other = ShardJob(0, [Segment(source)], spec, job.prefix, "document", "uint16", "skip")
    assert shard_done(other) is None  # other settings: done again
    os.utime(corpus, ns=(0, Path(corpus).stat().st_mtime_ns + 1))
    assert shard_done(job) is None  # the input changed since: done again


def test_ray_flags_are_checked(tmp_path, corpus, capsys):
    out = tmp_path / "o"
    assert tokenize("--input", corpus, "--output-prefix", out, *GPT2, "--ray-address", "auto") == 2
    assert "--ray-address auto: only with --engine ray" in capsys.readouterr().err
    code = tokenize(
        "--input", corpus, "--output-prefix", out, *GPT2, "--engine", "ray", "--workers", 0
    )
    assert code == 2
    assert "--workers 0 with --engine ray" in capsys.readouterr().err


def _kill_one_running_shard(stop: threading.Event, killed: list[int]) -> None:
    """SIGKILL the first Ray actor process seen running a shard (its title says so)."""
    while not stop.is_set() and not killed:
        for pid in os.listdir("/proc"):
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if pid.isdigit() and title.startswith(b"ray::ShardActor.run"):
                os.kill(int(pid), signal.SIGKILL)
                killed.append(int(pid))
                return
        time.sleep(0.02)


@pytest.mark.slow
def test_a_killed_actor_is_restarted_and_the_output_is_the_same(cluster, corpus, tmp_path):
    common = [*GPT2, "--append-eod"]
    assert tokenize("--input", corpus, "--output-prefix", tmp_path / "local", *common) == 0
    stop, killed = threading.Event(), []
    killer = threading.Thread(target=_kill_one_running_shard, args=(stop, killed))
    killer.start()
    try:
        ray_run = ["--engine", "ray", "--workers", 2, "--partitions", 8]
        code = tokenize("--input", corpus, "--output-prefix", tmp_path / "ray", *common, *ray_run)
    finally:
        stop.set()
        killer.join()
    assert code == 0
    assert killed, "no shard was seen running"
    assert dataset(tmp_path / "ray_text_document") == dataset(tmp_path / "local_text_document")
