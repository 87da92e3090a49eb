"""ICT: the (query sentence, block) samples of a sentence-split corpus, and `mg-train ict`."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from mg.core.tokenizers import TokenizerConfig, build_tokenizer
from mg.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from mg.indexed_dataset.ict_dataset import ICTDataset

sys.path.insert(0, str(Path(__file__).parent))
from sentence_data import DOCUMENTS, build_sentence_corpus, vocab_file  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Botchan sentences (one document per paragraph) and a title per document (its first
    three words)."""
    folder = tmp_path_factory.mktemp("ict")
    prefix = build_sentence_corpus(folder)
    sentences = IndexedDataset(prefix)
    tokenizer = build_tokenizer(TokenizerConfig("BertWordPieceLowerCase", vocab_file()))
    titles = str(folder / "titles_text_document")
    with IndexedDatasetBuilder(titles + ".bin", np.uint16) as builder:
        for doc in range(sentences.num_documents):
            first = sentences[int(sentences.document_indices[doc])][:3]
            builder.add_document(first, [len(first)])
        builder.finalize(titles + ".idx")
    return {"prefix": prefix, "titles": titles, "tokenizer": tokenizer, "folder": folder}


def test_ict_samples(corpus):
    sentences, titles = IndexedDataset(corpus["prefix"]), IndexedDataset(corpus["titles"])
    tok = corpus["tokenizer"]
    documents = np.arange(DOCUMENTS - 20)
    dataset = ICTDataset(
        sentences, documents, 300, 64, tok, titles=titles, query_in_block_prob=0.0, seed=7
    )
    bounds = sentences.document_indices
    assert len(dataset) == 300 and len(dataset.blocks) < 300  # more than one epoch of blocks
    for start, end, doc, _ in dataset.blocks:
        assert bounds[doc] <= start < end <= bounds[doc + 1] and end - start >= 2
    for idx in (0, 1, 17, 299):
        sample = dataset[idx]
        start, end, doc, _ = sample["block_data"]
        block = [sentences[i].tolist() for i in range(start, end)]
        query = sample["query_tokens"][: sample["query_pad_mask"].sum()].tolist()
        assert query[0] == tok.cls and query[-1] == tok.sep and query[1:-1] in block
        context = sample["context_tokens"][: sample["context_pad_mask"].sum()].tolist()
        title = titles[doc].tolist()
        assert context[: len(title) + 2] == [tok.cls, *title, tok.sep] and context[-1] == tok.sep
        rest = [s for s in block if s != query[1:-1]]
        assert context[len(title) + 2 : -1] == [t for s in rest for t in s][: 64 - 3 - len(title)]
        assert (sample["context_tokens"][sample["context_pad_mask"] == 0] == tok.pad).all()
        assert all(np.array_equal(v, dataset[idx][k]) for k, v in sample.items())  # same draw
    kept = ICTDataset(sentences, documents, 50, 64, tok, titles=titles, query_in_block_prob=1.0)
    sample = kept[3]
    query = sample["query_tokens"][1 : sample["query_pad_mask"].sum() - 1].tolist()
    context = sample["context_tokens"][: sample["context_pad_mask"].sum()].tolist()
    assert any(context[i : i + len(query)] == query for i in range(len(context)))


def test_titles_must_match_documents(corpus):
    sentences = IndexedDataset(corpus["prefix"])
    with pytest.raises(ValueError, match="one title per document"):
        ICTDataset(sentences, np.arange(10), 10, 64, corpus["tokenizer"], titles=sentences)
