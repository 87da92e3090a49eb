"""The chunk database (task ``db-build``): the training documents cut into chunks.

Each document of the training split of each dataset (its trailing
end-of-document token removed) is cut into consecutive chunks of
``--retro-gpt-chunk-length`` tokens, the last one shorter. A chunk is kept when
its text, detokenized and re-tokenized for BERT, is not empty (Megatron's
"valid" chunks). The work goes in blocks of ``--retro-doc-block-size``
documents, each saved on its own, so an interrupted build redoes only the
block it was in; the merged table and its manifest are written last.

The training split is the first ``round(w_train * N)`` sequences, as the GPT
datasets split them (``mg.indexed_dataset.split_range``), so the database holds
exactly the documents the training samples are drawn from.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mg.core.retro.files import load_array, read_json, save_array, write_json
from mg.core.retro.project import (
    ProjectPaths,
    block_name,
    block_ranges,
    database_fingerprint,
)
from mg.core.tokenizers.base import BaseTokenizer
from mg.corpus_prep.commands import UserError
from mg.indexed_dataset import IndexedDataset, IndexedDatasetError, parse_split
from mg.indexed_dataset.split import split_matrix, split_range

logger = logging.getLogger(__name__)


@dataclass
class DatasetInfo:
    """One indexed dataset of the blend, in the order of --retro-gpt-data-path."""

    prefix: str
    ratio: float
    dataset: IndexedDataset
    n_docs_train: int

    def describe(self) -> dict:
        return {
            "prefix": self.prefix,
            "ratio": self.ratio,
            "n_docs": len(self.dataset),
            "n_docs_train": self.n_docs_train,
            "n_tokens": int(self.dataset.num_tokens),
        }


def open_datasets(data_path: list[str], split: str) -> list[DatasetInfo]:
    """The blend's datasets, each with the number of its documents in the training split."""
    bookends = split_matrix(parse_split(split))[0]
    infos = []
    for i in range(0, len(data_path), 2):
        prefix = data_path[i + 1]
        try:
            dataset = IndexedDataset(prefix)
        except (IndexedDatasetError, OSError) as err:
            raise UserError(f"--retro-gpt-data-path {prefix}: {err}") from None
        n_train = 0 if bookends is None else len(split_range(bookends, len(dataset)))
        infos.append(DatasetInfo(prefix, float(data_path[i]), dataset, n_train))
    return infos


def chunk_document(
    tokens: np.ndarray,
    chunk_length: int,
    eod: int | None,
    detokenize: Callable[[list[int]], str],
    bert_tokenize: Callable[[str], list[int]],
) -> list[tuple[int, int, int]]:
    """(start, end, BERT length) of a document's valid chunks."""
    if eod is not None and len(tokens) and int(tokens[-1]) == eod:
        tokens = tokens[:-1]
    rows = []
    for start in range(0, len(tokens), chunk_length):
        end = min(len(tokens), start + chunk_length)
        bert_length = len(bert_tokenize(detokenize(tokens[start:end].tolist())))
        if bert_length:
            rows.append((start, end, bert_length))
    return rows


def build_db(
    paths: ProjectPaths,
    infos: list[DatasetInfo],
    chunk_length: int,
    doc_block_size: int,
    gpt_tokenizer: BaseTokenizer,
    bert_tokenizer: BaseTokenizer,
) -> str:
    """Build (or finish) the database; returns its fingerprint. Skipped when complete."""
    if paths.db_manifest.is_file():
        logger.info("db-build: %s is complete, skipped", paths.db_dir)
        return str(read_json(paths.db_manifest)["fingerprint"])
    tables = []
    for number, info in enumerate(infos):
        folder = paths.db_blocks(number)
        parts = []
        for first, end in block_ranges(info.n_docs_train, doc_block_size):
            path = folder / block_name(first, end)
            if not path.is_file():
                rows = []
                for doc in range(first, end):
                    for start, stop, bert_len in chunk_document(
                        info.dataset.get(doc),
                        chunk_length,
                        gpt_tokenizer.eod,
                        gpt_tokenizer.detokenize,
                        bert_tokenizer.tokenize,
                    ):
                        rows.append((doc, start, stop, bert_len))
                save_array(path, np.asarray(rows, dtype=np.uint32).reshape(-1, 4))
                logger.info("db-build: dataset %d documents %d-%d done", number, first, end)
            parts.append(load_array(path))
        table = np.concatenate(parts) if parts else np.zeros((0, 4), np.uint32)
        tables.append(np.column_stack([np.full(len(table), number, np.uint32), table]))
    chunks = np.concatenate(tables).astype(np.uint32) if tables else np.zeros((0, 5), np.uint32)
    if not len(chunks):
        raise UserError(
            "--retro-gpt-data-path: the training split holds no chunk with text; check "
            "--retro-gpt-split and the datasets"
        )
    datasets = [info.describe() for info in infos]
    for number, info in enumerate(datasets):
        info["n_chunks"] = int((chunks[:, 0] == number).sum())
    fingerprint = database_fingerprint(chunks, datasets)
    save_array(paths.chunks, chunks)
    write_json(paths.datasets, datasets)
    write_json(
        paths.db_manifest,
        {"fingerprint": fingerprint, "n_chunks": len(chunks), "chunk_length": chunk_length},
    )
    logger.info("db-build: %d chunks, database %s", len(chunks), fingerprint)
    return fingerprint
