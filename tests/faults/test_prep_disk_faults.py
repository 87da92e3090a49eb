"""mg-prep and the dataset builder on real full and read-only filesystems.

Each case runs in its own mount namespace (`unshare -rm`, no privileges
needed where user namespaces are allowed) with a small tmpfs mounted over a
folder of the test: full after some kilobytes, or read-only. The command
runs inside; the folder's listing is printed before the namespace ends.
Cases skip, saying why, where no tmpfs can be mounted this way. An output
path through a file needs no mount.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mg.core.fixtures import fixture_path

GPT2 = [
    "--tokenizer-type", "GPT2BPETokenizer",
    "--vocab-file", str(fixture_path("gpt2-bpe", "vocab.json")),
    "--merge-file", str(fixture_path("gpt2-bpe", "merges.txt")),
]  # fmt: skip
LISTING = "--- listing ---"


def mount_problem(tmp_path: Path) -> str | None:
    """None if `unshare -rm` can mount a tmpfs here, else why not."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    target = tmp_path / "probe"
    target.mkdir()
    probe = subprocess.run(
        ["unshare", "-rm", "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(target)],
        capture_output=True,
        text=True,
    )
    target.rmdir()
    if probe.returncode:
        return f"cannot mount a tmpfs in a user namespace: {probe.stderr.strip()[:200]}"
    return None


def run_on_small_disk(
    disk: Path, options: str, argv: list[str]
) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run `argv` with a tmpfs (mount `options`) over `disk`; its result and the listing."""
    if reason := mount_problem(disk.parent):
        pytest.skip(reason)
    disk.mkdir(exist_ok=True)
    script = (
        f"mount -t tmpfs -o {options} tmpfs {shlex.quote(str(disk))} || exit 99\n"
        f"{shlex.join(argv)}\nstatus=$?\necho {LISTING}\n"
        f"ls -A {shlex.quote(str(disk))}\nexit $status\n"
    )
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=600
    )
    assert result.returncode != 99, result.stderr
    listing = result.stdout.split(LISTING, 1)[1].split() if LISTING in result.stdout else []
    return result, listing


def mg_prep(*argv: str) -> list[str]:
    return [sys.executable, "-m", "mg.corpus_prep", *argv]


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    errors = [line for line in lines if ": error: " in line]
    assert len(errors) == 1, stderr
    return errors[0]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> list[str]:
    """Two uint16 datasets of 300,000 tokens (600 KB of .bin) each."""
    from mg.indexed_dataset import IndexedDatasetBuilder

    folder = tmp_path_factory.mktemp("inputs")
    prefixes = []
    for part in range(2):
        prefix = str(folder / f"part{part}")
        with IndexedDatasetBuilder(prefix + ".bin", np.uint16) as builder:
            for start in range(0, 300_000, 1000):
                builder.add_document(np.arange(start, start + 1000) % 50000, [1000])
            builder.finalize(prefix + ".idx")
        prefixes.append(prefix)
    return prefixes


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Botchan three lines a document, twice: about 600 KB of JSONL (300 KB of tokens)."""
    lines = [x for x in fixture_path("botchan", "botchan.txt").read_text().splitlines() if x]
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(2):
            for i in range(0, len(lines), 3):
                handle.write(json.dumps({"text": " ".join(lines[i : i + 3])}) + "\n")
    return path


# --------------------------------------------------------------------------- the builder


def test_builder_abort_on_a_full_disk_deletes_its_temporary(tmp_path) -> None:
    """Closing flushes the buffered tail, which fails again on a full disk: the temporary
    must go all the same (it stayed, and the message said it was removed)."""
    disk = tmp_path / "disk"
    script = (
        "import numpy as np\n"
        "from mg.indexed_dataset import IndexedDatasetBuilder\n"
        f"disk = {str(disk)!r}\n"
        "open(disk + '/filler', 'wb').write(b'x' * 60_000)\n"
        "builder = IndexedDatasetBuilder(disk + '/out.bin', np.uint16)\n"
        "try:\n"
        "    for _ in range(100):\n"
        "        builder.add_item(np.arange(100))  # 200 bytes: buffered, then ENOSPC\n"
        "except OSError as err:\n"
        "    print('write failed:', err.strerror)\n"
        "print('left behind:', builder.abort())\n"
    )
    result, listing = run_on_small_disk(disk, "size=64k", [sys.executable, "-c", script])
    assert result.returncode == 0, result.stderr
    assert "write failed: No space left on device" in result.stdout
    assert "left behind: []" in result.stdout
    assert listing == ["filler"]


# --------------------------------------------------------------------------- mg-prep merge


def test_merge_on_a_full_disk(datasets, tmp_path) -> None:
    disk = tmp_path / "disk"
    output = disk / "new" / "folders" / "merged"  # made by the merge, removed when it fails
    result, listing = run_on_small_disk(
        disk, "size=256k", mg_prep("merge", "--input", *datasets, "--output-prefix", str(output))
    )
    assert result.returncode == 2, result.stderr
    line = one_error_line(result.stderr)
    assert str(output) in line and "No space left on device" in line, line
    assert "free some space" in line and "temporary files were removed" in line, line
    assert listing == []


def test_merge_into_a_read_only_folder(datasets, tmp_path) -> None:
    disk = tmp_path / "disk"
    output = disk / "merged"
    result, listing = run_on_small_disk(
        disk, "ro,size=64k", mg_prep("merge", "--input", *datasets, "--output-prefix", str(output))
    )
    assert result.returncode == 2, result.stderr
    line = one_error_line(result.stderr)
    assert str(output) in line and "Read-only file system" in line, line
    assert listing == []


def test_merge_through_a_file(datasets, tmp_path) -> None:
    (tmp_path / "afile").write_text("x")
    output = tmp_path / "afile" / "merged"
    result = subprocess.run(
        mg_prep("merge", "--input", *datasets, "--output-prefix", str(output)),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2, result.stderr
    line = one_error_line(result.stderr)
    assert str(output) in line and "a part of the path is a file" in line, line
    assert (tmp_path / "afile").read_text() == "x"


# --------------------------------------------------------------------------- mg-prep tokenize


@pytest.mark.parametrize("layout", [["--workers", "1"], ["--workers", "2", "--partitions", "2"]])
def test_tokenize_on_a_full_disk(corpus, tmp_path, layout) -> None:
    disk = tmp_path / "disk"
    output = disk / "new" / "c"  # a folder made by the run, removed when it fails
    argv = mg_prep(
        "tokenize", "--input", str(corpus), "--output-prefix", str(output), *GPT2, *layout
    )
    result, listing = run_on_small_disk(disk, "size=128k", argv)
    assert result.returncode == 2, result.stderr
    line = one_error_line(result.stderr)
    assert str(output) in line and "No space left on device" in line, line
    assert "nothing was published and the temporary files were removed" in line, line
    assert listing == []


def test_tokenize_into_a_read_only_folder(corpus, tmp_path) -> None:
    disk = tmp_path / "disk"
    argv = mg_prep("tokenize", "--input", str(corpus), "--output-prefix", str(disk / "c"), *GPT2)
    result, listing = run_on_small_disk(disk, "ro,size=64k", argv)
    assert result.returncode == 2, result.stderr
    line = one_error_line(result.stderr)
    assert str(disk) in line and "writable" in line, line
    assert listing == []


def test_nothing_is_left_when_the_output_folder_holds_earlier_files(datasets, tmp_path) -> None:
    """An earlier dataset in the full folder stays as it was."""
    disk = tmp_path / "disk"
    script = (
        f"cp {shlex.quote(datasets[0])}.idx {shlex.quote(str(disk))}/merged.idx && "
        + shlex.join(
            mg_prep("merge", "--input", *datasets, "--output-prefix", str(disk / "merged"))
        )
    )
    result, listing = run_on_small_disk(disk, "size=256k", ["sh", "-c", script])
    assert result.returncode == 2, result.stderr
    one_error_line(result.stderr)
    assert listing == ["merged.idx"]
    assert os.path.getsize(datasets[0] + ".idx") > 0
