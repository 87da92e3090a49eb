"""Retrieval at generation time (`mg.core.retro.retrieval`) against `mg-prep retro`'s
pretraining neighbours: the same chunk text gives the same database rows (Flat index),
and a sequence's neighbour tokens are those rows with their continuations."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("faiss")

from mg.core.fixtures import gpt2_bpe_tokenizer_config  # noqa: E402
from mg.core.retro.files import read_json  # noqa: E402
from mg.core.retro.project import ProjectPaths, RetroProjectError, read_neighbors  # noqa: E402
from mg.core.retro.retrieval import open_retriever  # noqa: E402
from mg.core.tokenizers import TokenizerConfig, build_tokenizer  # noqa: E402
from mg.corpus_prep.cli import main  # noqa: E402
from mg.corpus_prep.retro_config import RetroConfig  # noqa: E402
from mg.corpus_prep.retro_query import SampleReader, filter_neighbors, gpt_datasets  # noqa: E402
from mg.indexed_dataset import IndexedDataset  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from retro_corpus import botchan_documents, retro_argv, tiny_bert, write_dataset  # noqa: E402

CHUNK, QUERY, SAVED = 32, 40, 4  # retro_argv's chunk length and neighbour counts


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("retro_retrieval")
    data = write_dataset(root / "data" / "botchan", botchan_documents(count=120))
    argv = retro_argv(root / "project", [data], tiny_bert(root / "bert"))
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code in (0, None)
    return root / "project"


def open_for(project: Path, k: int, **kwargs):
    return open_retriever(
        project,
        build_tokenizer(gpt2_bpe_tokenizer_config()),
        CHUNK,
        k,
        2,
        IndexedDataset,
        bert_batch_size=32,  # retro_argv's --retro-bert-batch-size: the same batches
        **kwargs,
    )


def train_chunks(project: Path) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The train split's query chunks (token ids) and each one's own-document keys."""
    paths = ProjectPaths.of(project)
    config = RetroConfig(**read_json(paths.config))
    dataset, n_samples = gpt_datasets(config, paths, None)["train"]
    reader = SampleReader(dataset, [config.retro_gpt_data_path[1]], config.retro_gpt_seq_length)
    chunks, own = [], []
    for sample in range(n_samples):
        tokens, keys = reader.read(sample)
        for c in range(config.retro_gpt_seq_length // CHUNK):
            chunks.append(tokens[c * CHUNK : (c + 1) * CHUNK])
            own.append(keys)
    return chunks, own


def test_same_chunk_text_same_neighbours_as_the_pretraining_query(project: Path) -> None:
    retriever = open_for(project, SAVED)
    chunks, own = train_chunks(project)
    saved = read_neighbors(ProjectPaths.of(project), "train")
    candidates = retriever.search(chunks, QUERY)
    mine = filter_neighbors(candidates, retriever.database.doc_keys, own, SAVED)
    assert saved.shape == mine.shape == (len(chunks), SAVED)
    np.testing.assert_array_equal(mine, saved)
    # without the own-document filter, a chunk taken from the database finds itself
    assert (candidates[:, 0] >= 0).all()


def test_neighbor_tokens_are_the_rows_with_their_continuations(project: Path) -> None:
    retriever = open_for(project, 3)
    chunks, _ = train_chunks(project)
    sequence = np.concatenate(chunks[:2]).tolist() + chunks[2][:5].tolist()  # 2 chunks + 5
    tokens = retriever.neighbor_tokens(sequence)
    assert tokens.shape == (3, 3, 2 * CHUNK)
    ids = retriever.search(chunks[:2], 3)
    for c in range(2):
        np.testing.assert_array_equal(tokens[c], retriever.database.retrieved_tokens(ids[c], 2))
    assert (tokens[2] == retriever.database.eod_token_id).all()  # incomplete: not attended
    # a chunk is searched once: the grown sequence reuses its neighbours
    assert len(retriever._cache) == 2
    np.testing.assert_array_equal(retriever.neighbor_tokens(sequence[:64])[:2], tokens[:2])


def test_a_project_that_does_not_fit_the_model_is_refused_by_flag(project: Path) -> None:
    gpt = build_tokenizer(gpt2_bpe_tokenizer_config())
    with pytest.raises(RetroProjectError, match=r"^--retro-project-dir .*chunks are 32 tokens"):
        open_retriever(project, gpt, 64, 2, 2, IndexedDataset)
    null = build_tokenizer(TokenizerConfig("NullTokenizer", vocab_size=127))
    with pytest.raises(RetroProjectError, match=r"^--retro-project-dir .*GPT2BPETokenizer"):
        open_retriever(project, null, CHUNK, 2, 2, IndexedDataset)
    with pytest.raises(RetroProjectError, match="^--retro-project-dir .*not a Retro project"):
        open_retriever(project / "db", gpt, CHUNK, 2, 2, IndexedDataset)
