"""The layout of a Retro project folder (``--retro-project-dir``) and the checks that tie
its stages together.

    config.json                  the arguments of every run so far (a later run must agree)
    db/datasets.json             the indexed datasets (prefix, weight, documents, chunks)
    db/blocks/<d>/<a>-<b>.npy    chunks of documents a..b of dataset d (resumable blocks)
    db/chunks.npy                the database: one row per chunk, uint32
                                 (dataset index, document id, start token, end token,
                                 BERT length) as Megatron's merged chunk database
    db/sampled.npy               the database rows the index is trained on
    db/manifest.json             the database's fingerprint, written last
    embeddings/db/<a>-<b>.npy    BERT embeddings of database chunks a..b (float32)
    index/trained.faissindex     the Faiss index, trained, empty
    index/added.faissindex       the same with every database chunk added
    index/manifest.json          which database (fingerprint) and index string it holds
    query/<split>/<a>-<b>.npy    neighbours (database rows, -1 = none) of query chunks a..b
    query/<split>/manifest.json  written last: the database and index the neighbours are of

Every stage writes a manifest naming the database fingerprint it was built from;
a reader compares it with the folder's database and refuses a mismatch, so
neighbours are never read against a database they were not queried from.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mg.core.retro.files import load_array, read_json

SPLITS = ("train", "valid", "test")


class RetroProjectError(ValueError):
    """A project folder that does not hold what is asked of it; the message is one line."""


@dataclass(frozen=True)
class ProjectPaths:
    """Where each file of a project folder lies."""

    root: Path

    @classmethod
    def of(cls, root: str | os.PathLike[str]) -> ProjectPaths:
        return cls(Path(root))

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def db_dir(self) -> Path:
        return self.root / "db"

    @property
    def datasets(self) -> Path:
        return self.db_dir / "datasets.json"

    def db_blocks(self, dataset_index: int) -> Path:
        return self.db_dir / "blocks" / str(dataset_index)

    @property
    def chunks(self) -> Path:
        return self.db_dir / "chunks.npy"

    @property
    def sampled(self) -> Path:
        return self.db_dir / "sampled.npy"

    @property
    def db_manifest(self) -> Path:
        return self.db_dir / "manifest.json"

    @property
    def db_embeddings(self) -> Path:
        return self.root / "embeddings" / "db"

    @property
    def index_dir(self) -> Path:
        return self.root / "index"

    @property
    def trained_index(self) -> Path:
        return self.index_dir / "trained.faissindex"

    @property
    def added_index(self) -> Path:
        return self.index_dir / "added.faissindex"

    @property
    def index_manifest(self) -> Path:
        return self.index_dir / "manifest.json"

    def query_dir(self, split: str) -> Path:
        return self.root / "query" / split

    def query_manifest(self, split: str) -> Path:
        return self.query_dir(split) / "manifest.json"


def block_name(start: int, end: int) -> str:
    """The file name of the block of rows ``start..end`` (zero-padded so names sort)."""
    return f"{start:012d}-{end:012d}.npy"


def block_ranges(total: int, block_size: int) -> list[tuple[int, int]]:
    """``[0, total)`` cut into consecutive ranges of ``block_size`` rows (the last shorter)."""
    return [(s, min(total, s + block_size)) for s in range(0, total, block_size)]


def database_fingerprint(chunks: np.ndarray, datasets: list[dict]) -> str:
    """A short hash of the chunk table and the datasets' identities (prefix, sizes)."""
    digest = hashlib.sha256(np.ascontiguousarray(chunks).tobytes())
    for info in datasets:
        digest.update(repr((info["prefix"], info["n_docs"], info["n_tokens"])).encode())
    return digest.hexdigest()[:16]


def read_database_fingerprint(paths: ProjectPaths) -> str:
    """The fingerprint of the folder's finished database; a one-line error without one."""
    if not paths.db_manifest.is_file():
        raise RetroProjectError(
            f"{paths.root} holds no finished chunk database ({paths.db_manifest} is missing); "
            "run `mg-prep retro --retro-tasks db-build` first"
        )
    return str(read_json(paths.db_manifest)["fingerprint"])


def read_neighbors(paths: ProjectPaths, split: str) -> np.ndarray:
    """The neighbour table of ``split`` ([query chunks, neighbours], database rows, -1 = none).

    Refused, in one line, when the neighbours were queried against another
    database than the folder's (a database rebuilt or copied in after the query).
    """
    manifest_path = paths.query_manifest(split)
    if not manifest_path.is_file():
        raise RetroProjectError(
            f"{paths.root} holds no finished {split} neighbours ({manifest_path} is missing); "
            "run `mg-prep retro --retro-tasks query-neighbors`"
        )
    manifest = read_json(manifest_path)
    database = read_database_fingerprint(paths)
    if manifest["database"] != database:
        raise RetroProjectError(
            f"{manifest_path}: these neighbours were queried against database "
            f"{manifest['database']}, but {paths.db_dir} holds database {database}; "
            "rerun `mg-prep retro --retro-tasks index-build,query-neighbors`"
        )
    blocks = [
        load_array(paths.query_dir(split) / block_name(a, b))
        for a, b in block_ranges(manifest["n_chunks"], manifest["block_size"])
    ]
    if not blocks:
        return np.zeros((0, manifest["num_neighbors"]), dtype=np.int64)
    return np.concatenate(blocks)
