"""The refresh engine: incremental runs, publishing, the lock, and kill -9 at every stage.

The shards here are made by a stand-in tokenizer (one token per UTF-8 byte),
so that these tests exercise the refresh logic alone and fast; the command
with real tokenizers is tested in test_refresh_cmd.py.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from mg.corpus_prep.refresh import RefreshConfig, refresh
from mg.corpus_prep.refresh_manifest import load_manifest
from mg.indexed_dataset.format import IndexedDataset

BYTE_TOKENIZER = '''
def build(path, prefix):
    """One token per UTF-8 byte of each document's "text"; eod 0 appended."""
    import json, time, os
    import numpy as np
    from mg.indexed_dataset.format import IndexedDatasetBuilder
    delay = float(os.environ.get("FAKE_TOKENIZER_DELAY", "0"))
    with IndexedDatasetBuilder(prefix + "_text_document.bin", np.uint16) as builder:
        with open(path, encoding="utf-8") as stream:
            for line in stream:
                if line.strip():
                    tokens = list(json.loads(line)["text"].encode()) + [0]
                    builder.add_document(np.array(tokens), [len(tokens)])
                    time.sleep(delay)
        builder.finalize(prefix + "_text_document.idx")
'''
namespace: dict = {}
exec(BYTE_TOKENIZER, namespace)  # the same code the subprocesses run
build = namespace["build"]

RUNNER = (
    BYTE_TOKENIZER
    + """
import sys
from mg.corpus_prep.refresh import RefreshConfig, refresh
report = refresh(
    RefreshConfig(sys.argv[1], sys.argv[2], ["text_document"], "bytes-v1", {"tokenizer": "bytes"},
                  lock_timeout=float(sys.argv[3])),
    build,
)
print("RESULT", "busy" if report.busy else "built=" + ",".join(report.built), flush=True)
"""
)


def config(tmp_path, **overrides) -> RefreshConfig:
    values = {
        "input_dir": str(tmp_path / "in"),
        "output_dir": str(tmp_path / "out"),
        "datasets": ["text_document"],
        "fingerprint": "bytes-v1",
        "options": {"tokenizer": "bytes"},
    }
    values.update(overrides)
    return RefreshConfig(**values)


def add_file(tmp_path, name: str, texts: list[str]) -> None:
    path = tmp_path / "in" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def blend_entries(tmp_path) -> list[tuple[int, str]]:
    lines = (tmp_path / "out" / "blend.txt").read_text().splitlines()
    return [(int(w), p) for w, p in (line.split() for line in lines)]


def published_state(tmp_path) -> dict[str, bytes]:
    out = tmp_path / "out"
    return {name: (out / name).read_bytes() for name in ("blend.txt", "manifest.json")}


def assert_loadable(tmp_path) -> list[tuple[int, str]]:
    """Every blend entry opens, and its weight is its token count."""
    entries = blend_entries(tmp_path)
    for weight, prefix in entries:
        with IndexedDataset(prefix) as data:
            assert data.num_tokens == weight
    manifest = load_manifest(tmp_path / "out")
    assert manifest is not None
    return entries


def shard_mtimes(tmp_path) -> dict[str, int]:
    shards = tmp_path / "out" / "shards"
    return {p.name: p.stat().st_mtime_ns for p in shards.iterdir()}


def test_first_run_then_only_new_files(tmp_path):
    add_file(tmp_path, "a.jsonl", ["hello", "world!"])
    add_file(tmp_path, "sub/b.jsonl", ["abc"])
    report = refresh(config(tmp_path), build)
    assert report.built == ["a.jsonl", "sub/b.jsonl"]
    assert report.published and report.generation == 1

    out = tmp_path / "out"
    entries = assert_loadable(tmp_path)
    # weights are tokens: bytes + one eod per document
    assert [w for w, _ in entries] == [5 + 1 + 6 + 1, 3 + 1]
    assert all(os.path.isabs(p) and p.startswith(str(out / "shards")) for _, p in entries)
    manifest = load_manifest(out)
    assert sorted(manifest.inputs) == ["a.jsonl", "sub/b.jsonl"]
    record = manifest.inputs["a.jsonl"]
    assert record.shards["text_document"].documents == 2
    assert record.sha256 == hashlib.sha256((tmp_path / "in/a.jsonl").read_bytes()).hexdigest()
    with IndexedDataset(out / record.shards["text_document"].prefix) as data:
        assert bytes(data[0][:-1].astype(np.uint8)) == b"hello"

    before = shard_mtimes(tmp_path)
    add_file(tmp_path, "c.jsonl", ["a third file"])
    report = refresh(config(tmp_path), build)
    assert report.built == ["c.jsonl"]
    assert [job.why for job in report.plan.process] == ["new"]
    assert report.generation == 2
    after = shard_mtimes(tmp_path)
    assert {k: after[k] for k in before} == before  # old shards untouched
    assert len(after) == len(before) + 2
    assert len(assert_loadable(tmp_path)) == 3


def test_unchanged_run_publishes_nothing(tmp_path):
    add_file(tmp_path, "a.jsonl", ["hello"])
    refresh(config(tmp_path), build)
    state = published_state(tmp_path)
    report = refresh(config(tmp_path), build)
    assert report.built == [] and not report.published and report.generation == 1
    assert published_state(tmp_path) == state

    # touched, same bytes: re-hashed, kept, not rebuilt
    path = tmp_path / "in" / "a.jsonl"
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    report = refresh(config(tmp_path), build)
    assert report.built == [] and [f.path for f in report.plan.keep] == ["a.jsonl"]
    assert (tmp_path / "out" / "blend.txt").read_bytes() == state["blend.txt"]


def test_changed_file_is_reprocessed_under_a_new_name(tmp_path):
    add_file(tmp_path, "a.jsonl", ["hello"])
    add_file(tmp_path, "b.jsonl", ["other"])
    refresh(config(tmp_path), build)
    old = dict(blend_entries(tmp_path)[i][::-1] for i in range(2))
    add_file(tmp_path, "a.jsonl", ["hello again, longer"])
    report = refresh(config(tmp_path), build)
    assert report.built == ["a.jsonl"]
    assert [job.why for job in report.plan.process] == ["changed"]
    entries = assert_loadable(tmp_path)
    assert entries[0][0] == len("hello again, longer") + 1
    assert entries[0][1] not in old  # a new shard; the old one is still there
    assert entries[1][1] in old
    assert all(os.path.exists(p + ".idx") for p in old)


def test_removed_file_dropped_and_pruned(tmp_path):
    add_file(tmp_path, "a.jsonl", ["hello"])
    add_file(tmp_path, "b.jsonl", ["other"])
    refresh(config(tmp_path), build)
    removed_prefix = blend_entries(tmp_path)[1][1]
    (tmp_path / "in" / "b.jsonl").unlink()
    report = refresh(config(tmp_path), build)
    assert report.plan.remove == ["b.jsonl"]
    assert len(blend_entries(tmp_path)) == 1
    assert os.path.exists(removed_prefix + ".bin")  # kept without --prune
    report = refresh(config(tmp_path, prune=True), build)
    assert sorted(report.pruned) == sorted(
        os.path.basename(removed_prefix) + ext for ext in (".bin", ".idx")
    )
    assert not os.path.exists(removed_prefix + ".bin")
    assert_loadable(tmp_path)


def test_new_fingerprint_reprocesses_everything(tmp_path):
    add_file(tmp_path, "a.jsonl", ["hello"])
    add_file(tmp_path, "b.jsonl", ["other"])
    refresh(config(tmp_path), build)
    report = refresh(config(tmp_path, fingerprint="bytes-v2"), build)
    assert report.built == ["a.jsonl", "b.jsonl"]
    assert {job.why for job in report.plan.process} == {"options changed"}
    assert load_manifest(tmp_path / "out").fingerprint == "bytes-v2"


def test_dry_run_changes_nothing(tmp_path, capsys):
    add_file(tmp_path, "a.jsonl", ["hello"])
    refresh(config(tmp_path), build)
    add_file(tmp_path, "b.jsonl", ["new"])
    state, mtimes = published_state(tmp_path), shard_mtimes(tmp_path)
    report = refresh(config(tmp_path, dry_run=True), build)
    assert [job.file.path for job in report.plan.process] == ["b.jsonl"]
    assert "would process b.jsonl (new)" in capsys.readouterr().out
    assert published_state(tmp_path) == state and shard_mtimes(tmp_path) == mtimes


def test_empty_and_skipped_inputs(tmp_path):
    add_file(tmp_path, "a.jsonl", ["hello"])
    (tmp_path / "in" / "empty.jsonl").write_text("")
    (tmp_path / "in" / ".hidden.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "in" / "partial.jsonl.part").write_text('{"text": "x"}\n')
    (tmp_path / "in" / "notes.txt").write_text("not a corpus")
    report = refresh(config(tmp_path), build)
    assert report.built == ["a.jsonl", "empty.jsonl"]
    # the empty shard is in the manifest, not in the blend (weights must be > 0)
    assert len(blend_entries(tmp_path)) == 1
    assert load_manifest(tmp_path / "out").inputs["empty.jsonl"].shards["text_document"].tokens == 0


def test_lock_held_elsewhere_exits_cleanly(tmp_path, capsys):
    add_file(tmp_path, "a.jsonl", ["hello"])
    (tmp_path / "out").mkdir()
    with open(tmp_path / "out" / ".refresh.lock", "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        started = time.monotonic()
        report = refresh(config(tmp_path, lock_timeout=0.5), build)
        waited = time.monotonic() - started
    assert report.busy and report.built == []
    assert 0.5 <= waited < 5
    assert "another refresh is running" in capsys.readouterr().out
    assert not (tmp_path / "out" / "manifest.json").exists()


# --- separate processes: kill -9 and concurrent runs ------------------------------------------


def start_runner(tmp_path, lock_timeout=60.0, **env) -> subprocess.Popen:
    script = tmp_path / "runner.py"
    script.write_text(textwrap.dedent(RUNNER))
    return subprocess.Popen(
        [
            sys.executable,
            str(script),
            str(tmp_path / "in"),
            str(tmp_path / "out"),
            str(lock_timeout),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


def wait_for_pause(process: subprocess.Popen, stage: str) -> None:
    seen = []
    for line in process.stderr:
        if line.strip() == f"refresh: paused at {stage}":
            return
        seen.append(line)
    raise AssertionError(f"the refresh never paused at {stage}:\n{''.join(seen)}")


@pytest.mark.parametrize("stage", ["shard-built", "shards-moved", "blend-written"])
def test_kill_9_at_each_stage_keeps_a_whole_published_state(tmp_path, stage):
    add_file(tmp_path, "a.jsonl", ["hello", "world"])
    refresh(config(tmp_path), build)
    before = published_state(tmp_path)
    add_file(tmp_path, "b.jsonl", ["new data"])

    process = start_runner(tmp_path, MG_REFRESH_PAUSE_AT=stage)
    wait_for_pause(process, stage)
    process.send_signal(signal.SIGKILL)
    process.wait()

    after = published_state(tmp_path)
    if stage == "blend-written":
        # between the two renames: the blend is already the new one, whole; the manifest is old
        assert after["manifest.json"] == before["manifest.json"]
        assert len(blend_entries(tmp_path)) == 2
    else:
        assert after == before
    assert_loadable(tmp_path)
    staging = tmp_path / "out" / ".staging"
    staged = os.listdir(staging) if staging.exists() else []
    assert bool(staged) == (stage == "shard-built")  # built, not yet moved into shards/

    report = refresh(config(tmp_path), build)  # the next run sweeps and completes
    assert [job.file.path for job in report.plan.process] == ["b.jsonl"]
    assert report.built == (["b.jsonl"] if stage == "shard-built" else [])
    assert report.reused == ([] if stage == "shard-built" else ["b.jsonl"])
    assert len(assert_loadable(tmp_path)) == 2
    assert load_manifest(tmp_path / "out").generation == 2
    leftovers = [n for n in os.listdir(tmp_path / "out") if n.endswith(".tmp") or n == ".staging"]
    assert leftovers == []


def test_kill_9_mid_tokenization_leaves_no_partial_files(tmp_path):
    add_file(tmp_path, "a.jsonl", ["hello"])
    refresh(config(tmp_path), build)
    before = published_state(tmp_path)
    add_file(tmp_path, "big.jsonl", [f"document {i}" for i in range(400)])
    process = start_runner(tmp_path, FAKE_TOKENIZER_DELAY="0.01")  # ~4 s of tokenizing
    staging = tmp_path / "out" / ".staging"
    deadline = time.monotonic() + 60
    while not (staging.exists() and os.listdir(staging)) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the builder is writing tokens now
    assert process.poll() is None, "the run finished before it could be killed"
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert published_state(tmp_path) == before
    staged = os.listdir(tmp_path / "out" / ".staging")
    assert staged and all(name.endswith(".tmp") for name in staged)  # builder temporaries only

    report = refresh(config(tmp_path), build)
    assert report.built == ["big.jsonl"]
    assert [w for w, _ in assert_loadable(tmp_path)] == [
        6,
        sum(len(f"document {i}") + 1 for i in range(400)),
    ]
    assert not (tmp_path / "out" / ".staging").exists()


def test_two_runs_at_once_second_exits_cleanly(tmp_path):
    add_file(tmp_path, "a.jsonl", ["hello"])
    first = start_runner(tmp_path, MG_REFRESH_PAUSE_AT="shard-built", MG_REFRESH_PAUSE_SECONDS="3")
    wait_for_pause(first, "shard-built")
    second = start_runner(tmp_path, lock_timeout=0.5)
    out, _ = second.communicate(timeout=60)
    assert second.returncode == 0
    assert "another refresh is running" in out and "RESULT busy" in out
    out, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    assert "RESULT built=a.jsonl" in out
    assert len(assert_loadable(tmp_path)) == 1


def test_second_run_waits_for_the_lock_then_finds_nothing_to_do(tmp_path):
    add_file(tmp_path, "a.jsonl", ["hello"])
    first = start_runner(tmp_path, MG_REFRESH_PAUSE_AT="shard-built", MG_REFRESH_PAUSE_SECONDS="2")
    wait_for_pause(first, "shard-built")
    second = start_runner(tmp_path, lock_timeout=60)
    first_out, _ = first.communicate(timeout=60)
    second_out, _ = second.communicate(timeout=60)
    assert "RESULT built=a.jsonl" in first_out
    assert "RESULT built=\n" in second_out + "\n" and "nothing new" in second_out
    assert load_manifest(tmp_path / "out").generation == 1
