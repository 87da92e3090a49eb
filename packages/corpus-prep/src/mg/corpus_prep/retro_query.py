"""The pretraining neighbours (task ``query-neighbors``).

The train, valid and test samples are those ``mg-train`` draws from the same
data, seed, split and sequence length (``mg.indexed_dataset.build_gpt_datasets``,
Megatron's sample counts from --retro-gpt-train-samples, -global-batch-size,
-eval-interval and -eval-iters). Sample s is cut into ``seq_length / chunk_length``
chunks; query chunk ``s * chunks_per_sample + c`` is embedded, the index is
searched for --retro-query-num-neighbors-query neighbours, those from a document
the sample holds are dropped (a sample must not retrieve its own text), and the
first --retro-query-num-neighbors-save are kept (-1 where fewer remain). Blocks
of --retro-block-size chunks are saved as they finish; the split's manifest,
naming the database and index, is written last.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from mg.core.retro.bert_embedder import BertEmbedder
from mg.core.retro.chunk_db import ChunkDatabase, document_keys
from mg.core.retro.faiss_index import search_chunks
from mg.core.retro.files import read_json, save_array, write_json
from mg.core.retro.project import SPLITS, ProjectPaths, block_name, block_ranges
from mg.core.tokenizers.base import BaseTokenizer
from mg.corpus_prep.commands import UserError
from mg.indexed_dataset import (
    BlendedDataset,
    GPTDataset,
    GPTDatasetConfig,
    build_gpt_datasets,
    samples_per_split,
)

logger = logging.getLogger(__name__)


@dataclass
class QuerySettings:
    seq_length: int
    chunk_length: int
    num_neighbors_query: int
    num_neighbors_save: int
    block_size: int

    @property
    def chunks_per_sample(self) -> int:
        return self.seq_length // self.chunk_length


def gpt_datasets(config: Any, paths: ProjectPaths, cache: str | None) -> dict[str, Any]:
    """The train/valid/test sample datasets and how many samples of each are queried."""
    counts = samples_per_split(
        global_batch_size=config.retro_gpt_global_batch_size,
        eval_interval=config.retro_gpt_eval_interval,
        eval_iters=config.retro_gpt_eval_iters,
        train_samples=config.retro_gpt_train_samples,
    )
    data_config = GPTDatasetConfig(
        seq_length=config.retro_gpt_seq_length,
        seed=config.retro_gpt_seed,
        split=config.retro_gpt_split,
        path_to_cache=cache or str(paths.root / "gpt_cache"),
    )
    words = config.retro_gpt_data_path
    if len(words) == 2:  # one dataset: its weight means nothing (no blend of one)
        words = words[1:]
    try:
        datasets = build_gpt_datasets(words, counts, data_config)
    except ValueError as err:
        raise UserError(f"--retro-gpt-data-path: {err}") from None
    return {
        split: (dataset, min(count, len(dataset)))
        for split, dataset, count in zip(SPLITS, datasets, counts, strict=True)
        if dataset is not None and count > 0
    }


class SampleReader:
    """A sample's tokens and the (dataset, document) keys of the documents it holds."""

    def __init__(self, dataset: Any, prefixes: list[str], seq_length: int) -> None:
        self.dataset = dataset
        self.number = {os.path.abspath(p): i for i, p in enumerate(prefixes)}
        self.seq_length = seq_length

    def _inner(self, sample: int) -> tuple[GPTDataset, int]:
        if isinstance(self.dataset, BlendedDataset):
            which = int(self.dataset.dataset_index[sample])
            inner = int(self.dataset.dataset_sample_index[sample])
            return self.dataset.datasets[which], inner
        return self.dataset, sample

    def read(self, sample: int) -> tuple[np.ndarray, np.ndarray]:
        dataset, inner = self._inner(sample)
        position = int(dataset.shuffle_index[inner])
        first = int(dataset.sample_index[position][0])
        last = int(dataset.sample_index[position + 1][0])
        documents = dataset.document_index[first : last + 1]
        number = self.number[os.path.abspath(dataset.dataset_path)]
        tokens = dataset.sample_tokens(inner)[: self.seq_length]
        return tokens, document_keys(number, documents)


def filter_neighbors(
    candidates: np.ndarray, db_keys: np.ndarray, own_keys: list[np.ndarray], keep: int
) -> np.ndarray:
    """Each row's candidates (best first) without -1s and chunks of its own documents,
    cut or padded with -1 to ``keep``."""
    out = np.full((len(candidates), keep), -1, dtype=np.int64)
    for row, (ids, own) in enumerate(zip(candidates, own_keys, strict=True)):
        ids = ids[ids >= 0]
        ids = ids[~np.isin(db_keys[ids], own)][:keep]
        out[row, : len(ids)] = ids
    return out


def query_split(
    split: str,
    reader: SampleReader,
    n_samples: int,
    settings: QuerySettings,
    paths: ProjectPaths,
    identity: dict[str, Any],
    db: ChunkDatabase,
    index: Any,
    embedder: BertEmbedder,
    gpt_tokenizer: BaseTokenizer,
) -> None:
    """Query every chunk of a split's samples; skipped when the split's manifest is there."""
    folder = paths.query_dir(split)
    manifest_path = paths.query_manifest(split)
    n_chunks = n_samples * settings.chunks_per_sample
    manifest = identity | {
        "split": split,
        "n_samples": n_samples,
        "n_chunks": n_chunks,
        "chunks_per_sample": settings.chunks_per_sample,
        "chunk_length": settings.chunk_length,
        "block_size": settings.block_size,
        "num_neighbors": settings.num_neighbors_save,
    }
    if manifest_path.is_file() and read_json(manifest_path) == manifest:
        logger.info("query-neighbors: %s is complete, skipped", folder)
        return
    started = folder / "started.json"
    if started.is_file() and read_json(started) != manifest:
        raise UserError(
            f"{folder} holds neighbours of another database or index ({started}); delete "
            f"{folder} to query again"
        )
    write_json(started, manifest)
    cps, length = settings.chunks_per_sample, settings.chunk_length
    ranges = block_ranges(n_chunks, settings.block_size)
    for number, (first, end) in enumerate(ranges):
        path = folder / block_name(first, end)
        if path.is_file():
            continue
        texts, own = [], []
        samples = {}
        for chunk in range(first, end):
            sample = chunk // cps
            if sample not in samples:
                samples = {sample: reader.read(sample)}
            tokens, keys = samples[sample]
            piece = tokens[(chunk % cps) * length : (chunk % cps + 1) * length]
            texts.append(gpt_tokenizer.detokenize(piece[piece >= 0].tolist()))
            own.append(keys)
        candidates = search_chunks(embedder, index, texts, settings.num_neighbors_query)
        neighbors = filter_neighbors(candidates, db.doc_keys, own, settings.num_neighbors_save)
        save_array(path, neighbors)
        logger.info("query-neighbors: %s block %d/%d", split, number + 1, len(ranges))
    write_json(manifest_path, manifest)
    started.unlink(missing_ok=True)
