"""`mg-prep retro build` on real text: the chunk database, Faiss neighbours equal to a
brute-force inner-product search, the IVF/PQ and HNSW indexes' recall against Flat, the
own-document exclusion, and neighbours with their continuations read back through core."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("faiss")

from mg.core.retro.bert_embedder import BertEmbedder, load_bert_checkpoint  # noqa: E402
from mg.core.retro.chunk_db import ChunkDatabase, document_keys  # noqa: E402
from mg.core.retro.files import load_array, read_json  # noqa: E402
from mg.core.retro.project import ProjectPaths, block_ranges, read_neighbors  # noqa: E402
from mg.core.tokenizers import TokenizerConfig, build_tokenizer  # noqa: E402
from mg.corpus_prep.cli import main  # noqa: E402
from mg.corpus_prep.retro_config import RetroConfig  # noqa: E402
from mg.corpus_prep.retro_query import SampleReader, gpt_datasets  # noqa: E402
from mg.indexed_dataset import IndexedDataset  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from retro_corpus import (  # noqa: E402
    bert_vocab,
    botchan_documents,
    minilm_bert,
    retro_argv,
    tiny_bert,
    write_dataset,
)

K = 4  # --retro-query-num-neighbors-save in retro_argv


def run(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as stop:
        return int(stop.code or 0)
    return 0


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("retro_inputs")
    data = write_dataset(root / "data" / "botchan", botchan_documents())
    return {"data": data, "bert": tiny_bert(root / "bert"), "root": root}


@pytest.fixture(scope="module")
def flat(inputs: dict) -> Path:
    project = inputs["root"] / "flat"
    assert run(retro_argv(project, [inputs["data"]], inputs["bert"])) == 0
    return project


def gpt_tokenizer():
    from mg.core.fixtures import gpt2_bpe_tokenizer_config

    return build_tokenizer(gpt2_bpe_tokenizer_config())


def test_database_chunks_are_the_training_documents(flat: Path, inputs: dict) -> None:
    """Every training document, end-of-document token removed, is its chunks back to back."""
    paths = ProjectPaths.of(flat)
    chunks = load_array(paths.chunks)
    infos = read_json(paths.datasets)
    dataset = IndexedDataset(inputs["data"])
    assert infos[0]["n_docs"] == len(dataset) == 358
    assert infos[0]["n_docs_train"] == round(0.9 * len(dataset))  # --retro-gpt-split 90,10,0
    assert chunks.dtype == np.uint32 and chunks.shape[1] == 5
    assert set(chunks[:, 1].tolist()) == set(range(infos[0]["n_docs_train"]))
    for doc in (0, 7, 289):
        rows = chunks[chunks[:, 1] == doc]
        tokens = dataset.get(doc)
        assert tokens[-1] == gpt_tokenizer().eod
        assert rows[0, 2] == 0 and rows[-1, 3] == len(tokens) - 1
        assert (rows[1:, 2] == rows[:-1, 3]).all() and ((rows[:, 3] - rows[:, 2]) <= 32).all()
    assert (chunks[:, 4] > 0).all()  # BERT lengths of valid chunks


def query_embeddings(flat: Path, split: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """The split's query chunk embeddings, recomputed the way the query stage does (one
    block), and each chunk's own-document keys."""
    paths = ProjectPaths.of(flat)
    config = RetroConfig(**read_json(paths.config))
    datasets = gpt_datasets(config, paths, None)
    dataset, n_samples = datasets[split]
    reader = SampleReader(dataset, [config.retro_gpt_data_path[1]], config.retro_gpt_seq_length)
    checkpoint = load_bert_checkpoint(config.load)
    bert = build_tokenizer(TokenizerConfig("BertWordPieceLowerCase", vocab_file=bert_vocab()))
    embedder = BertEmbedder(checkpoint.model, bert, 64, 32, normalize=True)
    tokenizer = gpt_tokenizer()
    texts, own = [], []
    for sample in range(n_samples):
        tokens, keys = reader.read(sample)
        for c in range(4):
            piece = tokens[c * 32 : (c + 1) * 32]
            texts.append(tokenizer.detokenize(piece.tolist()))
            own.append(keys)
    return embedder.embed(texts), own


def database_embeddings(flat: Path) -> np.ndarray:
    paths = ProjectPaths.of(flat)
    n = len(load_array(paths.chunks))
    files = sorted(paths.db_embeddings.glob("*.npy"))
    assert len(files) == len(block_ranges(n, 200))
    return np.concatenate([load_array(f) for f in files])


@pytest.mark.parametrize("split", ["train", "valid"])
def test_flat_neighbours_equal_brute_force(flat: Path, split: str) -> None:
    """Flat index neighbours == numpy's inner products over the same embeddings, sorted,
    own documents dropped: the same ids in the same order."""
    paths = ProjectPaths.of(flat)
    queries, own = query_embeddings(flat, split)
    database = database_embeddings(flat)
    chunks = load_array(paths.chunks)
    keys = document_keys(chunks[:, 0], chunks[:, 1])
    # Identical chunk texts (a "." left at a document's end) have identical embeddings, and
    # Faiss orders exact ties as it likes: such ids are compared as one class, the
    # lowest id of the identical rows.
    _, klass = np.unique(database, axis=0, return_inverse=True)
    first_of = {}
    for row, k in enumerate(klass.reshape(-1)):
        first_of.setdefault(int(k), row)
    canonical = np.array([first_of[int(k)] for k in klass.reshape(-1)] + [-1])
    scores = queries.astype(np.float64) @ database.astype(np.float64).T
    expected = np.full((len(queries), K), -1, dtype=np.int64)
    gaps = []
    for row in range(len(queries)):
        order = np.lexsort((np.arange(len(database)), -scores[row]))
        order = order[~np.isin(keys[order], own[row])][: K + 1]
        expected[row] = order[:K]
        gaps.append(np.diff(-scores[row, order])[np.diff(klass[order]) != 0].min())
    saved = read_neighbors(paths, split)
    ties = int((np.diff(canonical[expected], axis=1) == 0).sum())
    print(
        f"{split}: {len(queries)} query chunks, {len(np.unique(expected))} distinct neighbours, "
        f"{ties} exact ties, smallest gap between different scores {min(gaps):.1e}"
    )
    assert saved.shape == (len(queries), K)
    assert np.array_equal(canonical[saved], canonical[expected])
    assert np.array_equal(
        np.sort(scores[np.arange(len(queries))[:, None], saved])[:, ::-1],
        np.sort(scores[np.arange(len(queries))[:, None], expected])[:, ::-1],
    )


def test_own_documents_are_left_out(flat: Path) -> None:
    """No neighbour comes from a document of its sample, though unfiltered the chunk's own
    text is its best match."""
    paths = ProjectPaths.of(flat)
    queries, own = query_embeddings(flat, "train")
    chunks = load_array(paths.chunks)
    keys = document_keys(chunks[:, 0], chunks[:, 1])
    saved = read_neighbors(paths, "train")
    assert (saved >= 0).all()
    for row in range(len(saved)):
        assert not np.isin(keys[saved[row]], own[row]).any()
    best = np.argmax(queries @ database_embeddings(flat).T, axis=1)
    own_first = np.mean([np.isin(keys[b], o) for b, o in zip(best, own, strict=True)])
    print(f"unfiltered, the best match is from the sample's own document for {own_first:.0%}")
    assert own_first > 0.5


def test_neighbours_with_continuations(flat: Path, inputs: dict) -> None:
    """core's ChunkDatabase reads a neighbour's tokens and its continuation (the next chunk
    of the same document, end-of-document tokens past its end)."""
    paths = ProjectPaths.of(flat)
    chunks = load_array(paths.chunks)
    dataset = IndexedDataset(inputs["data"])
    eod = gpt_tokenizer().eod
    db = ChunkDatabase(chunks, [dataset], 32, eod)
    neighbors = read_neighbors(paths, "train")[0]
    retrieved = db.retrieved_tokens(neighbors, 2)
    assert retrieved.shape == (K, 64)
    for row, chunk in enumerate(neighbors):
        _, doc, start, end, _ = (int(v) for v in chunks[chunk])
        tokens = dataset.get(doc)[:-1]  # without its end-of-document token
        assert np.array_equal(retrieved[row, : end - start], tokens[start:end])
        following = tokens[end : end + 32]
        assert np.array_equal(retrieved[row, 32 : 32 + len(following)], following)
        assert (retrieved[row, 32 + len(following) :] == eod).all()
    last_of_doc = int(np.flatnonzero(chunks[1:, 1] != chunks[:-1, 1])[0])
    assert (db.retrieved_tokens([last_of_doc], 2)[0, 32:] == eod).all()
    assert (db.retrieved_tokens([-1], 2) == eod).all()


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The real MiniLM-L6 over 60 documents, with a Flat project to compare against."""
    root = tmp_path_factory.mktemp("retro_minilm")
    data = write_dataset(root / "data" / "botchan", botchan_documents(count=60))
    bert = minilm_bert(root / "bert")
    flat = root / "flat"
    assert run(retro_argv(flat, [data], bert, retro_index_ntrain=200)) == 0
    return {"data": data, "bert": bert, "root": root, "flat": flat}


def recall_against_flat(minilm: dict, index_str: str, ntrain: int, nprobe: int) -> dict:
    """Build ``index_str`` over the Flat project's database and embeddings (copied: only the
    index differs) and return recall@K of Flat's neighbours per split."""
    project = minilm["root"] / index_str.replace(",", "_")
    for part in ("db", "embeddings"):
        shutil.copytree(minilm["flat"] / part, project / part)
    argv = retro_argv(
        project,
        [minilm["data"]],
        minilm["bert"],
        retro_index_str=index_str,
        retro_index_ntrain=ntrain,
        retro_query_nprobe=nprobe,
        retro_query_ef_search=32,
    )
    assert run(argv) == 0
    paths, exact = ProjectPaths.of(project), ProjectPaths.of(minilm["flat"])
    assert read_json(paths.db_manifest) == read_json(exact.db_manifest)
    recalls = {}
    for split in ("train", "valid"):
        got, want = read_neighbors(paths, split), read_neighbors(exact, split)
        recalls[split] = np.mean([len(set(g) & set(w)) / K for g, w in zip(got, want, strict=True)])
        print(
            f"MiniLM-L6, {len(load_array(paths.chunks))} chunks, {index_str} nprobe {nprobe}: "
            f"recall@{K} against Flat ({split}, {len(got)} query chunks) = {recalls[split]:.3f}"
        )
    return recalls


def test_ivf_probing_every_list_equals_flat(flat: Path, inputs: dict) -> None:
    """IVF with --retro-query-nprobe covering all its lists searches exhaustively: the same
    neighbours as Flat (the IVF path, query parameters included, without approximation)."""
    project = inputs["root"] / "ivf_all_lists"
    for part in ("db", "embeddings"):
        shutil.copytree(flat / part, project / part)
    argv = retro_argv(
        project, [inputs["data"]], inputs["bert"], retro_index_str="IVF8,Flat", retro_query_nprobe=8
    )
    assert run(argv) == 0
    for split in ("train", "valid"):
        ivf, exact = (
            read_neighbors(ProjectPaths.of(project), split),
            read_neighbors(ProjectPaths.of(flat), split),
        )
        assert np.array_equal(ivf, exact)


@pytest.mark.slow
def test_ivf_pq_recall_against_flat(minilm: dict) -> None:
    """An IVF,PQ index (4-bit codes: a few hundred chunks train it) finds most of Flat's
    neighbours of real MiniLM embeddings."""
    recalls = recall_against_flat(minilm, "IVF8,PQ48x4", ntrain=300, nprobe=2)
    assert min(recalls.values()) > 0.5


@pytest.mark.slow
@pytest.mark.parametrize("index_str", ["IVF16,PQ32", "OPQ32_128,IVF16_HNSW8,PQ32"])
def test_megatron_style_index_recall_against_flat(minilm: dict, index_str: str) -> None:
    """Megatron's index shapes (8-bit PQ, OPQ rotation, an HNSW coarse quantizer) on real
    MiniLM embeddings."""
    recalls = recall_against_flat(minilm, index_str, ntrain=300, nprobe=4)
    assert min(recalls.values()) > 0.3


def test_two_datasets_blended(tmp_path: Path) -> None:
    """A blend of two datasets: both are chunked (dataset column), the index is trained on
    chunks of each in proportion to the weights, and a sample's own documents are those of
    its own dataset (document 3 of the other dataset is not excluded)."""
    a = write_dataset(tmp_path / "data" / "a", botchan_documents(count=30))
    b = write_dataset(tmp_path / "data" / "b", botchan_documents(first=200, count=30))
    bert = tiny_bert(tmp_path / "bert")
    project = tmp_path / "p"
    assert run(retro_argv(project, ["3", a, "1", b], bert, retro_index_ntrain=100)) == 0
    paths = ProjectPaths.of(project)
    chunks = load_array(paths.chunks)
    infos = read_json(paths.datasets)
    assert [i["prefix"] for i in infos] == [a, b] and [i["ratio"] for i in infos] == [3.0, 1.0]
    assert [i["n_chunks"] for i in infos] == np.bincount(chunks[:, 0]).tolist()
    trained_on = chunks[load_array(paths.index_dir / "train_rows.npy"), 0]
    assert np.bincount(trained_on).tolist() == [75, 25]
    config = RetroConfig(**read_json(paths.config))
    dataset, n_samples = gpt_datasets(config, paths, None)["train"]
    reader = SampleReader(dataset, [a, b], config.retro_gpt_seq_length)
    keys = document_keys(chunks[:, 0], chunks[:, 1])
    neighbors = read_neighbors(paths, "train")
    seen = set()
    for sample in range(n_samples):
        _, own = reader.read(sample)
        seen.update((own >> 40).tolist())
        rows = neighbors[sample * 4 : (sample + 1) * 4]
        assert not np.isin(keys[rows[rows >= 0]], own).any()
    assert seen == {0, 1}  # samples of both datasets were queried
