"""Retrieval at generation time: a Retro model's neighbours for text it is given.

Training reads each chunk's neighbours from the table `mg-prep retro` queried in
advance; a prompt has none. Here its chunks are embedded with the project's BERT
(the checkpoint, tokenizer and chunk cut the project recorded), the project's index
is searched (`faiss_index.search_chunks`, the search `mg-prep retro` queries with) and
each neighbour is read with its continuation from the chunk database, as training
reads them. Unlike the pretraining query nothing is dropped: a prompt is not a
database document.

A sequence of s tokens is l = ⌈s/m⌉ chunks of m = the project's
``retro_gpt_chunk_length``. The complete chunks are queried (each once: a chunk's
neighbours are kept while the sequence grows); an incomplete last chunk gets
end-of-document rows, which no token can attend to (chunk i's neighbours are seen
from its last token on). The result, [l, k, r] token ids, is what `RetroModel.forward`
takes as ``context_input_ids`` (one sequence; stack rows for a batch).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mg.core.retro.bert_embedder import (
    BertCheckpointError,
    BertEmbedder,
    load_bert_checkpoint,
    vocabulary_mismatch,
)
from mg.core.retro.chunk_db import ChunkDatabase, TokenSource
from mg.core.retro.faiss_index import open_added_index, search_chunks, set_search_parameters
from mg.core.retro.files import load_array, read_json
from mg.core.retro.project import ProjectPaths, RetroProjectError, read_database_fingerprint
from mg.core.tokenizers import TokenizerConfig, build_tokenizer
from mg.core.tokenizers.base import BaseTokenizer

FLAG = "--retro-project-dir"


class Retriever:
    """A project's database, index and BERT, answering chunks of GPT token ids."""

    def __init__(
        self,
        database: ChunkDatabase,
        index: Any,
        embedder: BertEmbedder,
        tokenizer: BaseTokenizer,
        num_neighbors: int,
        num_retrieved_chunks: int,
    ) -> None:
        self.database = database
        self.index = index
        self.embedder = embedder
        self.tokenizer = tokenizer
        self.num_neighbors = num_neighbors
        self.num_retrieved_chunks = num_retrieved_chunks
        self._cache: dict[tuple[int, ...], np.ndarray] = {}

    @property
    def chunk_length(self) -> int:
        return self.database.chunk_length

    @property
    def retrieved_length(self) -> int:
        return self.num_retrieved_chunks * self.chunk_length

    def chunk_text(self, chunk: Sequence[int]) -> str:
        """What the chunk is embedded as: its detokenized ids (as the pretraining query)."""
        return self.tokenizer.detokenize([int(t) for t in chunk if int(t) >= 0])

    def search(self, chunks: Sequence[Sequence[int]], k: int | None = None) -> np.ndarray:
        """The ``k`` (default: num_neighbors) nearest database rows of each chunk [n, k]."""
        texts = [self.chunk_text(c) for c in chunks]
        return search_chunks(self.embedder, self.index, texts, k or self.num_neighbors)

    def neighbor_ids(self, chunks: Sequence[Sequence[int]]) -> np.ndarray:
        """num_neighbors database rows per chunk, each chunk searched once per retriever."""
        keys = [tuple(int(t) for t in c) for c in chunks]
        new = list(dict.fromkeys(k for k in keys if k not in self._cache))
        for key, ids in zip(new, self.search(new), strict=True):
            self._cache[key] = ids
        if not keys:
            return np.zeros((0, self.num_neighbors), dtype=np.int64)
        return np.stack([self._cache[k] for k in keys])

    def neighbor_tokens(self, token_ids: Sequence[int]) -> np.ndarray:
        """[l, k, r] neighbour tokens of a sequence: each neighbour and its continuation for
        its complete chunks, end-of-document rows for an incomplete last chunk."""
        m = self.chunk_length
        n_chunks = max(1, -(-len(token_ids) // m))
        complete = [token_ids[i * m : (i + 1) * m] for i in range(len(token_ids) // m)]
        out = np.full(
            (n_chunks, self.num_neighbors, self.retrieved_length),
            self.database.eod_token_id,
            dtype=np.int64,
        )
        for row, ids in enumerate(self.neighbor_ids(complete)):
            out[row] = self.database.retrieved_tokens(ids, self.num_retrieved_chunks)
        return out


def project_tokenizer_mismatch(recorded: dict[str, Any], tokenizer: BaseTokenizer) -> str | None:
    """Why the database's GPT tokenizer (the project's record) is not ``tokenizer``."""
    kind = recorded.get("retro_gpt_tokenizer_type")
    if kind is None:
        return None
    try:
        own = build_tokenizer(
            TokenizerConfig(
                kind,
                vocab_file=recorded.get("retro_gpt_vocab_file"),
                merge_file=recorded.get("retro_gpt_merge_file"),
                tokenizer_model=recorded.get("retro_gpt_tokenizer_model"),
            )
        )
    except (ValueError, OSError) as err:
        return f"its GPT tokenizer ({kind}) cannot be built: {err}"
    if own.vocab_size != tokenizer.vocab_size or own.eod != tokenizer.eod:
        return (
            f"its database was tokenized with {kind} ({own.vocab_size} tokens, end of document "
            f"{own.eod}), the model's tokenizer has {tokenizer.vocab_size} tokens (end of "
            f"document {tokenizer.eod})"
        )
    probe = list(range(0, tokenizer.vocab_size, max(1, tokenizer.vocab_size // 64)))
    if [own.id_to_token(i) for i in probe] != [tokenizer.id_to_token(i) for i in probe]:
        return f"its database was tokenized with another vocabulary ({kind})"
    return None


def open_retriever(
    project_dir: str | os.PathLike[str],
    tokenizer: BaseTokenizer,
    chunk_length: int,
    num_neighbors: int,
    num_retrieved_chunks: int,
    open_source: Callable[[str], TokenSource],
    bert_batch_size: int = 128,
    flag: str = FLAG,
) -> Retriever:
    """The retriever of a finished `mg-prep retro` project for a model with ``tokenizer``
    and ``chunk_length``; ``open_source`` opens a dataset prefix (``IndexedDataset``).

    Everything that does not fit is a one-line :class:`RetroProjectError` naming ``flag``:
    no such project, another chunk length or tokenizer, no finished database or index,
    a BERT checkpoint that is gone or does not fit its vocabulary. Needs Faiss.
    """
    paths = ProjectPaths.of(project_dir)
    where = f"{flag} {paths.root}"
    if not paths.config.is_file():
        raise RetroProjectError(
            f"{where}: not a Retro project (no {paths.config.name}); build one with `mg-prep retro`"
        )
    recorded = read_json(paths.config)
    recorded_chunk = recorded.get("retro_gpt_chunk_length")
    if recorded_chunk is not None and int(recorded_chunk) != chunk_length:
        raise RetroProjectError(
            f"{where}: its chunks are {recorded_chunk} tokens (--retro-gpt-chunk-length), the "
            f"model's are {chunk_length}; give the project the model was trained with"
        )
    mismatch = project_tokenizer_mismatch(recorded, tokenizer)
    if mismatch:
        raise RetroProjectError(f"{where}: {mismatch}; give the project the model was trained with")
    try:
        fingerprint = read_database_fingerprint(paths)
        index = open_added_index(paths, fingerprint)
    except RetroProjectError as err:
        raise RetroProjectError(f"{where}: {err}") from None
    set_search_parameters(
        index,
        int(recorded.get("retro_query_nprobe") or 1),
        int(recorded.get("retro_query_ef_search") or 1),
    )
    infos = read_json(paths.datasets)
    try:
        sources = [open_source(info["prefix"]) for info in infos]
    except (OSError, ValueError) as err:
        raise RetroProjectError(f"{where}: its dataset cannot be read: {err}") from None
    database = ChunkDatabase(
        load_array(paths.chunks, mmap=True), sources, chunk_length, tokenizer.eod
    )
    if not recorded.get("load"):
        raise RetroProjectError(f"{where}: records no BERT checkpoint (--load of mg-prep retro)")
    try:
        checkpoint = load_bert_checkpoint(recorded["load"], flag=f"{where}: its BERT")
    except BertCheckpointError as err:
        raise RetroProjectError(str(err)) from None
    bert_kind = recorded.get("retro_bert_tokenizer_type")
    if bert_kind is None:
        raise RetroProjectError(f"{where}: records no BERT tokenizer (--retro-bert-tokenizer-type)")
    try:
        bert = build_tokenizer(
            TokenizerConfig(bert_kind, vocab_file=recorded.get("retro_bert_vocab_file"))
        )
    except (ValueError, OSError) as err:
        raise RetroProjectError(f"{where}: its BERT tokenizer cannot be built: {err}") from None
    wrong = vocabulary_mismatch(bert, checkpoint, flag=f"{where}: its BERT")
    if wrong:
        raise RetroProjectError(wrong)
    embedder = BertEmbedder(
        checkpoint.model,
        bert,
        int(recorded.get("retro_bert_max_chunk_length") or 256),
        bert_batch_size,
        normalize=True,  # the database was embedded so (bert_embedder says why)
    )
    return Retriever(database, index, embedder, tokenizer, num_neighbors, num_retrieved_chunks)


def open_checkpoint_retriever(
    project_dir: str | None,
    saved_args: dict[str, Any],
    checkpoint: str,
    tokenizer: BaseTokenizer,
    config: Any,
    open_source: Callable[[str], TokenSource],
    device: Any = None,
) -> Retriever:
    """The retriever a Retro checkpoint generates with (mg-eval qa, mg-serve): the project
    ``project_dir`` (--retro-project-dir) or, without it, the one the checkpoint's saved
    args name (`mg-train retro`'s), opened for its RetroConfig ``config``; BERT moved to
    ``device`` (the model's; Faiss searches on the CPU). ``checkpoint`` names it in errors."""
    project_dir = project_dir or saved_args.get("retro_project_dir")
    if not project_dir:
        raise RetroProjectError(
            f"{checkpoint} records no retro_project_dir; give {FLAG} (the mg-prep retro folder "
            "the model was trained on)"
        )
    if not os.path.isdir(project_dir):
        raise RetroProjectError(f"{FLAG} {project_dir}: no such folder")
    retriever = open_retriever(
        project_dir,
        tokenizer,
        config.retro_chunk_length,
        config.retro_num_neighbors,
        config.retro_num_retrieved_chunks,
        open_source,
    )
    if device is not None:
        retriever.embedder.model.to(device)
    return retriever
