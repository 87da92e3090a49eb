"""`mg-prep retro`: runs the stages --retro-tasks names, in order, on one project folder.

The arguments are settled first (the folder's record, the flags, Megatron's
defaults; retro_config), then everything that can be refused is refused before
any work starts: a BERT checkpoint whose vocabulary is not the database's BERT
tokenizer, an index string Faiss rejects, a sequence length that is not a
multiple of the chunk length. Each stage skips what is already on disk.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

import torch

from mg.core.retro.bert_embedder import (
    BertCheckpoint,
    BertCheckpointError,
    BertEmbedder,
    load_bert_checkpoint,
    vocabulary_mismatch,
)
from mg.core.retro.chunk_db import ChunkDatabase
from mg.core.retro.faiss_index import open_added_index, set_search_parameters
from mg.core.retro.files import load_array
from mg.core.retro.project import ProjectPaths, RetroProjectError, read_database_fingerprint
from mg.core.tokenizers import TokenizerConfig, build_tokenizer
from mg.core.tokenizers.base import BaseTokenizer
from mg.corpus_prep.commands import UserError
from mg.corpus_prep.retro_config import RetroConfig, check, merged_config, record, task_list
from mg.corpus_prep.retro_db import DatasetInfo, build_db, open_datasets
from mg.corpus_prep.retro_index import (
    add_to_index,
    embed_database,
    new_index,
    train_index,
)
from mg.corpus_prep.retro_query import QuerySettings, SampleReader, gpt_datasets, query_split

logger = logging.getLogger("mg.corpus_prep.retro")


def _tokenizer(config: TokenizerConfig, what: str) -> BaseTokenizer:
    try:
        return build_tokenizer(config)
    except (ValueError, OSError) as err:
        raise UserError(f"{what}: {err}") from None


def gpt_tokenizer(config: RetroConfig) -> BaseTokenizer:
    return _tokenizer(
        TokenizerConfig(
            config.retro_gpt_tokenizer_type,
            vocab_file=config.retro_gpt_vocab_file,
            merge_file=config.retro_gpt_merge_file,
            tokenizer_model=config.retro_gpt_tokenizer_model,
        ),
        "--retro-gpt-tokenizer-type",
    )


def bert_tokenizer(config: RetroConfig, checkpoint: BertCheckpoint | None) -> BaseTokenizer:
    """The database's BERT tokenizer: the flags', else the one the checkpoint records (which
    is then recorded as the project's)."""
    if config.retro_bert_tokenizer_type is None:
        recorded = checkpoint.tokenizer_config if checkpoint else None
        if recorded is None or recorded.vocab_file is None:
            raise UserError(
                f"--load {config.load} records no WordPiece tokenizer; give "
                "--retro-bert-tokenizer-type and --retro-bert-vocab-file"
            )
        config.retro_bert_tokenizer_type = recorded.tokenizer_type
        config.retro_bert_vocab_file = recorded.vocab_file
    tokenizer = _tokenizer(
        TokenizerConfig(config.retro_bert_tokenizer_type, vocab_file=config.retro_bert_vocab_file),
        "--retro-bert-tokenizer-type",
    )
    if tokenizer.cls is None or tokenizer.sep is None:
        raise UserError(
            f"--retro-bert-tokenizer-type {config.retro_bert_tokenizer_type} has no [CLS]/[SEP]; "
            "BERT embeds WordPiece text (BertWordPieceLowerCase or BertWordPieceCase)"
        )
    return tokenizer


def open_database(
    paths: ProjectPaths, infos: list[DatasetInfo], config: RetroConfig, eod: int | None
) -> ChunkDatabase:
    chunks = load_array(paths.chunks, mmap=True)
    sources = [info.dataset for info in infos]
    return ChunkDatabase(chunks, sources, config.retro_gpt_chunk_length, -1 if eod is None else eod)


def run(args: argparse.Namespace) -> int:
    # progress lines: ours and mg.indexed_dataset's (not Faiss' loader), for this run only
    progress = logging.getLogger("mg")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("mg-prep retro: %(message)s"))
    progress.addHandler(handler)
    level = progress.level
    progress.setLevel(logging.INFO)
    try:
        return _run(args)
    except (BertCheckpointError, RetroProjectError) as err:
        raise UserError(str(err)) from None
    except KeyboardInterrupt:
        logger.info("stopped; finished blocks are kept, the same command resumes")
        raise
    finally:
        progress.removeHandler(handler)
        progress.setLevel(level)


def _run(args: argparse.Namespace) -> int:
    paths = ProjectPaths.of(args.retro_project_dir)
    stages = task_list(args.retro_tasks)
    config = merged_config(args, paths)
    check(config, stages)
    gpt = gpt_tokenizer(config)
    checkpoint = load_bert_checkpoint(config.load) if config.load else None
    bert = bert_tokenizer(config, checkpoint)
    if checkpoint is not None:
        mismatch = vocabulary_mismatch(bert, checkpoint)
        if mismatch:
            raise UserError(mismatch)
        if "index-train" in stages:
            new_index(config.retro_index_str, checkpoint.config.hidden_size)  # refused early
    paths.root.mkdir(parents=True, exist_ok=True)
    record(config, paths)
    infos = open_datasets(config.retro_gpt_data_path, config.retro_gpt_split)

    if "db-build" in stages:
        build_db(
            paths, infos, config.retro_gpt_chunk_length, config.retro_doc_block_size, gpt, bert
        )
    if stages == ["db-build"]:
        return 0
    fingerprint = read_database_fingerprint(paths)
    db = open_database(paths, infos, config, gpt.eod)
    assert checkpoint is not None  # check() asked for --load
    if torch.cuda.is_available():  # BERT on the GPU; Faiss stays on the CPU (faiss-cpu)
        checkpoint.model.cuda()
    embedder = BertEmbedder(
        checkpoint.model,
        bert,
        config.retro_bert_max_chunk_length,
        args.retro_bert_batch_size,
        normalize=True,  # inner products of unit vectors (bert_embedder says why)
    )
    if "index-train" in stages or "index-add" in stages:
        embed_database(paths, db, embedder, gpt, config.retro_block_size)
    if "index-train" in stages:
        train_index(
            paths,
            db,
            fingerprint,
            config.retro_index_str,
            embedder.dimension,
            config.retro_index_ntrain,
            config.retro_index_train_load_fraction,
            [info.ratio for info in infos],
            config.retro_gpt_seed,
            config.retro_block_size,
        )
    if "index-add" in stages:
        add_to_index(
            paths,
            len(db),
            fingerprint,
            config.retro_index_str,
            config.retro_index_add_load_fraction,
            config.retro_block_size,
        )
    if "query-neighbors" in stages:
        query_all(paths, config, args, fingerprint, db, embedder, gpt, infos)
    return 0


def query_all(
    paths: ProjectPaths,
    config: RetroConfig,
    args: argparse.Namespace,
    fingerprint: str,
    db: ChunkDatabase,
    embedder: BertEmbedder,
    gpt: BaseTokenizer,
    infos: list[DatasetInfo],
) -> None:
    """Query the train, valid and test chunks against the added index."""
    index: Any = open_added_index(paths, fingerprint)  # a RetroProjectError: one line
    set_search_parameters(index, config.retro_query_nprobe, config.retro_query_ef_search)
    settings = QuerySettings(
        config.retro_gpt_seq_length,
        config.retro_gpt_chunk_length,
        config.retro_query_num_neighbors_query,
        config.retro_query_num_neighbors_save,
        config.retro_block_size,
    )
    identity = {
        "database": fingerprint,
        "index_str": config.retro_index_str,
        "index_ntotal": int(index.ntotal),
        "load": config.load,
        "seq_length": config.retro_gpt_seq_length,
        "seed": config.retro_gpt_seed,
        "split_weights": config.retro_gpt_split,
        "nprobe": config.retro_query_nprobe,
        "ef_search": config.retro_query_ef_search,
        "num_neighbors_query": config.retro_query_num_neighbors_query,
    }
    prefixes = [info.prefix for info in infos]
    for split, (dataset, n_samples) in gpt_datasets(
        config, paths, args.retro_gpt_data_cache_path
    ).items():
        reader = SampleReader(dataset, prefixes, config.retro_gpt_seq_length)
        query_split(split, reader, n_samples, settings, paths, identity, db, index, embedder, gpt)
