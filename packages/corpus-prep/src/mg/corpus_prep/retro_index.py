"""The database's embeddings and its Faiss index (tasks ``index-train``, ``index-add``).

Every database chunk is embedded once, in blocks of ``--retro-block-size``
chunks saved as they finish (an interrupted run re-embeds only the block it
was in). The index is ``faiss.index_factory(dim, --retro-index-str,
METRIC_INNER_PRODUCT)`` over unit-length embeddings: neighbours are the chunks
of largest cosine similarity, found by maximum inner product search as in REALM
(Megatron's factory call leaves Faiss' default L2 over raw embeddings; on unit
vectors the two orders agree, and raw inner products favour short chunks). It
is trained on ``--retro-index-ntrain`` chunks drawn without replacement (seed
``--retro-gpt-seed``), from each dataset in proportion to its blend weight, and
then holds every database chunk, row i being database row i.
Faiss is imported only when a stage runs; the index is read and searched by
``mg.core.retro.faiss_index``, which retrieval at generation time shares.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from mg.core.retro.bert_embedder import BertEmbedder
from mg.core.retro.chunk_db import END, START, ChunkDatabase
from mg.core.retro.faiss_index import FaissMissingError
from mg.core.retro.faiss_index import import_faiss as faiss_module
from mg.core.retro.files import atomic_path, load_array, read_json, save_array, write_json
from mg.core.retro.project import ProjectPaths, block_name, block_ranges
from mg.core.tokenizers.base import BaseTokenizer
from mg.corpus_prep.commands import UserError

logger = logging.getLogger(__name__)


def import_faiss() -> Any:
    try:
        return faiss_module("mg-prep retro")
    except FaissMissingError:
        raise UserError(
            "mg-prep retro needs Faiss: pip install 'mg-corpus-prep[retro]' (faiss-cpu), or "
            "faiss-gpu"
        ) from None


def _faiss_reason(err: Exception) -> str:
    """Faiss' C++ message (the function, file and line it failed in) cut to its reason."""
    text = " ".join(str(err).split())
    text = re.sub(r"^.*?Error in .*? at \S+:\d+: ", "", text)
    text = re.sub(r"^.*?Error: '.*?' failed: ", "", text)
    return text.strip(" '")[:200]


def new_index(index_str: str, dimension: int) -> Any:
    """An empty index by factory string; a string Faiss rejects is a one-line UserError."""
    faiss = import_faiss()
    try:
        return faiss.index_factory(dimension, index_str, faiss.METRIC_INNER_PRODUCT)
    except Exception as err:  # Faiss raises RuntimeError, SWIG sometimes others
        raise UserError(
            f"--retro-index-str {index_str!r}: Faiss rejects it for {dimension}-dimensional "
            f"embeddings ({_faiss_reason(err)}); see the faiss.index_factory strings, e.g. "
            "Flat, IVF1024,PQ32, OPQ32_128,IVF4096_HNSW32,PQ32"
        ) from None


def chunk_texts(db: ChunkDatabase, rows: Sequence[int], tokenizer: BaseTokenizer) -> list[str]:
    """The text of database chunks (their real tokens, without the end-of-document padding)."""
    texts = []
    for row in rows:
        length = int(db.chunks[row, END]) - int(db.chunks[row, START])
        texts.append(tokenizer.detokenize(db.chunk_tokens(int(row))[:length].tolist()))
    return texts


def embed_database(
    paths: ProjectPaths,
    db: ChunkDatabase,
    embedder: BertEmbedder,
    gpt_tokenizer: BaseTokenizer,
    block_size: int,
) -> None:
    """Embed every database chunk into ``embeddings/db/`` blocks; blocks on disk are kept."""
    ranges = block_ranges(len(db), block_size)
    for number, (first, end) in enumerate(ranges):
        path = paths.db_embeddings / block_name(first, end)
        if path.is_file():
            continue
        vectors = embedder.embed(chunk_texts(db, range(first, end), gpt_tokenizer))
        save_array(path, vectors)
        logger.info(
            "embed: database block %d/%d (chunks %d-%d)", number + 1, len(ranges), first, end
        )


def database_embeddings(paths: ProjectPaths, n_chunks: int, block_size: int, rows: np.ndarray):
    """The embeddings of database ``rows`` (sorted ascending), read from the blocks."""
    parts = []
    for first, end in block_ranges(n_chunks, block_size):
        inside = rows[(rows >= first) & (rows < end)]
        if len(inside):
            block = load_array(paths.db_embeddings / block_name(first, end), mmap=True)
            parts.append(np.asarray(block[inside - first]))
    return np.concatenate(parts) if parts else np.zeros((0, 0), np.float32)


def training_rows(chunks: np.ndarray, ratios: list[float], ntrain: int, seed: int) -> np.ndarray:
    """--retro-index-ntrain database rows, per dataset ``int(ntrain * ratio / sum)``, drawn
    without replacement; sorted."""
    total = sum(ratios)
    rng = np.random.default_rng(seed)
    picked = []
    for number, ratio in enumerate(ratios):
        own = np.flatnonzero(chunks[:, 0] == number)
        want = int(ntrain * ratio / total)
        if want > len(own):
            raise UserError(
                f"--retro-index-ntrain {ntrain}: dataset {number} should give {want} training "
                f"chunks but its database part holds {len(own)}; lower --retro-index-ntrain"
            )
        picked.append(rng.choice(own, size=want, replace=False))
    return np.sort(np.concatenate(picked)).astype(np.int64)


def train_index(
    paths: ProjectPaths,
    db: ChunkDatabase,
    fingerprint: str,
    index_str: str,
    dimension: int,
    ntrain: int,
    load_fraction: float,
    ratios: list[float],
    seed: int,
    block_size: int,
) -> None:
    """Train an empty index on sampled chunks (``index/trained.faissindex``)."""
    if paths.trained_index.is_file() and _manifest_fits(paths, fingerprint, index_str):
        logger.info("index-train: %s is complete, skipped", paths.trained_index)
        return
    faiss = import_faiss()
    index = new_index(index_str, dimension)
    rows = training_rows(db.chunks, ratios, ntrain, seed)
    rows = rows[: int(load_fraction * len(rows))]
    if not index.is_trained:
        vectors = database_embeddings(paths, len(db), block_size, rows)
        try:
            index.train(np.ascontiguousarray(vectors, dtype=np.float32))
        except Exception as err:
            raise UserError(
                f"--retro-index-str {index_str!r} could not be trained on {len(rows)} chunks "
                f"(--retro-index-ntrain {ntrain}): {_faiss_reason(err)}"
            ) from None
    with atomic_path(paths.trained_index) as tmp:
        faiss.write_index(index, str(tmp))
    save_array(paths.index_dir / "train_rows.npy", rows)
    write_json(
        paths.index_manifest,
        {"database": fingerprint, "index_str": index_str, "trained_on": len(rows), "added": None},
    )
    logger.info("index-train: %s trained on %d chunks", index_str, len(rows))


def _manifest_fits(paths: ProjectPaths, fingerprint: str, index_str: str) -> bool:
    if not paths.index_manifest.is_file():
        return False
    manifest = read_json(paths.index_manifest)
    return manifest["database"] == fingerprint and manifest["index_str"] == index_str


def add_to_index(
    paths: ProjectPaths,
    n_chunks: int,
    fingerprint: str,
    index_str: str,
    load_fraction: float,
    block_size: int,
) -> None:
    """Add the first ``load_fraction`` of the database to the trained index
    (``index/added.faissindex``)."""
    if not paths.trained_index.is_file() or not _manifest_fits(paths, fingerprint, index_str):
        raise UserError(
            f"{paths.root} has no index trained on this database; run --retro-tasks index-train"
        )
    manifest = read_json(paths.index_manifest)
    if paths.added_index.is_file() and manifest.get("added") is not None:
        logger.info("index-add: %s is complete, skipped", paths.added_index)
        return
    faiss = import_faiss()
    index = faiss.read_index(str(paths.trained_index))
    count = int(load_fraction * n_chunks)
    for first, end in block_ranges(n_chunks, block_size):
        if first >= count:
            break
        block = load_array(paths.db_embeddings / block_name(first, end), mmap=True)
        index.add(np.ascontiguousarray(block[: min(end, count) - first], dtype=np.float32))
    with atomic_path(paths.added_index) as tmp:
        faiss.write_index(index, str(tmp))
    write_json(paths.index_manifest, manifest | {"added": int(index.ntotal)})
    logger.info("index-add: %d chunks in %s", index.ntotal, paths.added_index)
