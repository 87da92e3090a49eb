"""Which input files a refresh must (re)process: the folder compared with the manifest.

A file is processed when it is new, when the sha256 of its bytes differs from
the manifest's, or when the tokenizer/options fingerprint changed (then every
file is). Hashing every file on every cron run would read the whole corpus
each time, so a file whose size and mtime match the manifest keeps its
recorded hash (as make and rsync decide); `--rehash` hashes everything.
A touched but unchanged file is re-hashed and then kept.

Files in the input folder are picked by glob pattern, recursively. Dot files
and names ending in .tmp/.part/.partial are skipped: a producer should write a
file under such a name and rename it when complete, so a refresh never reads
half a file.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
from dataclasses import dataclass, field

from mg.corpus_prep.refresh_manifest import InputRecord, Manifest

DEFAULT_PATTERNS = ("*.jsonl", "*.json", "*.jsonl.gz", "*.json.gz", "*.jsonl.zst", "*.json.zst")
INCOMPLETE_SUFFIXES = (".tmp", ".part", ".partial")
HASH_CHUNK = 1 << 20
SHARD_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class InputFile:
    path: str  # relative to the input folder, "/"-separated
    size: int
    mtime_ns: int
    sha256: str


@dataclass(frozen=True)
class Job:
    file: InputFile
    why: str  # "new", "changed" or "options changed"


@dataclass
class Plan:
    process: list[Job] = field(default_factory=list)
    keep: list[InputFile] = field(default_factory=list)
    remove: list[str] = field(default_factory=list)

    @property
    def changes_anything(self) -> bool:
        return bool(self.process or self.remove)


def sha256_of_file(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def list_inputs(input_dir: str, patterns: tuple[str, ...] = DEFAULT_PATTERNS) -> list[str]:
    """Relative, "/"-separated paths of the input files, sorted."""
    found = []
    for folder, subfolders, names in os.walk(input_dir):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
        for name in names:
            if name.startswith(".") or name.endswith(INCOMPLETE_SUFFIXES):
                continue
            if any(fnmatch.fnmatch(name, pattern) for pattern in patterns):
                relative = os.path.relpath(os.path.join(folder, name), input_dir)
                found.append(relative.replace(os.sep, "/"))
    return sorted(found)


def describe_inputs(
    input_dir: str,
    previous: Manifest | None,
    patterns: tuple[str, ...] = DEFAULT_PATTERNS,
    rehash: bool = False,
) -> list[InputFile]:
    """Size, mtime and sha256 of each input, re-using the manifest's hash where nothing moved."""
    files = []
    for relative in list_inputs(input_dir, patterns):
        status = os.stat(os.path.join(input_dir, relative))
        record = previous.inputs.get(relative) if previous else None
        if (
            not rehash
            and record is not None
            and record.size == status.st_size
            and record.mtime_ns == status.st_mtime_ns
        ):
            digest = record.sha256
        else:
            digest = sha256_of_file(os.path.join(input_dir, relative))
        files.append(InputFile(relative, status.st_size, status.st_mtime_ns, digest))
    return files


def make_plan(files: list[InputFile], previous: Manifest | None, fingerprint: str) -> Plan:
    plan = Plan()
    known: dict[str, InputRecord] = previous.inputs if previous else {}
    same_options = previous is not None and previous.fingerprint == fingerprint
    for file in files:
        record = known.get(file.path)
        if record is None:
            plan.process.append(Job(file, "new"))
        elif not same_options:
            plan.process.append(Job(file, "options changed"))
        elif record.sha256 != file.sha256:
            plan.process.append(Job(file, "changed"))
        else:
            plan.keep.append(file)
    present = {file.path for file in files}
    plan.remove = sorted(path for path in known if path not in present)
    return plan


def shard_stem(file: InputFile, fingerprint: str) -> str:
    """The shard name of one input version: readable, and unique to (path, content, options).

    Changed files and changed options get new names, so new shards never
    overwrite the ones the published blend still points at.
    """
    identity = f"{file.path}\0{file.sha256}\0{fingerprint}".encode()
    short = hashlib.sha256(identity).hexdigest()[:16]
    readable = SHARD_NAME_CHARS.sub("_", file.path.replace("/", "__"))[-80:]
    return f"{readable}-{short}"
